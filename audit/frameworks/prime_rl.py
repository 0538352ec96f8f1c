"""PRIME-RL (PrimeIntellect-ai/prime-rl): the train–rollout mismatch figures its RL trainer logs, by
release (its releases are ``v0.8.1.devN``-style tags, one a commit on main).

Its loss (``src/prime_rl/trainer/rl/loss.py``) returns, per sample, the share of tokens its trust
region masks and the mismatch KL (k3 = r − log r − 1, r = p_trainer / p_inference) over the masked
and kept tokens (``_safe_mean``: 0 over no tokens); the trainer stacks these over samples (or
concatenates per-token values), gathers them over micro-batches and processes
(``Tensors.compute_stats`` in ``src/prime_rl/trainer/utils.py``) and logs ``/mean``, ``/median``,
``/std`` (n − 1), ``/min`` and ``/max`` of the gathered values; from 0.5.1.dev28 only ``/mean``
and ``/max`` reach the monitors (``filter_rl_trainer_tensor_stats_for_wandb``), and, for the token-
level ``mismatch_kl/all``, ``/std``. Per-environment copies (``mismatch_kl/<env>``) need the
environment of each sample, which isoaudit does not record, and are left out."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from isoaudit.audit.frameworks.base import Era, Figure, Framework, Settings, StepTokens

_LOSS = "src/prime_rl/trainer/rl/loss.py"
_TRAIN = "src/prime_rl/trainer/rl/train.py"
_ALL = ("mean", "median", "std", "min", "max")
_MEAN_MAX = ("mean", "max")
_TYPE = "loss.type"


def _stat(values: np.ndarray, stat: str) -> float:
    """One of ``Tensors.compute_stats``' statistics (torch's: the lower median, std with n − 1)."""
    if values.size == 0:
        return float("nan")
    if stat == "mean":
        return float(np.mean(values))
    if stat == "median":
        return float(np.sort(values)[(values.size - 1) // 2])
    if stat == "std":
        return float(np.std(values, ddof=1)) if values.size > 1 else float("nan")
    if stat == "min":
        return float(np.min(values))
    return float(np.max(values))


def _safe_means(tokens: StepTokens, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per sample: the sum of ``values`` over ``mask`` over max(count, 1) (``_safe_mean``)."""
    sums = tokens.sample_sums(np.where(mask, values, 0.0))
    counts = tokens.sample_sums(mask.astype(float))
    return sums / np.maximum(counts, 1.0)


def _k3(tokens: StepTokens) -> np.ndarray:
    return tokens.k3


def _advantage_of_token(tokens: StepTokens) -> np.ndarray | None:
    """Each token's sample advantage, None when any is unrecorded."""
    if tokens.advantages is None or np.any(np.isnan(tokens.advantages)):
        return None
    return tokens.advantages[tokens.sample_of_token]


# -- per-sample (or per-token) values of each key, by loss ----------------------------------------


def _ratio_masks(tokens: StepTokens, s: Settings) -> dict[str, np.ndarray]:
    """The loss to 0.4.1.dev85: token, geometric-mean and sequence masks on the importance ratio."""
    d = tokens.delta
    ratio = tokens.exp_delta
    geo = np.exp(_safe_means(tokens, d, np.ones_like(d, dtype=bool)))
    n = tokens.n_samples
    seq_min = np.full(n, np.inf)
    seq_max = np.full(n, -np.inf)
    for i in range(n):
        part = ratio[tokens.offsets[i] : tokens.offsets[i + 1]]
        if part.size:
            seq_min[i], seq_max[i] = part.min(), part.max()
    seq_low, seq_high = seq_min < s["loss.sequence_mask_low"], seq_max > s["loss.sequence_mask_high"]
    tok_low, tok_high = ratio < s["loss.token_mask_low"], ratio > s["loss.token_mask_high"]
    geo_low, geo_high = geo < s["loss.geo_mask_low"], geo > s["loss.geo_mask_high"]
    per_sample = (geo_low | geo_high | seq_low | seq_high)[tokens.sample_of_token]
    masked = tok_low | tok_high | per_sample
    k3 = _k3(tokens)
    every = np.ones_like(masked)
    return {
        "mismatch_kl": _safe_means(tokens, k3, every),
        "masked_mismatch_kl": _safe_means(tokens, k3, masked),
        "unmasked_mismatch_kl": _safe_means(tokens, k3, ~masked),
        "is_masked": masked.astype(float),
        "is_masked_low": tok_low.astype(float),
        "is_masked_high": tok_high.astype(float),
        "sequence_masked_low": seq_low.astype(float),
        "sequence_masked_high": seq_high.astype(float),
        "geo_masked_low": geo_low.astype(float),
        "geo_masked_high": geo_high.astype(float),
        "geo_seq_ratio": geo,
    }


