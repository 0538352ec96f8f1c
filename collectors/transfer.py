"""One device-to-host copy per step for everything a collector keeps.

Each ``.cpu()`` of a CUDA tensor is a synchronisation and a small transfer; a step with every region
fingerprinted has hundreds of small tensors. Packing them as bytes into one buffer makes that one
copy, then numpy views split it back on the host without further copies.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int16: np.int16,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Numpy copies of ``tensors`` (same shapes and dtypes), with one transfer per source device."""
    out: dict[str, np.ndarray] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if tensor.dtype not in _NUMPY:
            raise TypeError(
                f"tensors[{name!r}]: dtype {tensor.dtype} cannot travel (expected one of {list(_NUMPY)})"
            )
        by_device.setdefault(tensor.device, []).append((name, tensor.detach()))
    for device, items in by_device.items():
        if device.type == "cpu":
            for name, tensor in items:
                out[name] = tensor.contiguous().numpy().copy()
            continue
        parts = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in items]
        host = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, np.uint8)
        offset = 0
        for (name, tensor), part in zip(items, parts, strict=True):
            size = part.numel()
            out[name] = host[offset : offset + size].view(_NUMPY[tensor.dtype]).reshape(tuple(tensor.shape))
            offset += size
    return out
