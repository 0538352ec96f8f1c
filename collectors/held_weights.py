"""Digests of the weights a side actually holds, one per tensor, computed on the tensor's device.

A sync that never happened (a broken broadcast, a loader that skipped a tensor, a stale buffer sent)
leaves both sides claiming one weight version while computing with different weights. Each side
digests what it holds at every weight version change; the ``weights`` diagnosis then names the
tensors whose digests differ (``Manifest.weight_tensor_digests``).

The digest depends only on a tensor's dtype, shape and bytes, so a slice of a fused engine
parameter (vLLM's ``qkv_proj`` rows of ``k_proj``) digests to the same value as the trainer's own
``k_proj`` tensor, on any device. The bytes are read as 16-bit words ``w`` (8-bit for an odd byte
count), laid out as rows of :data:`ROW` words, and reduced to ``Σ_r b_r · Σ_c w_rc · a_c`` mod 2**64
with keyed odd integers ``a`` (20 bits) and ``b`` (64 bits). The row sums are exact in float64
(|Σ| < 2**15 · 2**20 · 2**10 < 2**53), so one GEMV computes them on any device in any order with
the same result; a change of any single word always changes the digest (``a_c b_r`` is odd).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import numpy as np
import torch

#: Words per digest row (the GEMV's width).
ROW = 1024
#: Rows per chunk: bounds the float64 temporary (ROW * CHUNK_ROWS * 8 bytes = 32 MiB).
CHUNK_ROWS = 4096
_SEED_A, _SEED_B = 0x1D0A0D17, 0x5EED0B1E


def _splitmix64(index: np.ndarray, seed: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=8)
def _column_keys(device: torch.device) -> torch.Tensor:
    """The ROW column keys: odd integers below 2**20, as float64 (exact)."""
    keys = (_splitmix64(np.arange(ROW), _SEED_A) >> np.uint64(44)) | np.uint64(1)
    return torch.from_numpy(keys.astype(np.float64)).to(device)


_ROW_KEYS: dict[torch.device, torch.Tensor] = {}


def _row_keys(n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` row keys (odd 64-bit integers as int64), grown and cached per device."""
    have = _ROW_KEYS.get(device)
    if have is None or have.numel() < n:
        size = max(n, 2 * (have.numel() if have is not None else 0), 4096)
        keys = _splitmix64(np.arange(size), _SEED_B) | np.uint64(1)
        have = torch.from_numpy(keys.view(np.int64)).to(device)
        _ROW_KEYS[device] = have
    return have[:n]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    raw = (flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)).reshape(-1)
    return raw.view(torch.int16) if raw.numel() % 2 == 0 else raw.view(torch.int8)


def digest_value(tensor: torch.Tensor) -> torch.Tensor:
    """The 64-bit digest of ``tensor``'s bytes, as an int64 scalar on its device (no host sync)."""
    words = _words(tensor)
    device = words.device
    n = int(words.numel())
    rows, tail = divmod(n, ROW)
    a = _column_keys(device)
    b = _row_keys(rows + 1, device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    with torch.no_grad():
        if rows:
            body = words[: rows * ROW].view(rows, ROW)
            scratch = torch.empty(min(rows, CHUNK_ROWS), ROW, dtype=torch.float64, device=device)
            for start in range(0, rows, CHUNK_ROWS):
                stop = min(start + CHUNK_ROWS, rows)
                chunk = scratch[: stop - start]
                chunk.copy_(body[start:stop])
                sums = torch.mv(chunk, a).to(torch.int64)  # exact: |sum| < 2**45
                total += (sums * b[start:stop]).sum()
        if tail:
            last = words[rows * ROW :].to(torch.float64)
            total += (last @ a[:tail]).to(torch.int64) * b[rows]
    return total


def label(tensor: torch.Tensor) -> str:
    """``dtype[shape]``: what a digest is of (a precision difference is not different weights)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{','.join(str(int(s)) for s in tensor.shape)}]"


#: A digest still on its device: (name, ``label``, int64 scalar from :func:`digest_value`).
Pending = tuple[str, str, torch.Tensor]


def pending(named: Iterable[tuple[str, torch.Tensor]]) -> list[Pending]:
    """Start the digest of each named tensor on its device (nothing leaves the device yet)."""
    return [(name, label(tensor), digest_value(tensor)) for name, tensor in named]


def landed(items: Iterable[Pending]) -> dict[str, str]:
    """``name -> "dtype[shape]:hex"`` of pending digests, one device-to-host transfer per device."""
    items = list(items)
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, _, value) in enumerate(items):
        by_device.setdefault(value.device, []).append(i)
    host: dict[int, int] = {}
    for indices in by_device.values():
        values = torch.stack([items[i][2] for i in indices]).cpu().numpy()
        host.update({i: int(v) for i, v in zip(indices, values.tolist(), strict=True)})
    return {name: f"{what}:{host[i] & 0xFFFFFFFFFFFFFFFF:016x}" for i, (name, what, _) in enumerate(items)}


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Digest of each named tensor (computed on its device, one transfer per device at the end)."""
    return landed(pending(named))


#: Wrapper prefixes that are not part of a checkpoint name (DDP, torch.compile, FSDP1).
_WRAPPERS = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes, as the checkpoint (and the engine) names it."""
    parts = [p for p in name.split(".") if p + "." not in _WRAPPERS]
    return ".".join(parts)


def module_digests(model: torch.nn.Module) -> dict[str, str]:
    """What a trainer holds: a digest per parameter, by checkpoint name (tied parameters once)."""
    named = [(checkpoint_name(n), p) for n, p in model.named_parameters() if p.numel()]
    return tensor_digests(named)