def _prob_diff(tokens: StepTokens) -> np.ndarray:
    return tokens.p_trainer - tokens.p_rollout


def _masked_kl(tokens: StepTokens, masked: np.ndarray) -> dict[str, np.ndarray]:
    k3 = _k3(tokens)
    return {
        "masked_mismatch_kl": _safe_means(tokens, k3, masked),
        "unmasked_mismatch_kl": _safe_means(tokens, k3, ~masked),
    }


def _symmetric(tokens: StepTokens, s: Settings) -> dict[str, np.ndarray]:
    """0.4.1.dev86 to 0.5.1.dev37: mask tokens whose probability moved by more than ipo_mask_high
    up or ipo_mask_low down, whatever the advantage."""
    diff = _prob_diff(tokens)
    low, high = diff < -s["loss.ipo_mask_low"], diff > s["loss.ipo_mask_high"]
    masked = low | high
    every = np.ones_like(masked)
    return {
        "mismatch_kl": _safe_means(tokens, _k3(tokens), every),
        **_masked_kl(tokens, masked),
        "is_masked": _safe_means(tokens, masked.astype(float), every),
        "is_masked_low": _safe_means(tokens, low.astype(float), every),
        "is_masked_high": _safe_means(tokens, high.astype(float), every),
    }


def _dppo(tokens: StepTokens, s: Settings, *, signs: bool, sample_kl: bool) -> dict[str, np.ndarray]:
    """From 0.5.1.dev38 (the default loss): a positive advantage masks tokens whose probability rose
    by more than dppo_mask_high, any other (zero included) those that fell by more than
    dppo_mask_low; is_masked_high/low count only positive/negative advantages."""
    adv = _advantage_of_token(tokens)
    out: dict[str, np.ndarray] = {}
    every = np.ones(tokens.n_tokens, dtype=bool)
    if sample_kl:
        out["mismatch_kl"] = _safe_means(tokens, _k3(tokens), every)
    if adv is None:
        return out
    diff = _prob_diff(tokens)
    high, low = diff > s["loss.dppo_mask_high"], diff < -s["loss.dppo_mask_low"]
    positive, negative = adv > 0, adv < 0
    masked = np.where(positive, high, low)
    out.update(_masked_kl(tokens, masked))
    out["is_masked"] = _safe_means(tokens, masked.astype(float), every)
    out["is_masked_low"] = _safe_means(tokens, (negative & low).astype(float), every)
    out["is_masked_high"] = _safe_means(tokens, (positive & high).astype(float), every)
    if signs:
        out["masked_advantage_positive"] = _safe_means(tokens, positive.astype(float), masked)
        out["masked_advantage_negative"] = _safe_means(tokens, negative.astype(float), masked)
    return out


def _ipo(tokens: StepTokens, s: Settings) -> dict[str, np.ndarray]:
    """loss.type "ipo" (from 0.5.1.dev312): mask tokens whose probability moved by more than
    ipo_threshold either way."""
    masked = np.abs(_prob_diff(tokens)) > s["loss.ipo_threshold"]
    every = np.ones_like(masked)
    return {**_masked_kl(tokens, masked), "is_masked": _safe_means(tokens, masked.astype(float), every)}


# -- eras -------------------------------------------------------------------------------------------

Values = Callable[[StepTokens, Settings], dict[str, np.ndarray]]


def _logged(values: Values, stats: Callable[[str], tuple[str, ...]], token_kl: bool) -> Callable:
    def compute(tokens: StepTokens, settings: Settings) -> dict[str, float]:
        out: dict[str, float] = {}
        with np.errstate(over="ignore", invalid="ignore"):
            for key, array in values(tokens, settings).items():
                for stat in stats(key):
                    out[f"{key}/{stat}"] = _stat(array, stat)
            if token_kl:  # train.py: k3 over every loss token, whatever the loss
                out.update(_token_kl(tokens))
        return out

    return compute


