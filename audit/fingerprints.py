"""Per-token-row activation fingerprints (DESIGN.md, "Fingerprints").

Computed on the activation's own device inside forward hooks; only a few bytes per row leave it.

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

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

#: Width of the sketch, fixed by the wire format.
SKETCH_DIM = 16

#: Fixed seeds of the digest weights and of the sketch projection (changing them changes every digest).
DIGEST_SEED = 0x15A0D17_D16E57
SKETCH_SEED = 0x15A0D17_5CE7C4


@dataclass(frozen=True)
class _Format:
    int_dtype: torch.dtype
    mantissa_bits: int
    ladder_bits: tuple[int, ...]


#: Per float dtype: the same-width integer view, the stored mantissa bits and the default ladder.
#: bf16 keeps 7 mantissa bits, so (6, 4, 2, 0) brackets 2**-6 .. 1; fp32's rung at 7 bits asks
#: "equal at bf16 precision?", the question a bf16 trainer against an fp32 engine raises.
FORMATS: dict[torch.dtype, _Format] = {
    torch.bfloat16: _Format(torch.int16, 7, (6, 4, 2, 0)),
    torch.float16: _Format(torch.int16, 10, (8, 6, 4, 2, 0)),
    torch.float32: _Format(torch.int32, 23, (16, 10, 7, 4, 0)),
    torch.float64: _Format(torch.int64, 52, (40, 23, 10, 7, 0)),
}


def default_ladder_bits(dtype: torch.dtype) -> tuple[int, ...]:
    """The ladder used when none is given: mantissa bits kept per rung, finest first."""
    return _format(dtype).ladder_bits


def _format(dtype: torch.dtype) -> _Format:
    try:
        return FORMATS[dtype]
    except KeyError:
        raise TypeError(
            f"x: unsupported dtype {dtype}; expected one of {sorted(map(str, FORMATS))}"
        ) from None


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


@lru_cache(maxsize=64)
def _device_weights(hidden: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(digest_weights(hidden).view(np.int64)).to(device)


@lru_cache(maxsize=64)
def _device_sketch(hidden: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(sketch_matrix(hidden)).to(device=device, dtype=dtype)


@lru_cache(maxsize=64)
def _device_masks(masks: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(masks, dtype=torch.int64, device=device)


#: The per-row fields of :class:`RowFingerprints`, named as :class:`audit.records.RegionFingerprints` names them.
ROW_FIELDS: tuple[str, ...] = ("digest", "ladder", "sketch", "l2", "maxabs")


@dataclass(frozen=True)
class RowFingerprints:
    """Fingerprints of ``n`` rows, as torch tensors on the activation's device."""

    digest: torch.Tensor  # int64 [n], read as uint64
    ladder: torch.Tensor  # int64 [n, R], read as uint64
    sketch: torch.Tensor  # float32 [n, 16]
    l2: torch.Tensor  # float32 [n]
    maxabs: torch.Tensor  # float32 [n]
    ladder_bits: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.digest.shape[0])

    def select(self, index: Any) -> RowFingerprints:
        """A subset of rows (a slice, an index tensor or a mask), e.g. one sample's tokens."""
        return RowFingerprints(
            self.digest[index],
            self.ladder[index],
            self.sketch[index],
            self.l2[index],
            self.maxabs[index],
            self.ladder_bits,
        )

    def to_numpy(self) -> dict[str, Any]:
        """Arrays named and typed as :class:`audit.records.RegionFingerprints` fields."""
        return {
            "digest": self.digest.detach().cpu().numpy().view(np.uint64),
            "ladder_bits": list(self.ladder_bits),
            "ladder": self.ladder.detach()
            .cpu()
            .numpy()
            .view(np.uint64)
            .reshape(len(self), len(self.ladder_bits)),
            "sketch": self.sketch.detach().cpu().numpy().astype(np.float32, copy=False),
            "l2": self.l2.detach().cpu().numpy().astype(np.float32, copy=False),
            "maxabs": self.maxabs.detach().cpu().numpy().astype(np.float32, copy=False),
        }


