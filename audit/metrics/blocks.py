"""Per-sample reductions of per-token quantities of a step, measured in one pass over blocks of whole
samples (DESIGN.md, "Metrics").

Nearly every figure over a step's tokens is a reduction (a sum, an extreme, a centred square sum) of
a few per-token functions of the two sides' logprobs, per sample and then over the samples. Each
function has one name (:data:`QUANTITIES`, or an expression key such as ``("min", "exp_d", 2.0)``)
and is evaluated once per block whatever asks for it; every reduction a step needs is measured in
one pass over blocks of whole samples of about :data:`BLOCK_TOKENS` tokens, so that a block's float64
temporaries stay in cache, and blocks may go to several threads (numpy releases the interpreter lock
in its loops). The order of every sum is fixed by the step alone: each sample's tokens are added by
``np.add.reduceat`` (numpy's pairwise summation over the sample's span), the samples' sums by
``np.sum`` in sample order. A step's standard deviation or correlation pools each sample's sums
centred on its own mean (Chan, Golub and LeVeque's combination), as a two-pass computation would
centre them, without a second pass over the tokens.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

#: Tokens per block: whole samples up to about this many tokens are measured together.
BLOCK_TOKENS = 1 << 15

Key = str | tuple[Any, ...]
#: A reduction: ``sum`` (booleans are counted as int64), ``max``, ``min``, ``m2`` (each sample's
#: squares of the values less its mean), or ``("cm", other)`` (its co-moment with ``other``).
Reduction = str | tuple[str, Key]
Request = tuple[Reduction, Key]


class Block:
    """One block's tokens (float64) and each quantity asked of them, computed once."""

    def __init__(self, t: np.ndarray, r: np.ndarray, lengths: np.ndarray) -> None:
        self.t = t
        self.r = r
        #: the tokens of each of the block's samples that have any, and where each starts
        self.lengths = lengths[lengths > 0]
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.nonempty = lengths > 0
        self.memo: dict[Key, np.ndarray] = {}

    def __getitem__(self, key: Key) -> np.ndarray:
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = _evaluate(self, key)
        return found


def _d(b: Block) -> np.ndarray:
    return np.subtract(b.t, b.r)


def _k3(b: Block) -> np.ndarray:
    out = np.subtract(b["exp_d"], b["d"])  # exp(Δ) − Δ − 1, in that order
    out -= 1.0
    return out


def _nemo_k3(b: Block) -> np.ndarray:
    out = np.subtract(b["exp_d"], 1.0)  # exp(Δ) − 1 − Δ, in that order
    out -= b["d"]
    return out


def _nemo_k3_reverse(b: Block) -> np.ndarray:
    out = np.subtract(b["exp_neg_d"], 1.0)  # exp(−Δ) − 1 − (−Δ)
    out += b["d"]
    return out


def _half_k3(x: np.ndarray) -> np.ndarray:
    e = np.exp(x)
    e -= x
    e -= 1
    e *= 0.5
    return e


def _nemo_js(b: Block) -> np.ndarray:
    """0.5 (e^a − a − 1) + 0.5 (e^b − b − 1), a = t − log m, b = r − log m, m = (e^t + e^r)/2."""
    log_m = np.multiply(b["exp_t"], 0.5)
    log_m += np.multiply(b["exp_r"], 0.5)
    np.log(log_m, out=log_m)
    js = _half_k3(np.subtract(b.t, log_m))
    js += _half_k3(np.subtract(b.r, log_m, out=log_m))
    return js


def _exp_abs_d(b: Block) -> np.ndarray:
    # exp(|Δ|) is exp(Δ) or exp(−Δ): |Δ| is one of them exactly
    return np.where(b["d"] >= 0, b["exp_d"], b["exp_neg_d"])


def _rho(b: Block) -> np.ndarray:
    """exp(Δ clamped to ±20): exp(Δ) itself where no token is clamped."""
    clamped = b[("clip", "d", -20.0, 20.0)]
    if np.array_equal(clamped, b["d"]):
        return b["exp_d"]
    return np.exp(clamped)