def _token_kl(tokens: StepTokens) -> dict[str, float]:
    """``mismatch_kl/all``: :func:`_stat`'s mean, std (n − 1) and max of k3 over every loss token,
    from the step's blocks."""
    if tokens.n_tokens == 0:
        return {f"mismatch_kl/all/{stat}": float("nan") for stat in ("mean", "std", "max")}
    return {
        "mismatch_kl/all/mean": tokens.mean_of("k3"),
        "mismatch_kl/all/std": tokens.blocks.std("k3", ddof=1) if tokens.n_tokens > 1 else float("nan"),
        "mismatch_kl/all/max": tokens.blocks.max("k3"),
    }


def _default_only(values: Values) -> Values:
    """Loss figures only for the built-in loss (a custom or SFT loss logs its own)."""

    def pick(tokens: StepTokens, s: Settings) -> dict[str, np.ndarray]:
        return values(tokens, s) if s.get(_TYPE, "default") == "default" else {}

    return pick


def _by_type(tokens: StepTokens, s: Settings) -> dict[str, np.ndarray]:
    kind = s.get(_TYPE, "default")
    if kind == "default":
        return _dppo(tokens, s, signs=True, sample_kl=False)
    if kind == "ipo":
        return _ipo(tokens, s)
    return {}


_DEFINITIONS = {
    "mismatch_kl": "per sample, the mean k3 (r − log r − 1) over its loss tokens",
    "masked_mismatch_kl": "per sample, the mean k3 over its masked loss tokens (0 if none)",
    "unmasked_mismatch_kl": "per sample, the mean k3 over its kept loss tokens (0 if none)",
    "is_masked": "1 where the trust region masks a loss token (per sample: the share it masks)",
    "is_masked_low": "1 where a loss token is masked below the lower bound (per sample: the share)",
    "is_masked_high": "1 where a loss token is masked above the upper bound (per sample: the share)",
    "sequence_masked_low": "per sample, 1 if its smallest token ratio is below sequence_mask_low",
    "sequence_masked_high": "per sample, 1 if its largest token ratio is above sequence_mask_high",
    "geo_masked_low": "per sample, 1 if its geometric-mean ratio is below geo_mask_low",
    "geo_masked_high": "per sample, 1 if its geometric-mean ratio is above geo_mask_high",
    "geo_seq_ratio": "per sample, exp of the mean log ratio (geometric-mean importance ratio)",
    "masked_advantage_positive": "per sample, 1 if its advantage is positive and it has masked tokens",
    "masked_advantage_negative": "per sample, 1 if its advantage is negative and it has masked tokens",
}


def _figures(
    keys: dict[str, tuple[tuple[str, ...], str, tuple[str, ...], str]],
    stats: tuple[str, ...],
    source: str,
    token_kl: bool,
) -> tuple[Figure, ...]:
    """``keys``: name -> (settings, over what the statistic runs, needs, extra note)."""
    out = []
    for key, (settings, over, needs, note) in keys.items():
        for stat in stats:
            name = f"{key}/{stat}"
            definition = f"{stat} over {over} of {_DEFINITIONS[key]}{note}"
            out.append(
                Figure(
                    name,
                    definition,
                    settings=settings,
                    source=source,
                    needs=needs,
                )
            )
    if token_kl:
        for stat in ("mean", "std", "max"):
            out.append(
                Figure(
                    f"mismatch_kl/all/{stat}",
                    f"{stat} over every loss token of the step of k3 = r − log r − 1",
                    same_as="kl_k3" if stat == "mean" else None,
                    source=f"{_TRAIN}:train",
                )
            )
    return tuple(out)


_SAMPLES = "the step's samples"
_TOKENS = "the step's loss tokens"
_RATIO_SETTINGS = (
    "loss.token_mask_low",
    "loss.token_mask_high",
    "loss.geo_mask_low",
    "loss.geo_mask_high",
    "loss.sequence_mask_low",
    "loss.sequence_mask_high",
)
_IPO_MASK = (_TYPE, "loss.ipo_mask_low", "loss.ipo_mask_high")
_DPPO = (_TYPE, "loss.dppo_mask_low", "loss.dppo_mask_high")
_ADV = ("advantages",)


