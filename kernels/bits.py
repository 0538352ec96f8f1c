"""Bitwise equality of tensors: the only comparison the invariance claims accept."""

from __future__ import annotations

import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (so NaN equals an identical NaN, and -0.0 differs from +0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(_bytes(a), _bytes(b)))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # A fresh row-major copy: ``contiguous()`` keeps odd strides of size-1 dims, which ``view`` refuses.
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).view(torch.uint8)
