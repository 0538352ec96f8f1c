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
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any

import numpy as np
from isoaudit.audit.metrics.block_pool import active_pool

#: Tokens per block: whole samples up to about this many tokens are measured together (64k tokens:
#: a block's live float64 quantities, about 8 of 512 KiB, fit a core's 4 MiB L2; twice that does not).
BLOCK_TOKENS = 1 << 16
#: The most threads a pass takes.
MOST_THREADS = 4


class _OwnLoad:
    """This process's CPU use, in busy cores, over about the last minute: the share of the load
    average that is its own work, not other jobs'."""

    WINDOW_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque(
            [(time.monotonic(), time.process_time())], maxlen=256
        )

    def __call__(self) -> float:
        with self._lock:
            now = (time.monotonic(), time.process_time())
            self._samples.append(now)
            while len(self._samples) > 2 and now[0] - self._samples[1][0] >= self.WINDOW_S:
                self._samples.popleft()
            wall, cpu = self._samples[0]
            return (now[1] - cpu) / (now[0] - wall) if now[0] - wall >= 1.0 else 0.0


_own_load = _OwnLoad()


def idle_threads(most: int = MOST_THREADS) -> int:
    """Threads for a pass over a step's blocks: as many as the machine has cores not busy with other
    jobs (its 1-minute load average less this process's own CPU use over about the last minute),
    at most ``most``, at least 1. Blocks on a second thread pay off only on a core of their own: on
    busy cores they wait on each other's interpreter lock and cache (a pass at load 3 on 2 cores:
    0.27–0.31 s on one thread, 0.42–0.47 s on two)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy = os.getloadavg()[0]
    except OSError:  # no load average here: one thread, which never loses
        return 1
    others = max(0.0, busy - _own_load())
    return max(1, min(most, cores, int(cores - others + 0.5)))


Key = str | tuple[Any, ...]
#: A reduction: ``sum`` (booleans are counted as int64), ``max``, ``min``, ``first`` (the first
#: token where a condition holds, -1 if none), ``m2`` (each sample's squares of the values less its
#: mean), ``("cm", other)`` (its co-moment with ``other``), or per segment of the samples cut at
#: given positions, ``("segment_sum", edges)`` and ``("segment_max", edges)``.
Reduction = str | tuple[str, Any]
Request = tuple[Reduction, Key]


class Block:
    """One block's tokens (float64) and each quantity asked of them, computed once."""

    def __init__(
        self,
        t: np.ndarray,
        r: np.ndarray,
        lengths: np.ndarray,
        raw: tuple[np.ndarray, np.ndarray] | None = None,
        finite: bool = False,
    ) -> None:
        self.t = t
        self.r = r
        #: the block's logprobs as recorded (bitwise comparisons), when every token is kept
        self.raw = raw
        #: whether every token is finite on both sides
        self.finite = finite
        #: the tokens of each of the block's samples that have any, and where each starts
        self.lengths = lengths[lengths > 0]
        self.starts = (np.cumsum(self.lengths) - self.lengths).astype(np.int64)
        self.nonempty = lengths > 0
        #: whether every sample has tokens
        self.every = bool(self.nonempty.all())
        #: each such sample's [start, end) in the block
        self.spans = [(int(a), int(a + n)) for a, n in zip(self.starts, self.lengths, strict=True)]
        self.memo: dict[Key, np.ndarray] = {}
        #: reductions and centred values other reductions read
        self.sums: dict[tuple[str, Key], np.ndarray] = {}
        #: values found once per block (:attr:`differing`, :attr:`agreeing`)
        self.shared: dict[str, Any] = {}
        #: each reduction of an array: (the array, kept alive; the reduction)
        self.reduced: dict[tuple[Reduction, int], tuple[np.ndarray, np.ndarray]] = {}

    def __getitem__(self, key: Key) -> np.ndarray:
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = _evaluate(self, key)
        return found

    @property
    def differing(self) -> np.ndarray | None:
        """Where the sides differ, when most tokens agree bitwise and every token is finite (None
        otherwise): there Δ is +0.0 exactly, and a function of Δ (or of the rollout's logprob) is
        its value at +0.0 (at the trainer's logprob), computed once, not token by token."""
        if "differing" not in self.shared:
            where = None
            if self.finite and self.raw is not None:
                where = np.flatnonzero(self["mismatch"])
                if where.size >= SHARED_BELOW * self.t.size:
                    where = None
            self.shared["differing"] = where
        return self.shared["differing"]

    @property
    def agreeing(self) -> tuple[Block, np.ndarray] | None:
        """The block's tokens without those of samples that mostly agree bitwise where they agree
        (a block of its own), and how many tokens each sample left out (None: every sample
        mostly differs, or a token is not finite). A quantity with one value on every agreeing
        token (:func:`at_agreeing`) is reduced over the kept tokens, and its value counted for the
        others; what a sample that mostly differs keeps is every token, as without."""
        if "agreeing" not in self.shared:
            self.shared["agreeing"] = None
            if self.finite and self.raw is not None and self.starts.size:
                mismatch = self["mismatch"]
                differing = np.array([np.count_nonzero(mismatch[a:b]) for a, b in self.spans], dtype=np.int64)
                sparse = differing < SHARED_BELOW * self.lengths
                if sparse.any():
                    # integer indices: a boolean mask takes ×10–30 the time to gather with
                    keep = np.flatnonzero(mismatch | np.repeat(~sparse, self.lengths))
                    kept = np.where(sparse, differing, self.lengths)  # one a sample that has tokens
                    child = Block(self.t[keep], self.r[keep], kept, None, self.finite)
                    child.memo["mismatch"] = mismatch[keep]
                    child.shared["agreeing"] = None
                    child.shared["differing"] = None
                    self.shared["agreeing"] = (child, self.lengths - kept)
        found: tuple[Block, np.ndarray] | None = self.shared["agreeing"]
        return found

    @property
    def inside(self) -> bool:
        """Whether every |Δ| of the block is within ±20 (clamping changes nothing)."""
        found = self.memo.get("inside")
        if found is None:
            d = self["d"]
            found = self.memo["inside"] = np.array(not d.size or (d.min() >= -20.0 and d.max() <= 20.0))
        return bool(found)