def _keys_ratio() -> dict:
    s, t = _SAMPLES, _TOKENS
    r = _RATIO_SETTINGS
    return {
        "mismatch_kl": ((), s, (), ""),
        "masked_mismatch_kl": (r, s, (), ""),
        "unmasked_mismatch_kl": (r, s, (), ""),
        "is_masked": (r, t, (), " (token, geometric-mean or sequence mask)"),
        "is_masked_low": (("loss.token_mask_low",), t, (), " (token ratio < token_mask_low)"),
        "is_masked_high": (("loss.token_mask_high",), t, (), " (token ratio > token_mask_high)"),
        "sequence_masked_low": (("loss.sequence_mask_low",), s, (), ""),
        "sequence_masked_high": (("loss.sequence_mask_high",), s, (), ""),
        "geo_masked_low": (("loss.geo_mask_low",), s, (), ""),
        "geo_masked_high": (("loss.geo_mask_high",), s, (), ""),
        "geo_seq_ratio": ((), s, (), ""),
    }


def _keys_symmetric() -> dict:
    note = ", per sample (|p_trainer − p_inference| beyond ipo_mask_low/high, either way)"
    return {
        "mismatch_kl": ((_TYPE,), _SAMPLES, (), ""),
        "masked_mismatch_kl": (_IPO_MASK, _SAMPLES, (), ""),
        "unmasked_mismatch_kl": (_IPO_MASK, _SAMPLES, (), ""),
        "is_masked": (_IPO_MASK, _SAMPLES, (), note),
        "is_masked_low": (_IPO_MASK, _SAMPLES, (), note),
        "is_masked_high": (_IPO_MASK, _SAMPLES, (), note),
    }


def _keys_dppo(*, signs: bool, sample_kl: bool, ipo: bool = False) -> dict:
    note = (
        ", per sample (advantage > 0: p_trainer − p_inference > dppo_mask_high; otherwise < −dppo_mask_low)"
    )
    dppo = _DPPO + (("loss.ipo_threshold",) if ipo else ())
    if ipo:
        note += "; loss.type ipo: |p_trainer − p_inference| > ipo_threshold, no low/high/sign figures"
    keys: dict = {}
    if sample_kl:
        keys["mismatch_kl"] = ((_TYPE,), _SAMPLES, (), "")
    keys["masked_mismatch_kl"] = (dppo, _SAMPLES, _ADV, "")
    keys["unmasked_mismatch_kl"] = (dppo, _SAMPLES, _ADV, "")
    keys["is_masked"] = (dppo, _SAMPLES, _ADV, note)
    keys["is_masked_low"] = (_DPPO, _SAMPLES, _ADV, note)
    keys["is_masked_high"] = (_DPPO, _SAMPLES, _ADV, note)
    if signs:
        keys["masked_advantage_positive"] = (_DPPO, _SAMPLES, _ADV, "")
        keys["masked_advantage_negative"] = (_DPPO, _SAMPLES, _ADV, "")
    return keys