def _rs_k2(b: Block) -> np.ndarray:
    """k2 = Δ²/2 of Δ clamped to ±20, as (0.5 Δ) Δ."""
    d = b[("clip", "d", -20.0, 20.0)]
    out = np.multiply(d, 0.5)
    return np.multiply(out, d, out=out)


def _rs_k3(b: Block) -> np.ndarray:
    """k3 = e^Δ − 1 − Δ of Δ clamped to ±20, as expm1(Δ) − Δ."""
    d = b[("clip", "d", -20.0, 20.0)]
    out = np.expm1(d)
    return np.subtract(out, d, out=out)


#: The named per-token quantities, each as the figures that read it define it.
QUANTITIES: dict[str, Callable[[Block], np.ndarray]] = {
    "t": lambda b: b.t,
    "r": lambda b: b.r,
    "d": _d,  # Δ = trainer − rollout
    "abs_d": lambda b: np.abs(b["d"]),
    "d_sq": lambda b: np.multiply(b["d"], b["d"]),  # Δ², also |Δ|² and (−Δ)² exactly
    "exp_t": lambda b: np.exp(b.t),
    "exp_r": lambda b: np.exp(b.r),
    "abs_p_diff": lambda b: np.abs(np.subtract(b["exp_t"], b["exp_r"])),
    "exp_d": lambda b: np.exp(b["d"]),
    "exp_neg_d": lambda b: np.exp(np.negative(b["d"])),
    "exp_abs_d": _exp_abs_d,
    "k3": _k3,
    "nemo_k3": _nemo_k3,
    "nemo_k3_reverse": _nemo_k3_reverse,
    "nemo_js": _nemo_js,
    "rho": _rho,  # exp(Δ clamped to ±20), verl's SAFETY_BOUND
    "rs_k2": _rs_k2,
    "rs_k3": _rs_k3,
}

#: Expression keys: ``(op, operand keys and constants...)``.
_OPS: dict[str, Callable[..., np.ndarray]] = {
    "sq": lambda x: np.multiply(x, x),
    "half": lambda x: np.divide(x, 2),
    "neg": np.negative,
    "abs": np.abs,
    "min": lambda x, c: np.minimum(x, c),
    "max": lambda x, c: np.maximum(x, c),
    "clip": lambda x, lo, hi: np.clip(x, lo, hi),
    "gt": lambda x, c: x > c,
    "ge": lambda x, c: x >= c,
    "lt": lambda x, c: x < c,
    "le": lambda x, c: x <= c,
    "finite_or_zero": lambda x: np.where(np.isfinite(x), x, 0.0),
}
#: Logical expressions over keys only.
_LOGIC: dict[str, Callable[..., np.ndarray]] = {
    "or": np.logical_or,
    "and": np.logical_and,
    "not": np.logical_not,
}


def _evaluate(b: Block, key: Key) -> np.ndarray:
    if isinstance(key, str):
        return QUANTITIES[key](b)
    op, *args = key
    if op in _LOGIC:
        return _LOGIC[op](*(b[a] for a in args))
    return _OPS[op](b[args[0]], *args[1:])


def _reduce(b: Block, how: Reduction, key: Key, n: int, fill: float) -> np.ndarray:
    """One reduction of ``key`` over each of the block's ``n`` samples (``fill`` for an empty one)."""
    values = b[key]
    if how == "sum":
        dtype = np.int64 if values.dtype == np.bool_ else np.float64
        out = np.zeros(n, dtype=dtype)
        if b.starts.size:
            out[b.nonempty] = np.add.reduceat(values, b.starts, dtype=dtype)
        return out
    out = np.full(n, fill, dtype=np.float64)
    if not b.starts.size:
        return out
    if how == "max":
        out[b.nonempty] = np.maximum.reduceat(values, b.starts)
    elif how == "min":
        out[b.nonempty] = np.minimum.reduceat(values, b.starts)
    elif how == "m2":
        centred = values - np.repeat(np.add.reduceat(values, b.starts) / b.lengths, b.lengths)
        out[b.nonempty] = np.add.reduceat(np.square(centred, out=centred), b.starts)
    else:  # ("cm", other): the co-moment about each sample's two means
        other = b[how[1]]
        centred = values - np.repeat(np.add.reduceat(values, b.starts) / b.lengths, b.lengths)
        centred *= other - np.repeat(np.add.reduceat(other, b.starts) / b.lengths, b.lengths)
        out[b.nonempty] = np.add.reduceat(centred, b.starts)
    return out


