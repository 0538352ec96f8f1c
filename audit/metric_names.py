"""Every framework's name for the train–rollout mismatch figures, as aliases of the one definition
in :mod:`audit.metrics` (DESIGN.md, "Metrics").

A user coming from verl, slime, SkyRL, TRL, OpenRLHF, NeMo-RL, Tinker or PRIME-RL finds their own
figure under the name their training logs use. An alias points at a *stored key*: a canonical
metric (``kl_k3``) or a threshold figure at that framework's default bounds (``tis_mean[cap=3]``,
TRL's cap). Where a framework computes the figure in a way that differs in a detail (ddof, a clamp),
the alias says so in ``note`` rather than silently pretending to be identical.

Names are accepted as: a stored key (``kl_k3``, ``tis_mean[cap=3]``, ``kl_k3/len_0_256``,
``kl_k3/lag_1``), ``framework:alias`` (``verl:rollout_corr/k3_kl``), or a bare alias when only one
definition answers to it (``kl_sample_train_v1``). :func:`resolve` turns any of them into a key.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from isoaudit.audit.metrics import (
    LENGTH_BUCKETS,
    METRIC_DESCRIPTIONS,
    PARAMETRIC,
    RS_OPTIONS,
    STEP_METRICS,
    TIS_FAMILY,
    ParamValue,
    parse_lag_key,
    parse_variant,
    variant_key,
)
from isoaudit.audit.routing import ROUTING_METRICS

FRAMEWORKS: tuple[str, ...] = ("verl", "slime", "skyrl", "trl", "openrlhf", "nemo-rl", "tinker", "prime-rl")

#: Figures the comparator adds beside the token metrics (audit.compare), with their one-liners.
EXTRA_DESCRIPTIONS: dict[str, str] = {
    "policy_lag_mean": "mean policy lag over tokens: trainer weight version minus the version that sampled the token",
    "policy_lag_max": "max policy lag over tokens",
    "policy_lag_min": "min policy lag over tokens",
    "off_policy_token_fraction": "fraction of tokens sampled with weights older than the trainer's (lag > 0)",
    **ROUTING_METRICS,  # MoE routing agreement (audit.routing)
}


class UnknownMetric(ValueError):
    """A metric name that is neither a stored key nor an alias; the message suggests the nearest."""


@dataclass(frozen=True)
class Alias:
    framework: str
    name: str  #: as the framework logs it
    key: str  #: the stored key it reads (canonical name or threshold variant)
    note: str = ""  #: where the framework's own computation differs in a detail
    also: tuple[str, ...] = ()  #: other spellings the framework logs it under (prefixes)

    @property
    def qualified(self) -> str:
        return f"{self.framework}:{self.name}"

    def spellings(self) -> tuple[str, ...]:
        return (self.name, *self.also)


def _a(
    framework: str, name: str, canonical: str, note: str = "", also: Iterable[str] = (), **params: ParamValue
) -> Alias:
    key = variant_key(canonical, params) if canonical in PARAMETRIC else canonical
    return Alias(framework, name, key, note, tuple(also))


def _tis_aliases(
    framework: str,
    pattern: str,
    statistics: Iterable[str],
    notes: str | Mapping[str, str] = "",
    **params: float,
) -> list[Alias]:
    """``framework``'s names for members of the truncated-importance-weight family
    (:data:`audit.metrics.TIS_FAMILY`, ``tis_<statistic>``): ``pattern`` with ``{}`` the statistic
    (``rollout_is_{}``), ``notes`` one note for all or per statistic, ``params`` the framework's cap."""
    out = []
    for statistic in statistics:
        figure = f"tis_{statistic}"
        if figure not in TIS_FAMILY:
            raise ValueError(f"{framework}: {figure} is not a member of the TIS family")
        note = notes if isinstance(notes, str) else notes.get(statistic, "")
        out.append(Alias(framework, pattern.format(statistic), variant_key(figure, dict(params)), note))
    return out


_VERL_STD = "verl uses torch.std (ddof=1); isoaudit's std is ddof=0 (a factor sqrt(n/(n-1)))"
_VERL_RS = "verl requires rollout_rs_threshold (no default); isoaudit's default bounds are shown, set yours"