def _stats_of(stats: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    return lambda key: stats


_RATIO_DEFAULTS = {
    "loss.token_mask_low": 0.125,
    "loss.token_mask_high": 8.0,
    "loss.geo_mask_low": 0.1,
    "loss.geo_mask_high": 10.0,
    "loss.sequence_mask_low": 0.0,
    "loss.sequence_mask_high": 100.0,
}
_IPO_DEFAULTS = {_TYPE: "default", "loss.ipo_mask_low": 0.2, "loss.ipo_mask_high": 0.2}
_DPPO_DEFAULTS = {_TYPE: "default", "loss.dppo_mask_low": 0.2, "loss.dppo_mask_high": 0.2}


def _era(
    since: str,
    commit: str,
    date: str,
    change: str,
    keys: dict,
    stats: tuple[str, ...],
    values: Values,
    defaults: dict,
    token_kl: bool = False,
) -> Era:
    return Era(
        since=since,
        commit=commit,
        date=date,
        change=change,
        figures=_figures(keys, stats, f"{_LOSS}:compute_loss", token_kl),
        compute=_logged(values, _stats_of(stats), token_kl),
        defaults=defaults,
    )


ERAS = (
    _era(
        "0.2",
        "5f47740ddfb0103148cb750ead3f8920025ca6fb",
        "2025-12-19",
        "token, geometric-mean and sequence masks on the importance ratio; is_masked* per token",
        _keys_ratio(),
        _ALL,
        _ratio_masks,
        _RATIO_DEFAULTS,
    ),
    _era(
        "0.4.1.dev86",
        "02bdca2e419f87aec5c6e3f3bbcb68a7412c6f9d",
        "2026-03-03",
        "default loss masks on the probability difference (ipo_mask_low/high), per sample",
        _keys_symmetric(),
        _ALL,
        _default_only(_symmetric),
        _IPO_DEFAULTS,
    ),
    _era(
        "0.5.1.dev28",
        "27645f39ab6f1550b2990ba4c5bb47be7f35402e",
        "2026-04-01",
        "only /mean and /max of the mask and mismatch-KL figures reach the monitors",
        _keys_symmetric(),
        _MEAN_MAX,
        _default_only(_symmetric),
        _IPO_DEFAULTS,
    ),
    _era(
        "0.5.1.dev38",
        "ff4b125e4b97d0bfeca7fb18d225bd342cedc345",
        "2026-04-06",
        "default loss DPPO+KL: the mask follows the advantage's sign (dppo_mask_low/high)",
        _keys_dppo(signs=False, sample_kl=True),
        _MEAN_MAX,
        _default_only(lambda t, s: _dppo(t, s, signs=False, sample_kl=True)),
        _DPPO_DEFAULTS,
    ),
    _era(
        "0.5.1.dev178",
        "c654dc1d4d5d825586cab11456aa5ca76dda3238",
        "2026-05-14",
        "masked_advantage_positive/negative: the advantage signs of samples with masked tokens",
        _keys_dppo(signs=True, sample_kl=True),
        _MEAN_MAX,
        _default_only(lambda t, s: _dppo(t, s, signs=True, sample_kl=True)),
        _DPPO_DEFAULTS,
    ),
    _era(
        "0.5.1.dev192",
        "46653c1d70c74a236251254953d9209c6df14447",
        "2026-05-18",
        "mismatch_kl moves to the trainer as mismatch_kl/all: a token-level k3 (mean, std, max)",
        _keys_dppo(signs=True, sample_kl=False),
        _MEAN_MAX,
        _default_only(lambda t, s: _dppo(t, s, signs=True, sample_kl=False)),
        _DPPO_DEFAULTS,
        token_kl=True,
    ),
    _era(
        "0.5.1.dev312",
        "77af0375373f2267572b5eed20256386069e2af8",
        "2026-06-14",
        'loss.type "ipo": a symmetric mask on |Δp| > ipo_threshold',
        _keys_dppo(signs=True, sample_kl=False, ipo=True),
        _MEAN_MAX,
        _by_type,
        {**_DPPO_DEFAULTS, "loss.ipo_threshold": 0.1},
        token_kl=True,
    ),
    _era(
        "0.8.1.dev9",
        "bb23623d6e6cd4ecc76893c1005d676f384a1e54",
        "2026-08-11",
        "dppo_mask_low/high default to 0.1",
        _keys_dppo(signs=True, sample_kl=False, ipo=True),
        _MEAN_MAX,
        _by_type,
        {**_DPPO_DEFAULTS, "loss.dppo_mask_low": 0.1, "loss.dppo_mask_high": 0.1, "loss.ipo_threshold": 0.1},
        token_kl=True,
    ),
    _era(
        "0.8.1.dev14",
        "82acb12ed72c5c1a0d84318504d3b401ef6a666b",
        "2026-08-11",
        "dppo_mask_low/high back to 0.2",
        _keys_dppo(signs=True, sample_kl=False, ipo=True),
        _MEAN_MAX,
        _by_type,
        {**_DPPO_DEFAULTS, "loss.ipo_threshold": 0.1},
        token_kl=True,
    ),
)


FRAMEWORK = Framework("prime-rl", "PrimeIntellect-ai/prime-rl", ERAS)
