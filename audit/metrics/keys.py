"""The grammar of stored metric keys, built and parsed here only.

A stored key is one of:

* a base name (``kl_k3``, :data:`audit.metrics.core.STEP_METRICS`);
* a length slice ``name/len_lo_hi`` (``kl_k3/len_0_256``): the samples whose completion length falls
  in one of :data:`LENGTH_BUCKETS`;
* a lag slice ``name/lag_L`` (``kl_k3/lag_1``) of a :data:`LAG_SLICED` name: the tokens sampled
  ``L`` weight versions behind the trainer;
* a threshold figure at parameters ``name[k=v,...]`` (``tis_mean[cap=3]``) listing the parameters
  that differ from the figure's defaults (:data:`audit.metrics.families.PARAMETRIC`).
"""

from __future__ import annotations

import re

import numpy as np
from isoaudit.audit.metrics.families import BAND_FAMILY, PARAMETRIC, STANDING_BANDS, ParamValue

#: Completion-length buckets for the sliced variants: ``[lo, hi)`` in completion tokens.
LENGTH_BUCKET_EDGES: tuple[int, ...] = (0, 256, 512, 1024, 2048)


def length_bucket_bounds() -> list[tuple[int, int | None]]:
    """``(lo, hi)`` of each of :data:`LENGTH_BUCKETS`; ``hi`` None for the last, open one."""
    his: list[int | None] = [*LENGTH_BUCKET_EDGES[1:], None]
    return list(zip(LENGTH_BUCKET_EDGES, his, strict=True))


#: Suffixes of the length-sliced step metrics, e.g. ``kl_k3/len_0_256``.
LENGTH_BUCKETS: tuple[str, ...] = tuple(
    f"len_{lo}_{'inf' if hi is None else hi}" for lo, hi in length_bucket_bounds()
)


def length_key(name: str, bucket: str) -> str:
    """The key of ``name`` over the samples of one length bucket: ``kl_k3/len_0_256``."""
    return f"{name}/{bucket}"


def parse_length_key(key: str) -> tuple[str, str] | None:
    """Inverse of :func:`length_key`: ``(name, bucket)``, or None when ``key`` is not a length slice."""
    name, sep, bucket = key.rpartition("/")
    return (name, bucket) if sep and name and bucket in LENGTH_BUCKETS else None


def length_bucket_of(n_tokens: np.ndarray) -> np.ndarray:
    """Index into :data:`LENGTH_BUCKETS` of each completion length."""
    return np.searchsorted(np.asarray(LENGTH_BUCKET_EDGES), np.asarray(n_tokens), side="right") - 1


#: Step metrics repeated per policy lag (``kl_k3/lag_1``): the figures asynchronous RL is judged by.
LAG_SLICED: tuple[str, ...] = (
    "n_tokens",
    "n_samples",
    "kl_k1",
    "kl_k3",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "is_mean",
    "token_mult_prob_error",
    "exact_match_fraction",
    "token_fraction",
)

_LAG_KEY = re.compile(r"^(?P<name>[a-z0-9_]+)/lag_(?P<lag>-?[0-9]+)$")


def lag_key(name: str, lag: int) -> str:
    """The key of ``name`` over the tokens sampled ``lag`` weight versions behind: ``kl_k3/lag_1``."""
    return f"{name}/lag_{lag}"


def parse_lag_key(key: str) -> tuple[str, int] | None:
    """(metric, lag) of a lag-sliced key, or None when ``key`` is not one."""
    match = _LAG_KEY.match(key)
    if match is None or match["name"] not in LAG_SLICED:
        return None
    return match["name"], int(match["lag"])


def _format(value: ParamValue) -> str:
    return value if isinstance(value, str) else f"{float(value):g}"


def variant_key(name: str, params: dict[str, ParamValue] | None = None) -> str:
    """The stored key of a threshold figure at ``params``: the bare name at its defaults, else
    ``name[k=v,...]`` listing the parameters that differ, in definition order."""
    figure = PARAMETRIC.get(name)
    if figure is None:
        raise ValueError(f"metric: {name!r} is not a threshold figure (known: {', '.join(PARAMETRIC)})")
    params = dict(params or {})
    unknown = set(params) - set(figure.defaults)
    if unknown:
        raise ValueError(
            f"{name}: unknown parameter {sorted(unknown)[0]!r} (has {', '.join(figure.defaults)})"
        )
    changed = [
        f"{k}={_format(params[k])}"
        for k, default in figure.defaults.items()
        if k in params and _format(params[k]) != _format(default)
    ]
    return f"{name}[{','.join(changed)}]" if changed else name


_VARIANT = re.compile(r"^(?P<name>[a-z0-9_]+)\[(?P<params>[^\]]*)\]$")


def parse_variant(key: str) -> tuple[str, dict[str, ParamValue]]:
    """Inverse of :func:`variant_key`: (figure name, full parameters). Raises ValueError naming the part."""
    match = _VARIANT.match(key)
    name, body = (match["name"], match["params"]) if match else (key, "")
    figure = PARAMETRIC.get(name)
    if figure is None:
        raise ValueError(f"metric: {key!r} is not a threshold figure")
    params: dict[str, ParamValue] = dict(figure.defaults)
    for part in filter(None, body.split(",")):
        k, sep, v = part.partition("=")
        if not sep or k not in figure.defaults:
            raise ValueError(f"{name}: bad parameter {part!r} (has {', '.join(figure.defaults)})")
        if isinstance(figure.defaults[k], str):
            params[k] = v
        else:
            try:
                params[k] = float(v)
            except ValueError:
                raise ValueError(f"{name}: parameter {k} must be a number, got {v!r}") from None
    if params.get("aggregate", "token") not in ("token", "sample"):
        raise ValueError(f"{name}: aggregate must be token or sample, got {params['aggregate']!r}")
    return name, params


def variant_description(key: str) -> str:
    """The one-line definition of a threshold figure's key, with its parameter values."""
    name, params = parse_variant(key)
    shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return f"{PARAMETRIC[name].description} ({shown})"


#: Threshold-figure keys computed on every step beside the defaults: the band family at
#: :data:`~audit.metrics.families.STANDING_BANDS`.
STANDING_VARIANTS: tuple[str, ...] = tuple(
    variant_key(name, {"band": band}) for band in STANDING_BANDS for name in BAND_FAMILY
)
