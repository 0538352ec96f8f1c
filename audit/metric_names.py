"""Every framework's name for the train–rollout mismatch figures (DESIGN.md, "Metrics"; docs/parity.md).

A user coming from verl, slime, SkyRL, TRL, OpenRLHF, NeMo-RL, Tinker or PRIME-RL finds their own
figure under the name their training logs use, with the value their framework's own code gives: each
framework's figures are computed by :mod:`audit.frameworks` following that framework's arithmetic at
the release the run declares, and stored under ``framework:name`` keys (``verl:rollout_corr/k3_kl``).
An :class:`Alias` is one such figure: its name (and the spellings it is also logged under), its
stored key, its definition, and the canonical metric it equals exactly, where one does.

Names are accepted as: a stored key (``kl_k3``, ``tis_mean[cap=3]``, ``kl_k3/len_0_256``,
``kl_k3/lag_1``, ``verl:rollout_corr/k3_kl``), ``framework:alias`` (``slime:train/mis_k3_kl``), or a
bare alias when only one figure answers to it (``kl_sample_train_v1``). :func:`resolve` turns any of
them into a key.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from isoaudit.audit.distribution import DISTRIBUTION_METRICS
from isoaudit.audit.frameworks import (
    FRAMEWORK_TABLES,
    FRAMEWORKS,
    REQUIRED,
    Framework,
    framework_table,
    parse_declaration,
    qualified,
)
from isoaudit.audit.metrics import (
    LENGTH_BUCKETS,
    METRIC_DESCRIPTIONS,
    PARAMETRIC,
    STALENESS_DESCRIPTIONS,
    STEP_METRICS,
    UNSLICED_DESCRIPTIONS,
    parse_lag_key,
    parse_variant,
    variant_key,
)
from isoaudit.audit.routing import ROUTING_METRICS

#: Figures the comparator adds beside the token metrics (audit.compare), with their one-liners.
EXTRA_DESCRIPTIONS: dict[str, str] = {
    "policy_lag_mean": "mean policy lag over tokens: trainer weight version minus the version that sampled the token",
    "policy_lag_max": "max policy lag over tokens",
    "policy_lag_min": "min policy lag over tokens",
    "off_policy_token_fraction": "fraction of tokens sampled with weights older than the trainer's (lag > 0)",
    **ROUTING_METRICS,  # MoE routing agreement (audit.routing)
    **DISTRIBUTION_METRICS,  # full-distribution drift on fingerprinted steps (audit.distribution)
    **UNSLICED_DESCRIPTIONS,  # the noise-vs-bias fit of a step (audit.metrics.noise)
    **STALENESS_DESCRIPTIONS,  # sample-weighted staleness and tokens per lag (audit.metrics.lags)
}

#: Threshold figures at parameters other than their defaults that the comparator computes on every
#: step (the importance-weight caps and bounds frameworks commonly use), for rules and charts.
STANDING_VARIANTS: tuple[str, ...] = (
    variant_key("is_fraction_high", {"aggregate": "sample"}),
    variant_key("is_fraction_high", {"upper": 8.0}),
    variant_key("is_fraction_low", {"aggregate": "sample"}),
    variant_key("is_fraction_low", {"lower": 0.125}),
    variant_key("is_oob_fraction", {"lower": 0.125, "upper": 8.0}),
    variant_key("tis_max", {"cap": 3.0}),
    variant_key("tis_mean", {"cap": 3.0}),
    variant_key("tis_min", {"cap": 3.0}),
)


class UnknownMetric(ValueError):
    """A metric name that is neither a stored key nor an alias; the message suggests the nearest."""


@dataclass(frozen=True)
class Alias:
    """One figure a framework logs (at some release), as isoaudit stores and shows it."""

    framework: str
    name: str  #: as the framework logs it
    key: str  #: the stored key (``framework:name``)
    note: str = ""  #: its definition, in the framework's terms (the newest release's)
    also: tuple[str, ...] = ()  #: other spellings the framework logs it under (prefixes)
    same_as: str | None = None  #: the canonical metric it equals exactly, where one does
    settings: tuple[str, ...] = ()  #: the framework settings its value depends on
    releases: tuple[str, ...] = ()  #: the eras (first release of each) that log it

    @property
    def qualified(self) -> str:
        return f"{self.framework}:{self.name}"

    def spellings(self) -> tuple[str, ...]:
        return (self.name, *self.also)


def _aliases_of(table: Framework) -> list[Alias]:
    """``table``'s figures over all its eras, newest definition first-listed in the newest order."""
    seen: dict[str, Alias] = {}
    for era in table.eras:
        for figure in era.figures:
            before = seen.pop(figure.name, None)
            seen[figure.name] = Alias(
                table.name,
                figure.name,
                qualified(table.name, figure.name),
                figure.definition,
                tuple(dict.fromkeys((*(before.also if before else ()), *figure.also))),
                figure.same_as,
                figure.settings,
                (*(before.releases if before else ()), era.since),
            )
    head = [f.name for f in table.head.figures] if table.eras else []
    return [seen[n] for n in head] + [a for n, a in seen.items() if n not in head]