_FILL = {"max": -math.inf, "min": math.inf}


class TokenBlocks:
    """Per-sample reductions of a step's per-token quantities: ``trainer``/``rollout`` concatenated
    (any float dtype, made float64 block by block), sample ``i`` is ``[offsets[i], offsets[i+1])``.
    ``finite_only``: only tokens finite on both sides count (each sample's length is its count of
    them). Reductions are measured by :meth:`measure` (one pass for all those asked together) and
    read by :meth:`sums`, :meth:`extremes` and the pooled statistics."""

    def __init__(
        self,
        trainer: np.ndarray,
        rollout: np.ndarray,
        offsets: np.ndarray,
        *,
        finite_only: bool = False,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        self.trainer, self.rollout = trainer, rollout
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.finite_only = finite_only
        self.n_samples = self.offsets.size - 1
        self._bounds = _block_bounds(self.offsets, block_tokens)
        self._done: dict[Request, np.ndarray] = {}
        self._lock = threading.Lock()
        self._recording: list[Request] | None = None
        self.lengths = np.diff(self.offsets)
        if finite_only:
            self.lengths = self._finite_lengths()

    def _finite_lengths(self) -> np.ndarray:
        finite = np.isfinite(self.trainer) & np.isfinite(self.rollout)
        if finite.all():
            return np.diff(self.offsets)
        starts = self.offsets[:-1][np.diff(self.offsets) > 0]
        out = np.zeros(self.n_samples, dtype=np.int64)
        if starts.size:
            out[np.diff(self.offsets) > 0] = np.add.reduceat(finite, starts, dtype=np.int64)
        return out

    def _block(self, lo: int, hi: int) -> Block:
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        t = self.trainer[a:b].astype(np.float64)
        r = self.rollout[a:b].astype(np.float64)
        lengths = np.diff(self.offsets[lo : hi + 1])
        if self.finite_only:
            finite = np.isfinite(t) & np.isfinite(r)
            if not finite.all():
                t, r = t[finite], r[finite]
                lengths = self.lengths[lo:hi]
        return Block(t, r, lengths)

    def measure(self, requests: Iterable[Request], threads: int = 1) -> None:
        """Measure every request not measured yet, in one pass over the blocks (on ``threads``
        threads: each block's reductions are those of one thread)."""
        with self._lock:
            todo = list(dict.fromkeys(q for q in requests if q not in self._done))
            if not todo:
                return

            def run(bounds: tuple[int, int]) -> list[np.ndarray]:
                lo, hi = bounds
                with np.errstate(all="ignore"):
                    block = self._block(lo, hi)
                    return [
                        _reduce(block, how, key, hi - lo, _FILL.get(how if isinstance(how, str) else "", 0.0))
                        for how, key in todo
                    ]

            spans = list(zip(self._bounds[:-1], self._bounds[1:], strict=True))
            if threads > 1 and len(spans) > 1:
                with ThreadPoolExecutor(min(threads, len(spans))) as pool:
                    parts = list(pool.map(run, spans))
            else:
                parts = [run(span) for span in spans]
            for i, request in enumerate(todo):
                values = np.concatenate([p[i] for p in parts]) if parts else np.zeros(0)
                values.setflags(write=False)
                self._done[request] = values

    def get(self, how: Reduction, key: Key) -> np.ndarray:
        """The per-sample reduction ``how`` of ``key`` (measured now if it was not)."""
        request = (how, key)
        if self._recording is not None:  # planning: note it, hand back a placeholder
            self._recording.append(request)
            return np.zeros(self.n_samples)
        if request not in self._done:
            self.measure([request])
        return self._done[request]

    def planned(self, reads: Callable[[], object]) -> None:
        """Measure in one pass every reduction ``reads()`` asks for: it is run once on placeholders
        (zeros; its result and any error are dropped) to find them. A reduction asked for only on
        the real values is measured when asked."""
        self._recording = []
        try:
            with np.errstate(all="ignore"):
                reads()
        except Exception:  # noqa: BLE001, S110 — placeholders may take a branch the values will not
            pass
        finally:
            found, self._recording = self._recording, None
        self.measure(found)

    # -- per sample -------------------------------------------------------------------------------
    def sums(self, key: Key) -> np.ndarray:
        """Each sample's sum of ``key`` (0 for an empty sample; a count for a condition)."""
        return self.get("sum", key)

    def maxima(self, key: Key) -> np.ndarray:
        """Each sample's largest value of ``key`` (−inf for an empty sample)."""
        return self.get("max", key)

    def minima(self, key: Key) -> np.ndarray:
        """Each sample's smallest value of ``key`` (inf for an empty sample)."""
        return self.get("min", key)

    # -- over the step ----------------------------------------------------------------------------
    def total(self, key: Key) -> float:
        """The step's sum of ``key``: its samples' sums, added in sample order."""
        return float(np.sum(self.sums(key)))

    def count(self, key: Key) -> int:
        """How many of the step's tokens satisfy the condition ``key``."""
        return int(np.sum(self.sums(key)))

    def max(self, key: Key) -> float:
        return float(np.max(self.maxima(key))) if self.n_samples else -math.inf

    def min(self, key: Key) -> float:
        return float(np.min(self.minima(key))) if self.n_samples else math.inf

    def moments(self, key: Key) -> tuple[int, float, float]:
        """(n, mean, Σ(x − mean)²) over the step's tokens, from each sample's sum and centred
        squares: M2 = Σ M2_i + Σ n_i (mean_i − mean)²."""
        return self._pooled(key, key)

    def comoment(self, a: Key, b: Key) -> float:
        """Σ (a − mean a)(b − mean b) over the step's tokens, pooled as :meth:`moments`."""
        return self._pooled(a, b)[2]

    def _pooled(self, a: Key, b: Key) -> tuple[int, float, float]:
        has = self.lengths > 0
        n = int(self.lengths.sum())
        if n == 0:
            return 0, math.nan, math.nan
        counts = self.lengths[has].astype(np.float64)
        sums_a = self.sums(a)[has]
        within = self.get("m2", a) if a == b else self.get(("cm", b), a)
        mean_a = float(np.sum(sums_a)) / n
        if a == b:
            between = counts * np.square(sums_a / counts - mean_a)
        else:
            sums_b = self.sums(b)[has]
            mean_b = float(np.sum(sums_b)) / n
            between = counts * (sums_a / counts - mean_a) * (sums_b / counts - mean_b)
        return n, mean_a, float(np.sum(within[has]) + np.sum(between))

    def std(self, key: Key, ddof: int = 0) -> float:
        """The standard deviation of ``key`` over the step's tokens (NaN without more than ``ddof``)."""
        n, _, m2 = self.moments(key)
        return math.sqrt(m2 / (n - ddof)) if n > ddof and m2 >= 0 else math.nan


def _block_bounds(offsets: np.ndarray, block_tokens: int) -> list[int]:
    """Sample indices ``0 = b_0 < b_1 < ... = n`` cutting the samples into runs of about
    ``block_tokens`` tokens (a longer sample is a block of its own)."""
    n = offsets.size - 1
    bounds = [0]
    while bounds[-1] < n:
        start = bounds[-1]
        cut = int(np.searchsorted(offsets, offsets[start] + block_tokens, side="right")) - 1
        bounds.append(min(max(cut, start + 1), n))
    return bounds