def _check_ladder(ladder_bits: Sequence[int] | None, fmt: _Format) -> tuple[int, ...]:
    if ladder_bits is None:
        return fmt.ladder_bits
    bits = tuple(int(b) for b in ladder_bits)
    if any(b < 0 or b > fmt.mantissa_bits for b in bits):
        raise ValueError(
            f"ladder_bits: each rung keeps 0..{fmt.mantissa_bits} mantissa bits, got {list(bits)}"
        )
    if any(a <= b for a, b in zip(bits, bits[1:], strict=False)):
        raise ValueError(f"ladder_bits: must be strictly decreasing (finest rung first), got {list(bits)}")
    return bits


def _chunk_rows(hidden: int, device: torch.device) -> int:
    # CPU: keep each chunk's int64 temporaries in cache (2**18 elements = 2 MiB), which makes the
    # passes over it several times faster than over one big tensor. GPU: large chunks, few launches.
    budget = 1 << 18 if device.type == "cpu" else 1 << 24
    return max(1, budget // max(hidden, 1))


def _integer_sums_chunked(
    rows: torch.Tensor,
    int_dtype: torch.dtype,
    weights: torch.Tensor,
    masks: list[int],
    digest: torch.Tensor,
    ladder: torch.Tensor,
    step: int,
) -> None:
    """Digest and ladder in eager torch, a chunk of rows at a time, into ``digest``/``ladder``."""
    n, hidden = rows.shape
    # Scratch buffers allocated once per call: fresh allocations per chunk would page-fault.
    wide_buf = torch.empty(step, hidden, dtype=torch.int64, device=rows.device)
    scratch_buf = torch.empty_like(wide_buf)
    for start in range(0, n, step):
        stop = min(start + step, n)
        chunk = rows[start:stop]
        wide, scratch = wide_buf[: stop - start], scratch_buf[: stop - start]
        wide.copy_(chunk.view(int_dtype) if chunk.is_contiguous() else chunk.contiguous().view(int_dtype))
        torch.mul(wide, weights, out=scratch)
        torch.sum(scratch, dim=-1, out=digest[start:stop])
        for j, mask in enumerate(masks):
            torch.bitwise_and(wide, mask, out=scratch)
            scratch.mul_(weights)
            ladder[start:stop, j] = scratch.sum(dim=-1)


def _integer_sums(
    as_int: torch.Tensor, weights: torch.Tensor, masks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest and ladder in one expression, for the compiler to fuse into one pass over the rows
    (eagerly it would materialise [rows, rungs, hidden] int64)."""
    wide = as_int.to(torch.int64)
    digest = (wide * weights).sum(-1)
    ladder = ((wide.unsqueeze(1) & masks.unsqueeze(-1)) * weights).sum(-1)
    return digest, ladder


_FUSED: Any = None


def _fused_integer_sums() -> Any:
    """The compiled :func:`_integer_sums` on CUDA, or None to use the eager chunked path.

    Eager torch spends most of the time writing int64 temporaries; the fused kernel reads each
    activation once. ``ISOAUDIT_FINGERPRINT_COMPILE=0`` turns it off; a failed compile falls back.
    """
    global _FUSED
    if _FUSED is None:
        _FUSED = False
        if os.environ.get("ISOAUDIT_FINGERPRINT_COMPILE", "1") != "0":
            try:
                compiled = torch.compile(_integer_sums, dynamic=True, fullgraph=True)
                probe = torch.arange(-300, 300, dtype=torch.int16, device="cuda").reshape(2, 300)
                w = torch.arange(1, 601, 2, dtype=torch.int64, device="cuda") * 0x9E3779B97F4A7C1
                m = torch.tensor([-4, -1], dtype=torch.int64, device="cuda")
                got, want = compiled(probe, w, m), _integer_sums(probe, w, m)
                if torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]):
                    _FUSED = compiled
                else:
                    warnings.warn(
                        "fingerprints: compiled digest disagrees with eager; using eager", stacklevel=2
                    )
            except Exception as exc:  # noqa: BLE001 - any compiler failure means: use the eager path
                warnings.warn(
                    f"fingerprints: torch.compile unavailable ({exc!r:.200}); using eager", stacklevel=2
                )
    return _FUSED or None


def fingerprint_rows(x: torch.Tensor, ladder_bits: Sequence[int] | None = None) -> RowFingerprints:
    """Fingerprint every row of ``x`` ([..., hidden]; rows = leading dims flattened) on x's device."""
    fmt = _format(x.dtype)
    bits = _check_ladder(ladder_bits, fmt)
    hidden = int(x.shape[-1]) if x.dim() else 1
    rows = x.detach().reshape(-1, hidden)
    n, device = rows.shape[0], rows.device
    digest = torch.empty(n, dtype=torch.int64, device=device)
    ladder = torch.empty(n, len(bits), dtype=torch.int64, device=device)
    sketch = torch.empty(n, SKETCH_DIM, dtype=torch.float32, device=device)
    l2 = torch.empty(n, dtype=torch.float32, device=device)
    maxabs = torch.empty(n, dtype=torch.float32, device=device)
    if n == 0:
        return RowFingerprints(digest, ladder, sketch, l2, maxabs, bits)
    weights = _device_weights(hidden, device)
    wide = x.dtype == torch.float64
    proj = _device_sketch(hidden, device, torch.float64 if wide else torch.float32)
    # Clearing the low (mantissa - k) bits; as a negative int64 it also keeps the sign extension.
    masks = [-(1 << (fmt.mantissa_bits - k)) for k in bits]
    fused = _fused_integer_sums() if device.type == "cuda" else None
    step = min(_chunk_rows(hidden, device), n)
    with torch.no_grad():
        if fused is not None:
            as_int = rows.contiguous().view(fmt.int_dtype)
            digest, ladder = fused(as_int, weights, _device_masks(tuple(masks), device))
        else:
            _integer_sums_chunked(rows, fmt.int_dtype, weights, masks, digest, ladder, step)
        # a copy, reused across chunks: the activation itself must never be written to
        values_buf = torch.empty(step, hidden, dtype=proj.dtype, device=device)
        for start in range(0, n, step):
            stop = min(start + step, n)
            values = values_buf[: stop - start]
            values.copy_(rows[start:stop])
            if device.type == "cuda" and x.dtype == torch.float32:
                # TF32 matmuls would round fp32 inputs to 10 mantissa bits; bf16 parts are exact in
                # TF32, so sketch the exact high part and the small remainder separately.
                high = values.to(torch.bfloat16).float()
                sketch[start:stop] = high @ proj + (values - high) @ proj
            else:
                sketch[start:stop] = (values @ proj).float()
            l2[start:stop] = torch.linalg.vector_norm(values, dim=-1).float()
            maxabs[start:stop] = values.abs_().amax(dim=-1).float()
    return RowFingerprints(digest, ladder, sketch, l2, maxabs, bits)


def rows_equal(digest_a: np.ndarray | torch.Tensor, digest_b: np.ndarray | torch.Tensor) -> np.ndarray:
    """Per row: are the two rows bit-identical (up to a 2**-64 digest collision)?"""
    a, b = _as_u64(digest_a, "digest_a"), _as_u64(digest_b, "digest_b")
    if a.shape != b.shape:
        raise ValueError(f"digest_b: shape {list(b.shape)} differs from digest_a {list(a.shape)}")
    return a == b


def first_agreeing_rung(
    ladder_a: np.ndarray | torch.Tensor, ladder_b: np.ndarray | torch.Tensor
) -> np.ndarray:
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


def _as_u64(values: np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype.kind not in "iu" or array.dtype.itemsize != 8:
        raise ValueError(f"{name}: expected 64-bit integers, got {array.dtype}")
    return array.view(np.uint64)