def _verl() -> list[Alias]:
    rc = "rollout_corr/"
    out = [
        _a("verl", rc + "kl", "kl_k1"),
        _a("verl", rc + "k3_kl", "kl_k3"),
        _a("verl", rc + "chi2_token", "chi2_token"),
        _a("verl", rc + "chi2_seq", "chi2_seq"),
        _a("verl", rc + "log_ppl_diff", "log_ppl_diff"),
        _a("verl", rc + "log_ppl_abs_diff", "log_ppl_abs_diff"),
        _a("verl", rc + "log_ppl_diff_max", "log_ppl_diff_max"),
        _a("verl", rc + "log_ppl_diff_min", "log_ppl_diff_min"),
        _a("verl", rc + "ppl_ratio", "ppl_ratio"),
        _a("verl", rc + "training_ppl", "training_ppl"),
        _a("verl", rc + "training_log_ppl", "training_log_ppl"),
        _a("verl", rc + "rollout_ppl", "rollout_ppl"),
        _a("verl", rc + "rollout_log_ppl", "rollout_log_ppl"),
        *_tis_aliases(
            "verl",
            rc + "rollout_is_{}",
            ("mean", "std", "min", "max"),
            {"mean": "token level, rollout_is_threshold=2.0 (TIS)"},
        ),
        _a("verl", rc + "rollout_is_eff_sample_size", "tis_ess_fraction", "verl adds 1e-8 to the mean"),
        _a("verl", rc + "rollout_is_ratio_fraction_high", "is_fraction_high"),
        _a("verl", rc + "rollout_is_ratio_fraction_low", "is_fraction_low", "lower defaults to 1/threshold"),
        *_tis_aliases("verl", rc + "rollout_is_{}", ("seq_mean", "seq_max", "seq_min", "seq_max_deviation")),
        _a("verl", rc + "rollout_is_seq_fraction_high", "is_seq_fraction_high"),
        _a("verl", rc + "rollout_is_seq_fraction_low", "is_seq_fraction_low"),
        _a("verl", rc + "rollout_is_oob_ratio", "is_oob_fraction", "IcePop: threshold given as lower_upper"),
        _a("verl", "training/rollout_probs_diff_max", "rollout_probs_diff_max"),
        _a("verl", "training/rollout_probs_diff_mean", "rollout_probs_diff_mean"),
        _a("verl", "training/rollout_probs_diff_std", "rollout_probs_diff_std", _VERL_STD),
        _a("verl", "training/rollout_actor_probs_pearson_corr", "rollout_actor_probs_pearson_corr"),
    ]
    for option in RS_OPTIONS:
        out.append(
            _a("verl", f"{rc}rollout_rs_{option}_masked_fraction", f"rs_{option}_masked_fraction", _VERL_RS)
        )
        out.append(
            _a(
                "verl",
                f"{rc}rollout_rs_{option}_seq_masked_fraction",
                f"rs_{option}_seq_masked_fraction",
                _VERL_RS,
            )
        )
    return out


_SLIME_AGG = "slime reduces per sample first (calculate_per_token_loss=False, its default)"
_SLIME_BOUNDS = "mis_upper_bound=2.0, mis_lower_bound=0.5 (1/upper)"


def _slime() -> list[Alias]:
    def mis(name: str, canonical: str, note: str = _SLIME_AGG, **params: ParamValue) -> Alias:
        return _a("slime", f"mis_{name}", canonical, note, (f"train/mis_{name}",), **params)

    return [
        _a(
            "slime",
            "train_rollout_logprob_abs_diff",
            "logprob_abs_diff_sample_mean",
            _SLIME_AGG,
            ("train/train_rollout_logprob_abs_diff",),
        ),
        mis("kl", "kl_k1_sample_mean"),
        mis("k3_kl", "kl_k3_sample_mean"),
        mis("log_ppl_diff", "log_ppl_diff"),
        mis("log_ppl_abs_diff", "log_ppl_abs_diff"),
        mis("ppl_ratio", "ppl_ratio"),
        mis("training_ppl", "training_ppl"),
        mis("rollout_ppl", "rollout_ppl"),
        mis("training_log_ppl", "training_log_ppl"),
        mis("rollout_log_ppl", "rollout_log_ppl"),
        mis("truncate_fraction", "is_fraction_high", f"{_SLIME_AGG}; {_SLIME_BOUNDS}", aggregate="sample"),
        mis("clip_fraction_high", "is_fraction_high", f"{_SLIME_AGG}; {_SLIME_BOUNDS}", aggregate="sample"),
        mis("clip_fraction_low", "is_fraction_low", f"{_SLIME_AGG}; {_SLIME_BOUNDS}", aggregate="sample"),
        mis("mask_fraction_high", "is_fraction_high", f"{_SLIME_AGG}; {_SLIME_BOUNDS}", aggregate="sample"),
        mis("mask_fraction_low", "is_fraction_low", f"{_SLIME_AGG}; {_SLIME_BOUNDS}", aggregate="sample"),
    ]


def _skyrl() -> list[Alias]:
    p = "policy/"
    return [
        _a("skyrl", p + "rollout_train_logprobs_abs_diff_mean", "logprob_abs_diff_mean"),
        _a("skyrl", p + "rollout_train_logprobs_abs_diff_std", "logprob_abs_diff_std", "SkyRL uses ddof=1"),
        _a("skyrl", p + "rollout_train_logprobs_abs_diff_max", "logprob_abs_diff_max"),
    ]


