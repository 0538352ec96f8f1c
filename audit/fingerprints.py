"""Per-token-row activation fingerprints (DESIGN.md, "Fingerprints").

This module is the numpy half: the digest weights and the sketch projection every device uses,
and the comparisons the service runs on stored rows. The torch half that computes fingerprints on
the activation's device (inside forward hooks; only a few bytes per row leave it) is
:mod:`collectors.fingerprints`: ``audit`` never imports torch.

* **digest** decides *whether* two rows are equal. The row's elements are read as integers (their
  bit patterns, sign-extended from the element width) and summed with odd pseudo-random 64-bit
  weights keyed by the column index, modulo 2**64. Integer addition is associative, so the result
  does not depend on reduction order, chunking, batch position or device. Any change of one
  element changes the digest: the change is ``w_j * δ`` with ``w_j`` odd and ``0 < |δ| < 2**64``,
  never 0 mod 2**64.
* **ladder** brackets *how far apart* rows are: the same digest after truncating every mantissa to
  ``k`` bits, for decreasing ``k``. Rows agreeing at a rung of ``k`` bits agree elementwise to a
  relative error below ``2**-k`` (:func:`relative_error_bound`). Disagreement proves nothing about
  size: a tiny change can cross a truncation boundary, so rows with many small differences often
  disagree on every rung; the sketch is what measures them.
* **sketch** estimates the size of a difference: a fixed ±1/4 projection to 16 float32 values, so
  ``||sketch_a - sketch_b||`` estimates ``||a - b||`` without bias in the square. For a random
  difference the ratio estimate/truth is distributed as sqrt(χ²₁₆/16): within 2x with probability
  0.9989, within 25% for the median row; a magnitude, not a measurement. ``l2`` and ``maxabs``
  of each row ride along.

The digest weights and the projection are pure functions of (column index, fixed seed) computed
with integer arithmetic on the CPU, so every device uses the same ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: A numpy array, or anything with ``.detach().cpu().numpy()`` (a torch tensor).
ArrayLike = np.ndarray | Any

#: Width of the sketch, fixed by the wire format.
SKETCH_DIM = 16

#: Fixed seeds of the digest weights and of the sketch projection (changing them changes every digest).
DIGEST_SEED = 0x15A0D17_D16E57
SKETCH_SEED = 0x15A0D17_5CE7C4


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 (wrapping) — a fixed, well-mixed function of its input."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _keyed(hidden: int, seed: int) -> np.ndarray:
    return _splitmix64(np.arange(hidden, dtype=np.uint64) ^ np.uint64(seed))


def digest_weights(hidden: int) -> np.ndarray:
    """The odd 64-bit weight of each column, as uint64."""
    return _keyed(hidden, DIGEST_SEED) | np.uint64(1)


def sketch_matrix(hidden: int) -> np.ndarray:
    """The [hidden, 16] float32 projection: ±1/4 from the bits of a keyed hash (E||Rᵀd||² = ||d||²)."""
    bits = _keyed(hidden, SKETCH_SEED)[:, None] >> np.arange(SKETCH_DIM, dtype=np.uint64)[None, :]
    return np.where(bits & np.uint64(1), np.float32(0.25), np.float32(-0.25)).astype(np.float32)


#: The per-row fields of ``collectors.fingerprints.RowFingerprints``, named as :class:`audit.records.RegionFingerprints` names them.
ROW_FIELDS: tuple[str, ...] = ("digest", "ladder", "sketch", "l2", "maxabs")


def rows_equal(digest_a: ArrayLike, digest_b: ArrayLike) -> np.ndarray:
    """Per row: are the two rows bit-identical (up to a 2**-64 digest collision)?"""
    a, b = _as_u64(digest_a, "digest_a"), _as_u64(digest_b, "digest_b")
    if a.shape != b.shape:
        raise ValueError(f"digest_b: shape {list(b.shape)} differs from digest_a {list(a.shape)}")
    return a == b


def first_agreeing_rung(ladder_a: ArrayLike, ladder_b: ArrayLike) -> np.ndarray:
    """Per row: index of the finest ladder rung on which the rows agree, or -1 if none does.

    Truncations nest, so agreeing on a rung implies agreeing on every coarser one; with
    ``ladder_bits[i]`` kept bits the max elementwise relative difference is below
    ``relative_error_bound(ladder_bits[i])``.
    """
    a, b = _as_u64(ladder_a, "ladder_a"), _as_u64(ladder_b, "ladder_b")
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(
            f"ladder_b: shape {list(b.shape)} must equal ladder_a {list(a.shape)}, both [rows, rungs]"
        )
    agree = a == b
    return np.where(agree.any(axis=1), agree.argmax(axis=1), -1).astype(np.int64)


def relative_error_bound(bits: int | np.ndarray) -> float | np.ndarray:
    """What agreement on a rung of ``bits`` kept mantissa bits proves: ``|a - b| < 2**-bits * min(|a|, |b|)``
    for every pair of corresponding elements (same sign, same binade, equal leading bits). Holds for
    normal numbers; zeros and subnormals agree only absolutely. A rung index of -1 (no agreement)
    maps to ``inf`` when given as ``bits=-1``."""
    b = np.asarray(bits)
    out = np.where(b < 0, np.inf, np.exp2(-np.maximum(b, 0).astype(np.float64)))
    return float(out) if out.ndim == 0 else out


def estimate_relative_l2(
    sketch_a: np.ndarray, sketch_b: np.ndarray, l2_a: np.ndarray, l2_b: np.ndarray
) -> np.ndarray:
    """Per row: estimate of ``||a - b|| / max(||a||, ||b||)`` from the sketches (0 when both are 0).

    Use it only where digests differ: sketches are float32 matmuls, so equal rows fingerprinted on
    different devices may show a tiny non-zero estimate.
    """
    sa = np.asarray(sketch_a, dtype=np.float64)
    sb = np.asarray(sketch_b, dtype=np.float64)
    if sa.shape != sb.shape or sa.ndim != 2:
        raise ValueError(
            f"sketch_b: shape {list(sb.shape)} must equal sketch_a {list(sa.shape)}, both [rows, 16]"
        )
    la, lb = np.asarray(l2_a, dtype=np.float64), np.asarray(l2_b, dtype=np.float64)
    if la.shape != (sa.shape[0],) or lb.shape != (sa.shape[0],):
        raise ValueError(f"l2_a/l2_b: expected {sa.shape[0]} rows, got {list(la.shape)} and {list(lb.shape)}")
    diff = np.linalg.norm(sa - sb, axis=1)
    scale = np.maximum(la, lb)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(diff == 0, 0.0, diff / scale)


def _as_u64(values: ArrayLike, name: str) -> np.ndarray:
    detach = getattr(values, "detach", None)
    if callable(detach):  # a torch tensor, read without importing torch
        values = detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype.kind not in "iu" or array.dtype.itemsize != 8:
        raise ValueError(f"{name}: expected 64-bit integers, got {array.dtype}")
    return array.view(np.uint64)
