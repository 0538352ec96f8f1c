"""Optional Triton import and the rule that picks a backend.

The package must import where Triton is missing (CPU-only CI without the `test` extra): every
kernel module defines its Triton kernel only when ``HAVE_TRITON`` is true, and the exact torch
reference serves otherwise.
"""

from __future__ import annotations

import os
import warnings

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
        return self.built()[grid]

    def built(self):
        """The ``triton.jit`` function for the current mode (interpreter or compiler)."""
        mode = interpreting()
        k = self._built.get(mode)
        if k is None:
            k = self._built[mode] = triton.jit(**self.kwargs)(self.fn)
        return k


def jit(**kwargs):
    """Drop-in for ``triton.jit(...)`` with the interpreter choice made at first launch."""
    return lambda fn: _LazyKernel(fn, kwargs)


class CachedLauncher:
    """Launch a compiled kernel without Triton's per-call Python work.

    ``kernel[grid](...)`` binds every argument, recomputes the specialisation key and looks the
    compiled kernel up on every call (~30-40 us of host time on the H200's host). A call site that
    knows what its kernel specialises on (argument dtypes, which integers are 1 or multiples of 16,
    which pointers are 16-byte aligned) passes that as ``key``: the first call with a key launches
    through Triton and keeps the compiled kernel and the constexpr tail; later calls hand the
    runtime arguments straight to the compiled kernel's launcher. Same compiled code, same bits.

    The key must determine Triton's specialisation of the runtime arguments, or a call could run
    code compiled for another alignment. Under the interpreter (or where Triton returns no
    compiled kernel) every call takes the ordinary path. Launch hooks (profilers) see only the
    first call of a key.
    """

    enabled = True  # False: every call through Triton's own launch (the bench's "before")

    def __init__(self, kernel: _LazyKernel, max_entries: int = 4096) -> None:
        self.kernel = kernel
        self.max_entries = max_entries
        self._cache: dict = {}

    def __call__(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict, **options) -> None:
        hit = self._cache.get(key) if self.enabled else None
        if hit is not None:
            run, function, packed, tail = hit
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            try:
                run(*grid, stream, function, packed, None, None, None, *args, *tail)
                return
            except (TypeError, ValueError, RuntimeError) as exc:  # a launcher of another Triton version
                warnings.warn(f"kernels: cached launch failed ({exc!r:.200}); using Triton's", stacklevel=2)
                CachedLauncher.enabled = False
        compiled = self.kernel[grid](*args, **constexprs, **options)
        if interpreting() or not hasattr(compiled, "packed_metadata") or len(grid) != 3:
            return
        jit_fn = self.kernel.built()
        names = jit_fn.arg_names[len(args) :]
        if set(names) != set(constexprs):
            return  # defaults in the signature: keep the ordinary path
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[key] = (
            compiled.run,
            compiled.function,
            compiled.packed_metadata,
            tuple(constexprs[n] for n in names),
        )


def aligned(*tensors: torch.Tensor) -> int:
    """Bit i set when tensor i's data is 16-byte aligned (what Triton specialises pointers on)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits
