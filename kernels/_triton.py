"""Optional Triton import and the rule that picks a backend.

The package must import where Triton is missing (CPU-only CI without the `test` extra): every
kernel module defines its Triton kernel only when ``HAVE_TRITON`` is true, and the exact torch
reference serves otherwise.
"""

from __future__ import annotations

import os

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install on an odd platform
    triton = None
    tl = None
    HAVE_TRITON = False


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on this tensor (CUDA, or the CPU under the interpreter)."""
    return HAVE_TRITON and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


def resolve(impl: str | None, t: torch.Tensor) -> str:
    """Pick ``"triton"`` or ``"torch"``; an explicit ``impl`` wins, else the best available."""
    if impl is None:
        return "triton" if use_triton(t) else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', not {impl!r}")
    if impl == "triton" and not use_triton(t):
        raise RuntimeError("the Triton kernel needs CUDA, or TRITON_INTERPRET=1 for CPU tensors")
    return impl


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a constexpr function: ~2 us a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, on the host (``triton.next_power_of_2`` costs ~2 us a call)."""
    return 1 << max(n - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands use exact fp32 products ("ieee"), never tf32: the bits must not depend on a flag."""
    return "ieee" if dtype == torch.float32 else "tf32"


class _LazyKernel:
    """A Triton kernel compiled (or interpreted) on first launch, not at import.

    ``triton.jit`` decides interpreter-or-compiler when it decorates; the launched kernels decide
    at their first launch instead. The ``@triton.jit`` helper functions they call are decorated at
    import, though, so TRITON_INTERPRET must be set before this package is imported.
    """

    def __init__(self, fn, kwargs: dict) -> None:
        self.fn, self.kwargs = fn, kwargs
        self._built: dict[bool, object] = {}

    def __getitem__(self, grid):
        mode = interpreting()
        k = self._built.get(mode)
        if k is None:
            k = self._built[mode] = triton.jit(**self.kwargs)(self.fn)
        return k[grid]


def jit(**kwargs):
    """Drop-in for ``triton.jit(...)`` with the interpreter choice made at first launch."""
    return lambda fn: _LazyKernel(fn, kwargs)