#: Below this share of tokens whose sides differ, functions of Δ are computed on those tokens only.
SHARED_BELOW = 0.5


def _of_d(b: Block, f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``f`` of Δ, token by token: on the differing tokens only when most agree (:attr:`Block.differing`),
    the others taking ``f(+0.0)``, the same value bit for bit."""
    where = b.differing
    if where is None:
        return f(b["d"])
    out = np.full(b.t.size, f(np.zeros(1))[0])
    out[where] = f(b["d"][where])
    return out


def _exp_r(b: Block) -> np.ndarray:
    """exp(rollout): exp(trainer) itself, bit for bit, where the sides agree."""
    where = b.differing
    if where is None:
        return np.exp(b.r)
    out = b["exp_t"].copy()
    out[where] = np.exp(b.r[where])
    return out


def _core_pr(b: Block) -> np.ndarray:
    """e^r as e^t (1 + expm1(−Δ)): e^t itself, bit for bit, where the sides agree (expm1(−0.0) is
    −0.0, and 1 + −0.0 is 1), computed on the differing tokens only there."""
    where = b.differing
    if where is None:
        return np.multiply(b["exp_t"], np.add(1.0, b["em1n"]))
    out = b["exp_t"].copy()
    out[where] *= np.add(1.0, np.expm1(np.negative(b["d"][where])))
    return out


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
    where = b.differing
    half = _half_k3(np.subtract(b.t, log_m))
    if where is not None:  # where the sides agree, the two halves are one value
        js = np.add(half, half)
        js[where] = half[where] + _half_k3(np.subtract(b.r[where], log_m[where]))
        return js
    half += _half_k3(np.subtract(b.r, log_m, out=log_m))
    return half


def _exp_abs_d(b: Block) -> np.ndarray:
    """exp(|Δ|) as the larger of exp(Δ) and exp(−Δ): |Δ| is one of them exactly, and exp of a
    non-negative number is at least 1, of a negative one at most 1 (a select by the sign of Δ, the
    same values, costs ×10 on tokens whose signs alternate at random)."""
    return np.maximum(b["exp_d"], b["exp_neg_d"])


def _rho(b: Block) -> np.ndarray:
    """exp(Δ clamped to ±20): exp(Δ) itself where no token is clamped."""
    return b["exp_d"] if b.inside else np.exp(b["d_clamped"])


def _clamped(b: Block) -> np.ndarray:
    """Δ clamped to ±20: Δ itself where no token is clamped."""
    return b["d"] if b.inside else np.clip(b["d"], -20.0, 20.0)


def _mismatch(b: Block) -> np.ndarray:
    """Whether the two sides' recorded bits differ (-0.0 and +0.0 differ, two NaN of one payload agree)."""
    assert b.raw is not None, "bitwise comparisons need every token of the block"
    t, r = b.raw
    unsigned = np.dtype(f"u{t.dtype.itemsize}")
    return t.view(unsigned) != r.view(unsigned)


def _core_k2(b: Block) -> np.ndarray:
    """Δ²/2 as (0.5 Δ) Δ."""
    out = np.multiply(b["d"], 0.5)
    return np.multiply(out, b["d"], out=out)


def _core_js(b: Block) -> np.ndarray:
    """log cosh(Δ/2) as log1p((e^Δ − 1)/2) − Δ/2 (audit.metrics.core's JS)."""
    where = b.differing
    if where is not None:  # +0.0 where the sides agree
        out = np.zeros(b.t.size)
        out[where] = np.log1p(np.multiply(b["em1p"][where], 0.5)) - np.multiply(b["d"][where], 0.5)
        return out
    out = np.multiply(b["em1p"], 0.5)
    np.log1p(out, out=out)
    out -= np.multiply(b["d"], 0.5)
    return out


def _rs_k2(b: Block) -> np.ndarray:
    """k2 = Δ²/2 of Δ clamped to ±20, as (0.5 Δ) Δ."""
    if b.inside:
        return b["core_k2"]
    d = b["d_clamped"]
    out = np.multiply(d, 0.5)
    return np.multiply(out, d, out=out)


def _rs_k3(b: Block) -> np.ndarray:
    """k3 = e^Δ − 1 − Δ of Δ clamped to ±20, as expm1(Δ) − Δ."""
    if b.inside:
        return b["core_k3"]
    d = b["d_clamped"]
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
    "exp_r": _exp_r,
    "abs_p_diff": lambda b: np.abs(np.subtract(b["exp_t"], b["exp_r"])),
    "exp_d": lambda b: _of_d(b, np.exp),
    "exp_neg_d": lambda b: _of_d(b, lambda d: np.exp(np.negative(d))),
    "exp_abs_d": _exp_abs_d,
    "k3": _k3,
    "nemo_k3": _nemo_k3,
    "nemo_k3_reverse": _nemo_k3_reverse,
    "nemo_js": _nemo_js,
    "rho": _rho,  # exp(Δ clamped to ±20), verl's SAFETY_BOUND
    "d_clamped": _clamped,
    "rs_k2": _rs_k2,
    "rs_k3": _rs_k3,
    # audit.metrics.core's statistics: e^Δ − 1 and e^−Δ − 1 (exact near Δ = 0), and of them
    "mismatch": _mismatch,
    "em1p": lambda b: _of_d(b, np.expm1),
    "em1n": lambda b: _of_d(b, lambda d: np.expm1(np.negative(d))),
    "core_pr": _core_pr,  # e^r, exactly e^t where equal
    "core_dp": lambda b: np.abs(np.subtract(b["exp_t"], b["core_pr"])),
    "core_rho": lambda b: np.add(1.0, b["em1p"]),
    "core_k3": lambda b: np.subtract(b["em1p"], b["d"]),
    "core_k3rev": lambda b: np.add(b["em1n"], b["d"]),
    "core_k2": _core_k2,
    "core_js": _core_js,
    "core_expabs": lambda b: np.add(1.0, np.maximum(b["em1p"], b["em1n"])),
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
    "finite_or_zero": lambda x: x if np.isfinite(x).all() else np.where(np.isfinite(x), x, 0.0),
    "clipped": lambda rho, eps: np.abs(rho - 1.0) > eps,  # |ρ − 1| > clip_eps
}
#: Logical expressions over keys only.
_LOGIC: dict[str, Callable[..., np.ndarray]] = {
    "mul": np.multiply,
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


def segment_starts(lengths: np.ndarray, edges: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Where each segment starts: for each sample (of ``lengths`` tokens, from ``starts``), each of
    the positions ``edges`` (ascending, from 0) before its length."""
    reached = np.searchsorted(edges, lengths - 1, side="right")
    firsts = np.repeat(np.cumsum(reached) - reached, reached)
    index = np.arange(int(reached.sum())) - firsts
    return np.repeat(starts, reached) + edges[index]


#: Up to this many samples in a block, a condition is counted (and its first token found) sample by
#: sample, with ``count_nonzero`` and ``argmax``, faster there than one ``reduceat`` cast to int64.
FEW_SAMPLES = 16


def _segmented(how: Reduction) -> bool:
    return not isinstance(how, str) and how[0] in ("segment_sum", "segment_max")


def _reduce(b: Block, how: Reduction, key: Key, split: bool | None = None) -> np.ndarray | _Kept:
    """One reduction of ``key`` over each of the block's samples that have tokens, or (``how``
    ``("segment_sum" | "segment_max", edges)``) over each segment: a sample's tokens cut at the
    positions ``edges`` (sample by sample, each in order of its positions). A reduction of an array
    the block reduced already (one quantity equal to another by construction, such as ρ and
    exp(Δ) where nothing is clamped) is not computed again. Where samples mostly agree bitwise
    (:attr:`Block.agreeing`), a quantity with one value on agreeing tokens is reduced over the
    others and that value counted for them (:class:`_Kept`, :func:`_combine`). ``split``: whether
    that holds of this request (found here if not given)."""
    if split is None:
        split = how in _SPLIT and at_agreeing(key) is not None
    if split:
        agreeing = b.agreeing
        if agreeing is not None:
            assert isinstance(how, str)  # a split reduction is one of _SPLIT
            return _kept_part(agreeing[0], how, key)
    values = b[key]
    memo = (how, id(values))
    found = b.reduced.get(memo)
    if found is not None and found[0] is values:
        return found[1]
    if not b.starts.size:
        out = np.zeros(0, dtype=np.int64 if how == "first" or values.dtype == np.bool_ else np.float64)
    elif _segmented(how):
        starts = segment_starts(b.lengths, np.asarray(how[1]), b.starts)
        ufunc = np.add if how[0] == "segment_sum" else np.maximum
        out = ufunc.reduceat(values, starts)
    else:
        out = _reduce_nonempty(b, how, key)
    b.reduced[memo] = (values, out)
    return out


#: The reductions taken over a sample's kept tokens when it mostly agrees (:attr:`Block.agreeing`).
_SPLIT = ("sum", "max", "min", "m2")


class _Kept:
    """A reduction over the kept tokens of a block's samples (:attr:`Block.agreeing`), each sample's
    own sum beside it for centred squares: combined with the tokens left out once the pass is
    over (:func:`_combine`)."""

    __slots__ = ("sums", "values")

    def __init__(self, values: np.ndarray, sums: np.ndarray | None) -> None:
        self.values, self.sums = values, sums


def _kept_part(kept: Block, how: str, key: Key) -> _Kept:
    """:func:`_reduce` over ``kept``'s samples, one value for each sample of its parent that has
    tokens (0 where a sample kept none)."""
    part = _reduce(kept, how, key, False)
    assert isinstance(part, np.ndarray)
    sums = _sums(kept, key) if how == "m2" else None
    if kept.every:
        return _Kept(part, sums)
    values = np.zeros(kept.nonempty.size, dtype=part.dtype)
    values[kept.nonempty] = part
    full = None
    if sums is not None:
        full = np.zeros(kept.nonempty.size)
        full[kept.nonempty] = sums
    return _Kept(values, full)


def _array(piece: np.ndarray | _Kept) -> np.ndarray:
    """A block's reduction (that of its samples' kept tokens, for a :class:`_Kept`)."""
    return piece.values if isinstance(piece, _Kept) else piece


def _kept_sums(piece: np.ndarray | _Kept) -> np.ndarray:
    """A piece's kept tokens' sums (zeros for a block whose samples kept every token: unused)."""
    if isinstance(piece, _Kept) and piece.sums is not None:
        return piece.sums
    return np.zeros(piece.values.size if isinstance(piece, _Kept) else piece.size)


def merge_parts(parts: list[list[Any]]) -> list[list[Any]]:
    """Consecutive blocks' parts (:meth:`TokenBlocks.measure_spans`) as the one part of a block
    holding all their samples, which :meth:`TokenBlocks.measure` combines as it would the blocks
    one by one: one array a request instead of one a block (a pool process sends one)."""
    if len(parts) < 2:
        return parts
    merged: list[Any] = []
    for i in range(len(parts[0])):
        pieces = [p[i] for p in parts]
        values = np.concatenate([_array(x) for x in pieces])
        if any(isinstance(x, _Kept) for x in pieces):
            merged.append(_Kept(values, np.concatenate([_kept_sums(x) for x in pieces])))
        else:
            merged.append(values)
    return [merged]


def _combine(
    how: str, values: np.ndarray, sums: np.ndarray, kept: np.ndarray, left: np.ndarray, constant: Any
) -> np.ndarray:
    """Samples' reductions from those of their ``kept`` tokens (``values``, ``sums``) and ``left``
    tokens of value ``constant``: a sum adds ``left × constant`` (a count, ``left`` if the condition
    holds there), an extreme takes the constant in, centred squares pool the two groups' (Chan et
    al.). A sample that left nothing out keeps its reduction's bits."""
    if how == "sum":
        if values.dtype == np.int64:  # a count
            return values + (left if constant else 0)
        rest = left * float(constant)
        return np.where(left == 0, values, np.where(kept == 0, rest, values + rest))
    if how in ("max", "min"):
        pick = np.maximum if how == "max" else np.minimum
        return np.where(kept == 0, float(constant), np.where(left > 0, pick(values, float(constant)), values))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums / np.where(kept > 0, kept, 1)
        between = kept * left / np.maximum(kept + left, 1) * np.square(mean - float(constant))
    return np.where((left > 0) & (kept > 0), values + between, values)