#: Every alias, grouped by framework in FRAMEWORKS order (the newest release's figures first).
ALIASES: tuple[Alias, ...] = tuple(a for table in FRAMEWORK_TABLES.values() for a in _aliases_of(table))

_BY_QUALIFIED: dict[str, Alias] = {
    f"{a.framework}:{spelling}": a for a in ALIASES for spelling in a.spellings()
}
_BY_KEY: dict[str, Alias] = {a.key: a for a in ALIASES}
_BY_BARE: dict[str, list[Alias]] = {}
for _alias in ALIASES:
    for _spelling in _alias.spellings():
        _BY_BARE.setdefault(_spelling, []).append(_alias)


def canonical_names() -> list[str]:
    """Every base metric name (no length/lag slice, threshold figures at their defaults)."""
    return [*STEP_METRICS, *PARAMETRIC, *EXTRA_DESCRIPTIONS]


def is_key(key: str) -> bool:
    """Whether ``key`` is a stored key: a step metric (sliced or not), a lag slice, an extra figure,
    a framework figure (``verl:rollout_corr/k3_kl``) or a threshold figure at valid parameters."""
    if key in METRIC_DESCRIPTIONS or key in EXTRA_DESCRIPTIONS or key in _BY_KEY:
        return True
    if parse_lag_key(key) is not None:
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
    """Threshold-figure keys at non-default parameters the comparator computes on every step."""
    return sorted(STANDING_VARIANTS)


def aliases_of(key: str) -> list[Alias]:
    """The framework figures that equal canonical metric ``key`` exactly, or the one stored as ``key``."""
    return [a for a in ALIASES if a.same_as == key or a.key == key]


def framework_aliases(framework: str) -> list[Alias]:
    """Every figure ``framework`` logs at any release isoaudit covers (the newest release's first)."""
    if framework not in FRAMEWORKS:
        raise UnknownMetric(f"framework: {framework!r} is not one of {', '.join(FRAMEWORKS)}")
    return [a for a in ALIASES if a.framework == framework]


def definition(key: str) -> str:
    """The one-line definition of a stored key (threshold figures with their parameter values)."""
    if key in METRIC_DESCRIPTIONS:
        return METRIC_DESCRIPTIONS[key]
    if key in EXTRA_DESCRIPTIONS:
        return EXTRA_DESCRIPTIONS[key]
    if key in _BY_KEY:
        return _BY_KEY[key].note
    lag = parse_lag_key(key)
    if lag is not None:
        return f"{METRIC_DESCRIPTIONS[lag[0]]}; tokens sampled with weights {lag[1]} version(s) behind the trainer"
    name, params = parse_variant(key)
    shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return f"{PARAMETRIC[name].description} ({shown})"


def is_framework_key(key: str) -> bool:
    """Whether ``key`` is a framework figure's stored key (``verl:rollout_corr/k3_kl``)."""
    framework, colon, _ = key.partition(":")
    return bool(colon) and framework in FRAMEWORK_TABLES


def lookup(metrics: Mapping[str, Any], key: str) -> Any:
    """The value of stored key ``key`` in a step's ``metrics``, None when absent. A step compared
    before framework figures were stored (it holds none) answers a framework figure that equals a
    canonical metric exactly with that metric; a newer step without the figure means the framework
    does not log it at the run's release and settings, and answers None."""
    if key in metrics:
        return metrics[key]
    alias = _BY_KEY.get(key)
    if alias is None or alias.same_as is None or any(is_framework_key(k) for k in metrics):
        return None
    return metrics.get(alias.same_as)


