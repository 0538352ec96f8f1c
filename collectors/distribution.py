"""The device half of the full-distribution comparison (:mod:`isoaudit.audit.distribution`): from
the full log-probability rows of the sampled positions, each position's top-k and its
full-vocabulary sketch ``Rᵀ √p``, computed where the rows are; only ``k`` ids, ``k`` logprobs and 32
floats per position leave the device. The sketch is one pass of
:func:`isoaudit.kernels.distribution.sketch_rows` where Triton runs, float64 torch elsewhere."""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch
from isoaudit.audit.distribution import SKETCH_DIM, SKETCH_SCALE, sketch_projection, sketch_sign_bits
from isoaudit.kernels._triton import resolve

#: The float64 √p of at most this many bytes exists at once (the rows themselves are the caller's).
CHUNK_BYTES = 256 << 20

log = logging.getLogger(__name__)

_PROJECTIONS: dict[tuple[int, str, bool], torch.Tensor] = {}
#: Why the kernel failed in this process (None: it has not): the torch path serves from then on.
_KERNEL_REFUSED: str | None = None
_LOCK = threading.Lock()


def _projection(vocab: int, device: torch.device, packed: bool = False) -> torch.Tensor:
    """The sign matrix in float64 on ``device`` (``packed``: its int32 sign bits per token, as the
    kernel reads them), built once per (vocab, device)."""
    key = (vocab, str(device), packed)
    with _LOCK:
        found = _PROJECTIONS.get(key)
        if found is None:
            host = sketch_sign_bits(vocab) if packed else sketch_projection(vocab).astype(np.float64)
            found = _PROJECTIONS[key] = torch.from_numpy(host).to(device)
    return found


def distribution_rows(logprob_rows: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """``logprob_rows``: ``[positions, vocab]`` log-probabilities (rows that sum to 1 in probability;
    -inf for tokens a sampler masked). Returns on their device ``topk_ids`` (int32 ``[n, k]``, rank
    order), ``topk_logprobs`` (float32 ``[n, k]``) and ``sketch`` (float32 ``[n, SKETCH_DIM]``,
    summed in float64, :func:`sketch_rows`)."""
    if logprob_rows.dim() != 2:
        raise ValueError(f"logprob_rows: expected [positions, vocab], got shape {list(logprob_rows.shape)}")
    vocab = int(logprob_rows.shape[1])
    if not 1 <= k <= vocab:
        raise ValueError(f"k: must be in [1, vocab={vocab}], got {k}")
    rows = logprob_rows.detach().float()
    values, ids = torch.topk(rows, k, dim=-1, sorted=True)
    return {"topk_ids": ids.to(torch.int32), "topk_logprobs": values, "sketch": sketch_rows(rows)}


def sketch_rows(rows: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """The float32 ``[n, SKETCH_DIM]`` sketch of float32 log-probability ``rows`` ``[n, vocab]``:
    one pass of the kernel where Triton runs (``impl``: "triton" or "torch" forces one), else
    float64 torch :data:`CHUNK_BYTES` of positions at a time."""
    global _KERNEL_REFUSED
    vocab = int(rows.shape[1])
    if resolve(impl, rows) == "triton" and (impl is not None or _KERNEL_REFUSED is None):
        from isoaudit.kernels import distribution as kernel

        bits = _projection(vocab, rows.device, packed=True)
        try:
            return kernel.sketch_rows(rows, bits, float(SKETCH_SCALE))
        except Exception as exc:  # a Triton that will not build it: the torch path from now on
            if impl is not None:
                raise
            _KERNEL_REFUSED = repr(exc)
            log.warning(
                "isoaudit: the distribution sketch kernel failed (%s); float64 torch from now on", exc
            )
    projection = _projection(vocab, rows.device)
    sketch = torch.empty(rows.shape[0], SKETCH_DIM, dtype=torch.float32, device=rows.device)
    step = max(1, CHUNK_BYTES // (vocab * 8))  # √p in float64 a chunk of positions at a time
    for start in range(0, rows.shape[0], step):
        root = torch.exp(rows[start : start + step].double() * 0.5)  # exp(-inf) = 0
        sketch[start : start + step] = (root @ projection).float()
    return sketch


__all__ = ["SKETCH_DIM", "distribution_rows", "sketch_rows"]