#: Keys found to take one value on every token whose sides agree bitwise: that value (None: not so).
_AT_AGREEING: dict[Key, Any] = {}
#: Logprobs on which :func:`at_agreeing` tries a quantity (both sides equal): a few thousand, spread
#: over the range logprobs take, fixed by a seed. A quantity that depends on the logprob through a
#: rounding (``log(exp(t))`` is ``t`` for most ``t``, not all, and which ones depends on the CPU's
#: math library) shows it on some of them on any machine; a handful of round values can all land
#: exactly and pass such a quantity off as constant.
_PROBE = np.concatenate(
    [
        -np.random.default_rng(20261207).exponential(3.0, 4096),
        [-1.0, -2.5, -0.125, -7.0, -1e-6, -30.0, -0.0, -1e-30, -80.0],
    ]
).astype(np.float32)


def at_agreeing(key: Key) -> float | bool | None:
    """The one value ``key`` takes on every token whose two sides agree bitwise, whatever the
    logprob (Δ is +0.0 there: functions of Δ alone, |e^t − e^r|, ...); None for a quantity that
    depends on the logprob itself (e^t, the sides' sums). Found once per key, on tokens of
    several logprobs."""
    if key not in _AT_AGREEING:
        probe = Block(
            _PROBE.astype(np.float64),
            _PROBE.astype(np.float64),
            np.array([_PROBE.size]),
            (_PROBE, _PROBE),
            True,
        )
        probe.shared["agreeing"] = None
        with np.errstate(all="ignore"):
            values = probe[key]
        same = values.dtype != object and np.all(
            values.view(np.uint8).reshape(values.size, -1)
            == values.view(np.uint8).reshape(values.size, -1)[0]
        )
        _AT_AGREEING[key] = values[0].item() if same else None
    return _AT_AGREEING[key]