def select(metrics: Mapping[str, Any], names: Iterable[str], framework: str | None = None) -> dict[str, Any]:
    """``metrics`` (stored keys) restricted to ``names`` and keyed by the names as asked, so a client
    that asked for ``verl:rollout_corr/k3_kl`` reads it back under that name. A name whose key the
    step lacks is left out; an unknown name raises :class:`UnknownMetric`."""
    out = {}
    for name in names:
        key = resolve(name, framework)
        value = lookup(metrics, key)
        if value is not None or key in metrics:
            out[name] = value
    return out


def as_framework(metrics: Mapping[str, Any], framework: str) -> dict[str, Any]:
    """A step's figures under ``framework``'s names (the ones it logs), in its order."""
    out = {}
    for alias in framework_aliases(framework):
        value = lookup(metrics, alias.key)
        if value is not None or alias.key in metrics:
            out[alias.name] = value
    return out


def selector_options() -> list[dict[str, str]]:
    """Options for the dashboard's metric selector: one per base metric, ``value`` the stored key,
    ``label`` the key and the framework names equal to it, ``title`` the definition (a tooltip); then
    one per framework figure that no canonical metric equals."""
    options = []
    for key in [*canonical_names(), *required_variants()]:
        names = [a.qualified for a in aliases_of(key)]
        label = key if not names else f"{key} ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
        options.append({"value": key, "label": label, "title": definition(key)})
    for alias in ALIASES:
        if alias.same_as is None:
            options.append({"value": alias.key, "label": alias.key, "title": alias.note})
    return options


def _alias_row(alias: Alias) -> dict[str, Any]:
    return {
        "framework": alias.framework,
        "name": alias.name,
        "key": alias.key,
        "also": list(alias.also),
        "note": alias.note,
        "same_as": alias.same_as,
        "settings": list(alias.settings),
        "releases": list(alias.releases),
    }


def catalogue() -> list[dict[str, Any]]:
    """Every base metric with its definition, parameters and the framework figures equal to it, then
    every framework figure no canonical metric equals (``isoaudit metrics list``,
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
                "aliases": [_alias_row(a) for a in aliases_of(key)],
            }
        )
    for alias in ALIASES:
        if alias.same_as is None:
            rows.append(
                {
                    "key": alias.key,
                    "definition": alias.note,
                    "parameters": {},
                    "sliced": [],
                    "aliases": [_alias_row(alias)],
                }
            )
    return rows


def _shown(value: Any) -> Any:
    return None if value is REQUIRED else value


def framework_catalogue(spec: str) -> dict[str, Any]:
    """What ``spec`` (``verl``, ``verl@0.6``, ``verl==0.7.1``) logs: the release whose code isoaudit
    follows for it, each figure (name, stored key, definition, settings, upstream function), the
    settings with their defaults (None: required, no default), and every era of the framework with
    what changed and where (``isoaudit metrics list --framework``)."""
    declaration = parse_declaration(spec)
    table = framework_table(declaration.framework)
    era = declaration.era
    return {
        "framework": table.name,
        "repository": table.repository,
        "version": declaration.version,
        "era": era.since,
        "commit": era.commit,
        "figures": [
            {
                "name": f.name,
                "key": qualified(table.name, f.name),
                "also": list(f.also),
                "definition": f.definition,
                "settings": list(f.settings),
                "same_as": f.same_as,
                "source": f.source,
                "needs": list(f.needs),
            }
            for f in era.figures
        ],
        "defaults": {k: _shown(v) for k, v in era.defaults.items()},
        "required": [k for k, v in era.defaults.items() if v is REQUIRED],
        "eras": [
            {
                "since": e.since,
                "released": e.released,
                "commit": e.commit,
                "date": e.date,
                "change": e.change,
                "figures": [f.name for f in e.figures],
                "selected": e is era,
            }
            for e in table.eras
        ],
    }


def finite(value: Any) -> float | None:
    """A metric value for display: None for missing or non-finite."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
