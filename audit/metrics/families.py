"""Threshold figures: importance-weight, rejection and band statistics that depend on bounds or caps.

Each is a :class:`Parametric`: one definition, its default parameters, and a compute function over a
step's finite tokens (:class:`TokenView`). Families that differ only in the statistic taken are
generated from one table (:data:`TIS_FAMILY`, :data:`RS_OPTIONS`, :data:`BAND_FAMILY`), so a
family's members cannot drift apart. A figure at non-default parameters is stored under a variant key
(``tis_mean[cap=3]``, :mod:`audit.metrics.keys`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from isoaudit.audit.metrics.blocks import Key, Request, TokenBlocks

#: verl's bound on |log ratio| before exponentiating importance weights.
LOG_RATIO_BOUND = 20.0

ParamValue = float | str


class TokenView:
    """The finite tokens of a step (both sides finite), what thresholds are applied to: Δ clamped to
    ±LOG_RATIO_BOUND (verl's SAFETY_BOUND, key :data:`D`) and ρ = exp(clamped Δ) (``"rho"``). Each
    figure reads per-sample reductions of named conditions and quantities from :attr:`blocks`
    (audit.metrics.blocks), measured together in one pass (:meth:`planned`); values derived from
    them are computed once per step (:meth:`memo`)."""

    def __init__(
        self, t32: np.ndarray, r32: np.ndarray, offsets: np.ndarray, blocks: TokenBlocks | None = None
    ) -> None:
        #: ``blocks``: the step's blocks over every token, shared when every token is finite
        if blocks is None or not blocks.all_finite:
            blocks = TokenBlocks(t32, r32, np.asarray(offsets, dtype=np.int64), finite_only=True)
        self.blocks = blocks
        #: each sample's finite tokens
        self.n_per_sample = self.blocks.lengths
        #: the step's finite tokens
        self.n = int(self.n_per_sample.sum())
        self.has = self.n_per_sample > 0
        self.cache: dict[tuple[object, ...], Any] = {}

    def memo(self, key: tuple[object, ...], make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``key`` for this step."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def plan(self, figures: Callable[[], object]) -> list[Request]:
        """Every reduction ``figures()`` reads (found by running it once on placeholders, whose
        results are dropped)."""
        found = self.blocks.plan(figures)
        self.cache.clear()
        return found

    def share(self, condition: Key) -> float:
        """The share of tokens where ``condition`` holds: a count over the token count, the same bits
        as the mean of the condition as 0/1 floats (whose sum is that count, exactly)."""
        return float(np.float64(self.blocks.count(condition)) / self.n)

    def sample_shares(self, condition: Key) -> np.ndarray:
        """Per sample (those that have tokens, in order): the share of its tokens where the condition
        holds, counted as integers (the same bits as the mean of the condition as 0/1 floats)."""
        return self.blocks.sums(condition)[self.has] / self.n_per_sample[self.has]

    def per_sample(self, key: Key, how: str = "sum") -> np.ndarray:
        """Per-sample sum / mean / max of the token values ``key``, for the samples that have tokens."""
        if how == "max":
            return self.blocks.maxima(key)[self.has]
        out = self.blocks.sums(key)[self.has]
        return out / self.n_per_sample[self.has] if how == "mean" else out

    def all_per_sample(self, condition: Key) -> np.ndarray:
        """Per sample (those that have tokens, in order): whether every token satisfies ``condition``."""
        return self.blocks.sums(condition)[self.has] == self.n_per_sample[self.has]

    def token_mean(self, condition: Key, aggregate: ParamValue) -> float:
        """The share of tokens where ``condition`` holds, token-weighted or (``aggregate="sample"``)
        as the mean of the per-sample shares."""
        if not self.n:
            return float("nan")
        if aggregate == "sample":
            return float(self.sample_shares(condition).mean())
        return self.share(condition)


#: Δ clamped to ±LOG_RATIO_BOUND, the Δ of every threshold figure.
D: Key = "d_clamped"


@dataclass(frozen=True)
class Parametric:
    """A figure that depends on bounds or thresholds: defaults and one definition."""

    description: str
    defaults: dict[str, ParamValue]
    compute: Callable[..., float]


def _nan_if_empty(f: Callable[..., float]) -> Callable[..., float]:
    def wrapped(view: TokenView, **params: ParamValue) -> float:
        return f(view, **params) if view.n else float("nan")

    return wrapped


class Weights:
    """The truncated importance weights ``w = min(ρ, cap)`` of a step (key :attr:`key`): their sum,
    sum of squares, standard deviation and per-sample means from the step's blocks."""

    def __init__(self, view: TokenView, cap: float) -> None:
        self.view, self.cap = view, cap
        self.key: Key = ("min", "rho", cap)

    @property
    def sum(self) -> float:
        return self.view.blocks.total(self.key)

    @property
    def sum_sq(self) -> float:
        return self.view.blocks.total(("sq", self.key))

    def std(self) -> float:
        return self.view.blocks.std(self.key)

    def extreme(self, how: str) -> float:
        """min / max of ``w``: ``min(min ρ, cap)`` / ``min(max ρ, cap)`` (minimum only selects)."""
        found = self.view.blocks.min("rho") if how == "min" else self.view.blocks.max("rho")
        return float(np.minimum(found, self.cap))

    def per_sample_mean(self) -> np.ndarray:
        return self.view.per_sample(self.key, "mean")


def _above(upper: float) -> Key:
    """ρ > upper."""
    return ("gt", "rho", upper)


def _below(lower: float) -> Key:
    return ("lt", "rho", lower)


def _oob(lower: float, upper: float) -> Key:
    return ("or", _below(lower), _above(upper))


def _rho_means(view: TokenView) -> np.ndarray:
    return view.per_sample("rho", "mean")


def _geo_oob(view: TokenView, lower: float, upper: float) -> float:
    geo = np.exp(view.per_sample(D, "mean"))
    return float(((geo < lower) | (geo > upper)).mean())


def _kish_fraction(w: Weights) -> float:
    """Kish effective sample size of weights ``w`` over their count, (Σw)²/(nΣw²)."""
    return float(w.sum**2 / (w.view.n * w.sum_sq)) if w.sum_sq > 0 else float("nan")


#: The truncated-importance-weight family: each figure is one statistic of the weights
#: ``w = min(ρ, cap)`` (per token, or per sample as each sample's mean weight), at verl's cap 2.
TIS_FAMILY: dict[str, tuple[str, Callable[[Weights], float]]] = {
    # w.mean(): numpy's mean is the sum over the count
    "tis_mean": ("mean truncated importance weight min(ρ, cap)", lambda w: float(w.sum / w.view.n)),
    "tis_std": ("std (ddof=0) of the truncated importance weights min(ρ, cap)", lambda w: w.std()),
    "tis_min": ("min truncated importance weight min(ρ, cap)", lambda w: w.extreme("min")),
    "tis_max": ("max truncated importance weight min(ρ, cap)", lambda w: w.extreme("max")),
    "tis_ess_fraction": (
        "Kish effective sample size of the truncated weights over the token count, (Σw)²/(nΣw²)",
        _kish_fraction,
    ),
    "tis_seq_mean": (
        "mean over samples of each sample's mean truncated weight",
        lambda w: float(w.per_sample_mean().mean()),
    ),
    "tis_seq_max": (
        "max over samples of each sample's mean truncated weight",
        lambda w: float(w.per_sample_mean().max()),
    ),
    "tis_seq_min": (
        "min over samples of each sample's mean truncated weight",
        lambda w: float(w.per_sample_mean().min()),
    ),
    "tis_seq_max_deviation": (
        "max over samples of |mean truncated weight - 1|",
        lambda w: float(np.abs(w.per_sample_mean() - 1.0).max()),
    ),
}


def _tis_figures() -> dict[str, Parametric]:
    """:data:`TIS_FAMILY` as threshold figures of one parameter, ``cap``."""

    def figure(description: str, statistic: Callable[[Weights], float]) -> Parametric:
        return Parametric(
            description, {"cap": 2.0}, _nan_if_empty(lambda v, cap: statistic(Weights(v, float(cap))))
        )

    return {name: figure(description, statistic) for name, (description, statistic) in TIS_FAMILY.items()}


#: verl's rejection-sampling options (rollout_corr rollout_rs): per-token divergence k1 = -Δ,
#: k2 = Δ²/2, k3 = e^Δ - 1 - Δ, at token level or as a per-sequence sum, mean or max.
RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def _rs_keep(view: TokenView, option: str, lower: float, upper: float) -> tuple[float, np.ndarray]:
    """(the fraction of tokens kept, kept per sample) under one rejection option; k1 bounds are
    ratio bounds compared in log space, k2/k3 an upper bound on the divergence. Shared by its two
    fractions."""
    return view.memo(("rs_keep", option, lower, upper), lambda: _rs_keep_compute(view, option, lower, upper))


def _rs_keep_compute(view: TokenView, option: str, lower: float, upper: float) -> tuple[float, np.ndarray]:
    kind = option[-2:]
    if option.startswith("token_"):
        if kind == "k1":  # -Δ in [log lower, log upper]: negation is exact, so Δ in [-log upper, -log lower]
            lo, hi = -np.log(upper), -np.log(lower)
            condition: Key = ("and", ("le", D, hi), ("ge", D, lo))
        else:
            condition = ("le", _RS_STAT[kind], upper)
        # a sample is kept when no token of it is rejected
        return view.share(condition), view.all_per_sample(condition)
    how = option.split("_")[1]  # sum | mean | max
    if kind == "k1" and how in ("sum", "mean"):
        # the per-sample sums of -Δ are those of Δ negated (each partial sum negates exactly)
        per_sample = -view.per_sample(D, how)
    else:
        per_sample = view.per_sample(_RS_STAT[kind] if kind != "k1" else ("neg", D), how)
    sample_ok = (
        (per_sample >= np.log(lower)) & (per_sample <= np.log(upper)) if kind == "k1" else per_sample <= upper
    )
    # the kept samples' tokens over all tokens: the mean of the per-token flags, an exact count
    kept_tokens = int(view.n_per_sample[view.has][sample_ok].sum())
    return float(np.float64(kept_tokens) / view.n), sample_ok


#: The per-token divergences of the rejection options on clamped Δ: k2 = Δ²/2 (as (0.5 Δ) Δ),
#: k3 = e^Δ − 1 − Δ (as expm1(Δ) − Δ).
_RS_STAT: dict[str, Key] = {"k2": "rs_k2", "k3": "rs_k3"}


def _rs_figures() -> dict[str, Parametric]:
    out = {}
    for option in RS_OPTIONS:
        bounds: dict[str, ParamValue] = (
            {"lower": 0.5, "upper": 2.0}
            if option.endswith("k1")
            else {"upper": 0.01 if "sum" not in option else 1.0}
        )
        what = (
            "ratio bounds [lower, upper] on exp(-k1)"
            if option.endswith("k1")
            else "upper bound on the divergence"
        )

        def masked(view: TokenView, option: str = option, **p: ParamValue) -> float:
            kept, _ = _rs_keep(view, option, float(p.get("lower", 0.0)), float(p["upper"]))
            return 1.0 - kept

        def seq_masked(view: TokenView, option: str = option, **p: ParamValue) -> float:
            _, sample_ok = _rs_keep(view, option, float(p.get("lower", 0.0)), float(p["upper"]))
            return float(1.0 - sample_ok.mean())

        out[f"rs_{option}_masked_fraction"] = Parametric(
            f"fraction of tokens rejected by rejection sampling {option} ({what})",
            bounds,
            _nan_if_empty(masked),
        )
        out[f"rs_{option}_seq_masked_fraction"] = Parametric(
            f"fraction of samples with a token rejected by rejection sampling {option} ({what})",
            bounds,
            _nan_if_empty(seq_masked),
        )
    return out


def _in_band(view: TokenView, band: float) -> float:
    """The share of finite tokens with ``|ρ - 1| <= band``, compared in log space:
    ``log(1 - band) <= Δ <= log(1 + band)`` (Δ clamped to ±LOG_RATIO_BOUND; NaN for a negative band)."""
    if not band >= 0.0:
        return float("nan")
    lo, hi = np.log1p(-band) if band < 1.0 else -np.inf, np.log1p(band)
    return view.share(("and", ("ge", D, lo), ("le", D, hi)))


#: Band retention, MLPerf-style: the share of finite tokens whose importance ratio ρ = exp(Δ) lies
#: within ``band`` of 1, and its complement; the default band 1%, :data:`STANDING_BANDS` beside it.
BAND_FAMILY: dict[str, Parametric] = {
    "band_retention": Parametric(
        "share of tokens whose importance ratio is within the band, |ρ - 1| <= band",
        {"band": 0.01},
        _nan_if_empty(lambda v, band: _in_band(v, float(band))),
    ),
    "band_exceedance": Parametric(
        "share of tokens whose importance ratio is outside the band, |ρ - 1| > band (1 - band_retention)",
        {"band": 0.01},
        _nan_if_empty(lambda v, band: 1.0 - _in_band(v, float(band))),
    ),
}

#: Bands of :data:`BAND_FAMILY` computed on every step beside the default 1%.
STANDING_BANDS: tuple[float, ...] = (0.001, 0.05)


#: Every threshold figure, with its defaults (verl's unless named). ``aggregate`` is ``token``
#: (pool tokens) or ``sample`` (mean of per-sample means, slime's default reduction).
PARAMETRIC: dict[str, Parametric] = {
    **_tis_figures(),
    "is_fraction_high": Parametric(
        "fraction of tokens with importance weight ρ > upper",
        {"upper": 2.0, "aggregate": "token"},
        _nan_if_empty(lambda v, upper, aggregate: v.token_mean(_above(float(upper)), aggregate)),
    ),
    "is_fraction_low": Parametric(
        "fraction of tokens with importance weight ρ < lower",
        {"lower": 0.5, "aggregate": "token"},
        _nan_if_empty(lambda v, lower, aggregate: v.token_mean(_below(float(lower)), aggregate)),
    ),
    "is_seq_fraction_high": Parametric(
        "fraction of samples whose mean importance weight is > upper",
        {"upper": 2.0},
        _nan_if_empty(lambda v, upper: float((_rho_means(v) > float(upper)).mean())),
    ),
    "is_seq_fraction_low": Parametric(
        "fraction of samples whose mean importance weight is < lower",
        {"lower": 0.5},
        _nan_if_empty(lambda v, lower: float((_rho_means(v) < float(lower)).mean())),
    ),
    "is_oob_fraction": Parametric(
        "fraction of tokens with ρ outside [lower, upper] (what IcePop masks and TIS clamps)",
        {"lower": 0.5, "upper": 5.0, "aggregate": "token"},
        _nan_if_empty(
            lambda v, lower, upper, aggregate: v.token_mean(_oob(float(lower), float(upper)), aggregate)
        ),
    ),
    "geo_oob_seq_fraction": Parametric(
        "fraction of samples whose geometric-mean weight exp(mean Δ) is outside [lower, upper]",
        {"lower": 0.5, "upper": 5.0},
        _nan_if_empty(lambda v, lower, upper: _geo_oob(v, float(lower), float(upper))),
    ),
    **_rs_figures(),
    **BAND_FAMILY,
}