def _reduce_nonempty(b: Block, how: Reduction, key: Key) -> np.ndarray:
    """:func:`_reduce` over the block's samples that have tokens."""
    values = b[key]
    few = b.starts.size <= FEW_SAMPLES
    if how == "first":  # each sample's first index where the condition holds, -1 if none
        if few:
            found = [int(values[s:e].argmax()) for s, e in b.spans]
            return np.array([i if values[s + i] else -1 for i, (s, _) in zip(found, b.spans, strict=True)])
        out = np.full(b.starts.size, -1, dtype=np.int64)
        where = np.flatnonzero(values)
        if where.size:
            local = np.searchsorted(b.starts, where, side="right") - 1
            firsts = np.flatnonzero(np.r_[True, local[1:] != local[:-1]])
            out[local[firsts]] = where[firsts] - b.starts[local[firsts]]
        return out
    if how == "sum":
        return _sums(b, key)
    if how == "max":
        return np.maximum.reduceat(values, b.starts)
    if how == "min":
        return np.minimum.reduceat(values, b.starts)
    centred = _centred(b, key)
    if how == "m2":
        return np.add.reduceat(np.square(centred), b.starts)
    # ("cm", other): the co-moment about each sample's two means
    return np.add.reduceat(np.multiply(centred, _centred(b, how[1])), b.starts)