_TRL_CAP = "vllm_importance_sampling_mode=token_truncate, vllm_importance_sampling_cap=3.0 (2.0 in older TRL releases)"


def _trl() -> list[Alias]:
    s = "sampling/"
    return [
        _a("trl", s + "sampling_logp_difference/mean", "logprob_abs_diff_mean"),
        _a("trl", s + "sampling_logp_difference/max", "logprob_abs_diff_max"),
        *_tis_aliases("trl", s + "importance_sampling_ratio/{}", ("min", "mean", "max"), _TRL_CAP, cap=3.0),
    ]


_ORLHF = "--vllm_is_truncated_threshold 0.5 5.0"


def _openrlhf() -> list[Alias]:
    return [
        _a("openrlhf", "vllm_kl", "kl_k1"),
        _a(
            "openrlhf",
            "is_filter_ratio",
            "is_oob_fraction",
            f"TIS clamps / IcePop masks these tokens; {_ORLHF}",
        ),
        _a(
            "openrlhf",
            "is_filter_ratio:icepop",
            "is_oob_fraction",
            f"--vllm_is_correction_type icepop; {_ORLHF}",
        ),
        _a(
            "openrlhf",
            "is_filter_ratio:seq-mask-tis",
            "geo_oob_seq_fraction",
            f"--vllm_is_correction_type seq-mask-tis; {_ORLHF}",
        ),
    ]


def _nemo_rl() -> list[Alias]:
    t = "train/"

    def n(name: str, canonical: str, note: str = "", **params: ParamValue) -> Alias:
        return _a("nemo-rl", name, canonical, note, (t + name,), **params)

    return [
        n("token_mult_prob_error", "token_mult_prob_error"),
        n(
            "gen_kl_error",
            "kl_k3",
            "k3 estimate of KL(P_gen ‖ P_train) per sampled token (reference_policy_kl_type=k3)",
        ),
        n("policy_kl_error", "kl_k3_reverse", "k3 estimate of KL(P_train ‖ P_gen) per sampled token"),
        n("js_divergence_error", "js_divergence"),
        n(
            "sampling_importance_ratio",
            "is_mean",
            "NeMo-RL maps non-finite weights to 0; isoaudit clamps Δ to ±20",
        ),
        n(
            "is_oob_ratio",
            "is_oob_fraction",
            "IcePop, truncated_importance_sampling_ratio_min/max (ref 0.5, 5)",
        ),
    ]


def _tinker() -> list[Alias]:
    return [
        _a("tinker", "kl_sample_train_v1", "kl_k1", also=("optim/kl_sample_train_v1",)),
        _a("tinker", "kl_sample_train_v2", "kl_k2", also=("optim/kl_sample_train_v2",)),
    ]


_PRIME = "prime-rl token_mask_low=0.125, token_mask_high=8"


def _prime_rl() -> list[Alias]:
    return [
        _a("prime-rl", "mismatch_kl/all/mean", "kl_k3", also=("mismatch_kl/mean", "mismatch_kl")),
        _a(
            "prime-rl",
            "kl_ent_ratio/mean",
            "kl_ent_ratio",
            "prime-rl divides by the trainer's full entropy; isoaudit by the recorded top-k entropy (a lower bound)",
            ("kl_ent_ratio",),
        ),
        _a("prime-rl", "is_masked/mean", "is_oob_fraction", _PRIME, lower=0.125, upper=8.0),
        _a("prime-rl", "is_masked_low/mean", "is_fraction_low", _PRIME, lower=0.125),
        _a("prime-rl", "is_masked_high/mean", "is_fraction_high", _PRIME, upper=8.0),
    ]


#: Every alias, grouped by framework in FRAMEWORKS order.
ALIASES: tuple[Alias, ...] = (
    *_verl(),
    *_slime(),
    *_skyrl(),
    *_trl(),
    *_openrlhf(),
    *_nemo_rl(),
    *_tinker(),
    *_prime_rl(),
)

_BY_QUALIFIED: dict[str, Alias] = {
    f"{a.framework}:{spelling}": a for a in ALIASES for spelling in a.spellings()
}
_BY_BARE: dict[str, list[Alias]] = {}
for _alias in ALIASES:
    for _spelling in _alias.spellings():
        _BY_BARE.setdefault(_spelling, []).append(_alias)


def canonical_names() -> list[str]:
    """Every base metric name (no length/lag slice, threshold figures at their defaults)."""
    return [*STEP_METRICS, *PARAMETRIC, *EXTRA_DESCRIPTIONS]


def is_key(key: str) -> bool:
    """Whether ``key`` is a stored key: a step metric (sliced or not), a lag slice, an extra figure,
    or a threshold figure at valid parameters."""
    if key in METRIC_DESCRIPTIONS or key in EXTRA_DESCRIPTIONS or parse_lag_key(key) is not None:
        return True
    try:
        name, params = parse_variant(key)
    except ValueError:
        return False
    return variant_key(name, params) == key


def resolve(name: str, framework: str | None = None) -> str:
    """The stored key ``name`` means. ``framework`` qualifies a bare alias (``--names verl``)."""
    if not isinstance(name, str) or not name:
        raise UnknownMetric("metric: expected a metric name")
    if is_key(name):
        return name
    if name in _BY_QUALIFIED:
        return _BY_QUALIFIED[name].key
    if framework is not None and f"{framework}:{name}" in _BY_QUALIFIED:
        return _BY_QUALIFIED[f"{framework}:{name}"].key
    candidates = _BY_BARE.get(name, [])
    keys = sorted({a.key for a in candidates})
    if len(keys) == 1:
        return keys[0]
    if len(keys) > 1:
        raise UnknownMetric(
            f"metric: {name!r} is ambiguous; qualify it with its framework: "
            + ", ".join(sorted({a.qualified for a in candidates}))
        )
    near = difflib.get_close_matches(name, accepted_names(), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise UnknownMetric(
        f"metric: {name!r} is not a metric or a framework alias{hint}; `isoaudit metrics list` shows all"
    )


def accepted_names() -> list[str]:
    """Every name :func:`resolve` accepts, except length/lag slices and other threshold variants."""
    return sorted({*canonical_names(), *required_variants(), *_BY_QUALIFIED, *_BY_BARE})


def required_variants() -> list[str]:
    """Threshold-figure keys at non-default parameters that some alias reads: the comparator
    computes these on every step beside the defaults."""
    return sorted({a.key for a in ALIASES if "[" in a.key})


def aliases_of(key: str) -> list[Alias]:
    return [a for a in ALIASES if a.key == key]


def framework_aliases(framework: str) -> list[Alias]:
    if framework not in FRAMEWORKS:
        raise UnknownMetric(f"framework: {framework!r} is not one of {', '.join(FRAMEWORKS)}")
    return [a for a in ALIASES if a.framework == framework]


def definition(key: str) -> str:
    """The one-line definition of a stored key (threshold figures with their parameter values)."""
    if key in METRIC_DESCRIPTIONS:
        return METRIC_DESCRIPTIONS[key]
    if key in EXTRA_DESCRIPTIONS:
        return EXTRA_DESCRIPTIONS[key]
    lag = parse_lag_key(key)
    if lag is not None:
        return f"{METRIC_DESCRIPTIONS[lag[0]]}; tokens sampled with weights {lag[1]} version(s) behind the trainer"
    name, params = parse_variant(key)
    shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return f"{PARAMETRIC[name].description} ({shown})"


def select(metrics: Mapping[str, Any], names: Iterable[str], framework: str | None = None) -> dict[str, Any]:
    """``metrics`` (stored keys) restricted to ``names`` and keyed by the names as asked, so a client
    that asked for ``verl:rollout_corr/k3_kl`` reads it back under that name. A name whose key the
    step lacks is left out; an unknown name raises :class:`UnknownMetric`."""
    out = {}
    for name in names:
        key = resolve(name, framework)
        if key in metrics:
            out[name] = metrics[key]
    return out


def as_framework(metrics: Mapping[str, Any], framework: str) -> dict[str, Any]:
    """A step's figures under ``framework``'s names (the ones it logs), in its order."""
    return {a.name: metrics.get(a.key) for a in framework_aliases(framework) if a.key in metrics}


def selector_options() -> list[dict[str, str]]:
    """Options for the dashboard's metric selector: one per base metric, ``value`` the stored key,
    ``label`` the key and its framework names, ``title`` the definition (a tooltip)."""
    options = []
    for key in [*canonical_names(), *required_variants()]:
        names = [a.qualified for a in aliases_of(key)]
        label = key if not names else f"{key} ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
        options.append({"value": key, "label": label, "title": definition(key)})
    return options


def catalogue() -> list[dict[str, Any]]:
    """Every base metric with its definition, parameters and aliases (``isoaudit metrics list``,
    ``GET /v1/metric-names``)."""
    rows = []
    for key in [*canonical_names(), *required_variants()]:
        params: dict[str, Any] = {}
        if key in PARAMETRIC or "[" in key:
            params = parse_variant(key)[1]
        rows.append(
            {
                "key": key,
                "definition": definition(key),
                "parameters": params,
                "sliced": [f"{key}/{b}" for b in LENGTH_BUCKETS] if key in STEP_METRICS else [],
                "aliases": [
                    {"framework": a.framework, "name": a.name, "also": list(a.also), "note": a.note}
                    for a in aliases_of(key)
                ],
            }
        )
    return rows


def finite(value: Any) -> float | None:
    """A metric value for display: None for missing or non-finite."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