def _sums(b: Block, key: Key) -> np.ndarray:
    """Each sample's sum of ``key`` (a count for a condition), once per block."""
    memo = ("sum", key)
    found = b.sums.get(memo)
    if found is None:
        values = b[key]
        if values.dtype != np.bool_:
            found = np.add.reduceat(values, b.starts)
        elif b.starts.size <= FEW_SAMPLES:
            found = np.array([np.count_nonzero(values[s:e]) for s, e in b.spans], dtype=np.int64)
        else:
            found = np.add.reduceat(values, b.starts, dtype=np.int64)
        b.sums[memo] = found
    return found


def _centred(b: Block, key: Key) -> np.ndarray:
    """``key`` less its sample's mean, token by token, once per block."""
    memo = ("centred", key)
    found = b.sums.get(memo)
    if found is None:
        means = _sums(b, key) / b.lengths
        found = np.subtract(b[key], np.repeat(means, b.lengths))
        b.sums[memo] = found
    return found


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
        block_tokens: int | None = None,
    ) -> None:
        self.trainer, self.rollout = trainer, rollout
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.finite_only = finite_only
        self.n_samples = self.offsets.size - 1
        self._bounds = block_bounds(self.offsets, BLOCK_TOKENS if block_tokens is None else block_tokens)
        self._done: dict[Request, np.ndarray] = {}
        self._lock = threading.Lock()
        self._recording: list[Request] | None = None
        self.lengths = np.diff(self.offsets)
        if finite_only:
            self.lengths = self._finite_lengths()

    @cached_property
    def all_finite(self) -> bool:
        """Whether every token is finite on both sides."""
        return bool(np.isfinite(self.trainer).all() and np.isfinite(self.rollout).all())

    def _finite_lengths(self) -> np.ndarray:
        if self.all_finite:
            return np.diff(self.offsets)
        finite = np.isfinite(self.trainer) & np.isfinite(self.rollout)
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
        if self.finite_only and not self.all_finite:
            finite = np.isfinite(t) & np.isfinite(r)
            if not finite.all():
                t, r = t[finite], r[finite]
                lengths = self.lengths[lo:hi]
                return Block(t, r, lengths)
        return Block(t, r, lengths, (self.trainer[a:b], self.rollout[a:b]), self.all_finite)

    def measure(self, requests: Iterable[Request], threads: int = 1) -> None:
        """Measure every request not measured yet, in one pass over the blocks, on ``threads``
        lanes: with a :class:`~audit.metrics.block_pool.BlockPool` active in this context
        (:func:`~audit.metrics.block_pool.measuring_in`), some blocks go to its processes; without
        one, to threads (each block's reductions are those of one lane either way: the same bits)."""
        with self._lock:
            todo = list(dict.fromkeys(q for q in requests if q not in self._done))
            if not todo:
                return
            spans = list(zip(self._bounds[:-1], self._bounds[1:], strict=True))
            pool = active_pool() if threads > 1 and len(spans) > 1 else None
            if pool is not None:
                parts = pool.measure(self, spans, todo)
            elif threads > 1 and len(spans) > 1:
                with ThreadPoolExecutor(min(threads, len(spans))) as threaded:
                    parts = list(threaded.map(lambda span: self.measure_spans([span], todo)[0], spans))
            else:
                parts = self.measure_spans(spans, todo)
            self._keep(todo, parts)

    def measure_spans(self, spans: list[tuple[int, int]], todo: list[Request]) -> list[list[Any]]:
        """Each block's reductions of ``todo`` (blocks ``spans``, as sample ranges), then how many
        tokens each of its samples left out (:attr:`Block.agreeing`) and kept: what :meth:`measure`
        combines."""
        # a request's quantity is dropped from the block after its last request: fewer live
        # arrays, so that the block's working set stays in cache
        last = {key: i for i, (_, key) in enumerate(todo)}
        for i, (how, _) in enumerate(todo):
            if not isinstance(how, str) and how[0] == "cm":  # a co-moment reads its other quantity
                last[how[1]] = max(last.get(how[1], i), i)
        split = [how in _SPLIT and at_agreeing(key) is not None for how, key in todo]
        parts: list[list[Any]] = []
        for bounds in spans:
            out: list[Any] = []
            with np.errstate(all="ignore"):
                block = self._block(*bounds)
                for i, (how, key) in enumerate(todo):
                    out.append(_reduce(block, how, key, split[i]))
                    if last[key] == i and isinstance(key, tuple):
                        block.memo.pop(key, None)
                agreeing = block.agreeing
                left = agreeing[1] if agreeing is not None else np.zeros(block.lengths.size, np.int64)
            out.append(left)
            out.append(block.lengths - left)
            parts.append(out)
        return parts

    def _keep(self, todo: list[Request], parts: list[list[Any]]) -> None:
        """Each request's per-sample values from the blocks' ``parts`` (:meth:`measure_spans`)."""
        nonempty = np.diff(self.offsets) > 0
        if self.finite_only:
            nonempty = self.lengths > 0
        left = np.concatenate([_array(p[-2]) for p in parts]) if parts else np.zeros(0, np.int64)
        kept = np.concatenate([_array(p[-1]) for p in parts]) if parts else np.zeros(0, np.int64)
        for i, (how, key) in enumerate(todo):
            pieces = [p[i] for p in parts]
            found = np.concatenate([_array(x) for x in pieces]) if parts else np.zeros(0)
            if any(isinstance(piece, _Kept) for piece in pieces):  # samples that mostly agree
                sums = np.concatenate([_kept_sums(x) for x in pieces])
                assert isinstance(how, str)
                found = _combine(how, found, sums, kept, left, at_agreeing(key))
            if _segmented(how):  # one value a segment
                values = found
            else:  # one value a sample: the empty ones' are the reduction's own
                fill = -1 if how == "first" else _FILL.get(how if isinstance(how, str) else "", 0)
                values = np.full(self.n_samples, fill, dtype=found.dtype)
                values[nonempty] = found
            values.setflags(write=False)
            self._done[(how, key)] = values

    def get(self, how: Reduction, key: Key) -> np.ndarray:
        """The per-sample reduction ``how`` of ``key`` (measured now if it was not)."""
        request = (how, key)
        if self._recording is not None:  # planning: note it, hand back a placeholder
            self._recording.append(request)
            return np.zeros(self.n_samples)
        if request not in self._done:
            self.measure([request])
        return self._done[request]

    def plan(self, reads: Callable[[], object]) -> list[Request]:
        """Every reduction ``reads()`` asks for, found by running it once on placeholders (zeros;
        its result and any error are dropped). A reduction it asks for only on the real values is
        measured when asked."""
        self._recording = []
        try:
            with np.errstate(all="ignore"):
                reads()
        except Exception:  # noqa: BLE001, S110 — placeholders may take a branch the values will not
            pass
        finally:
            found, self._recording = self._recording, None
        return found

    def planned(self, reads: Callable[[], object], threads: int = 1) -> None:
        """Measure in one pass every reduction ``reads()`` asks for (:meth:`plan`)."""
        self.measure(self.plan(reads), threads)

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


def block_bounds(offsets: np.ndarray, block_tokens: int) -> list[int]:
    """Sample indices ``0 = b_0 < b_1 < ... = n`` cutting the samples into runs of about
    ``block_tokens`` tokens (a longer sample is a block of its own)."""
    n = offsets.size - 1
    bounds = [0]
    while bounds[-1] < n:
        start = bounds[-1]
        cut = int(np.searchsorted(offsets, offsets[start] + block_tokens, side="right")) - 1
        bounds.append(min(max(cut, start + 1), n))
    return bounds
