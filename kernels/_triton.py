"""Optional Triton import and the rule that picks a backend.

The package must import where Triton is missing (CPU-only CI without the `test` extra): every
kernel module defines its Triton kernel only when ``HAVE_TRITON`` is true, and the exact torch
reference serves otherwise.
"""

from __future__ import annotations

import inspect
import os
import warnings

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl
    from triton.runtime import _allocation

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install on an odd platform
    triton = None
    tl = None
    _allocation = None
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


# Where Triton's compiled launcher takes its arguments: the layout of ``CudaLauncher.launch``'s
# positional arguments differs between Triton releases, so the direct launch below knows the
# releases it was written against (read from their driver.py) and leaves every other one to
# ``CudaLauncher.__call__``. Keyed by "major.minor": the parameters of ``CudaLauncher.__call__``
# that release has, a second check that the installed launcher is the one the layout was read from.
_LAYOUTS = {
    "3.6": ("self", "gridX", "gridY", "gridZ", "stream", "function", "args"),
    "3.9": (
        "self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
        "launch_enter_hook", "launch_exit_hook", "args",
    ),
}  # fmt: skip

_LAUNCHER_FIELDS = (
    "launch",
    "num_ctas",
    "global_scratch_size",
    "global_scratch_align",
    "profile_scratch_size",
    "launch_cooperative_grid",
    "launch_pdl",
)


def launch_layout(run, version: str | None = None) -> str | None:
    """The release whose argument layout ``run`` (a compiled kernel's ``CudaLauncher``) takes, or
    None where the direct launch must not be used: another release or launcher class, a profile
    scratch (Triton's profiler allocates it), the address sanitizer, or a missing field."""
    release = ".".join((version or triton.__version__).split(".")[:2])
    params = _LAYOUTS.get(release)
    cls = type(run)
    if params is None or cls.__name__ != "CudaLauncher":
        return None
    if any(not hasattr(run, f) for f in _LAUNCHER_FIELDS) or getattr(run, "gsan_enabled", False):
        return None
    if run.profile_scratch_size:
        return None
    if params[6:7] == ("kernel_metadata",) and not (
        hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature")
    ):
        return None
    try:
        if tuple(inspect.signature(cls.__call__).parameters) != params:
            return None
    except (TypeError, ValueError):
        return None
    return release


# (device, stream) -> (raw pointer, bytes, buffer): the scratch eager launches on one stream share
_SCRATCH: dict[tuple[int, int | None], tuple[int, int, torch.Tensor]] = {}


def _shared_scratch(size: int, device: int, stream: int | None) -> tuple[int, int, torch.Tensor]:
    key = (device, stream)
    hit = _SCRATCH.get(key)
    if hit is None or hit[1] < size:
        buf = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
        hit = _SCRATCH[key] = (buf.data_ptr(), buf.numel(), buf)
    return hit


def scratch_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for Triton launches (the kernel-built TMA descriptors live there); the
    allocator :mod:`isoaudit.kernels.gemm` hands ``triton.set_allocator``.

    Eager launches on one stream run in order, so they share one buffer per (device, stream)
    (an allocation per call costs ~3 us of host time); a launch being captured into a CUDA graph
    gets its own, since the graph may later replay beside eager work on that stream. (PyTorch's
    blocks are 512-byte aligned, above any alignment Triton asks for.)"""
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    return _shared_scratch(size, torch._C._cuda_getDevice(), stream)[2]


def _global_scratch(size: int, alignment: int, device: int, stream: int):
    """What the direct launch passes as global scratch: the allocator Triton would call, except
    that ours is inlined and hands the raw pointer of the shared buffer (an int skips the
    launcher's ``data_ptr`` call and its ``cuPointerGetAttribute`` check)."""
    alloc = _allocation._allocator.get()
    if alloc is not scratch_allocator:
        return alloc(size, alignment, stream)  # the process's own allocator, or Triton's error
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")  # alive until the launch returns
    return _shared_scratch(size, device, stream)[0]


def _direct_launch(run, function, packed, tail: tuple, layout: str, launch=None):
    """A call ``(grid, args)`` into the compiled launcher's C ``launch`` itself, skipping
    ``CudaLauncher.__call__`` (its closures and allocator calls cost ~1.5 us of host time a call).
    Global scratch comes from ``_global_scratch``; the profile scratch is None (``launch_layout``
    refuses launchers that have one); launch hooks are None, as on every cached call. ``launch``:
    the C launch under Triton's host-descriptor wrapper (see :func:`_raw_launch`)."""
    launch = launch or run.launch
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    per_program = run.num_ctas * run.global_scratch_size
    align = run.global_scratch_align
    get_device, get_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream

    def stream_and_scratch(gx: int, gy: int, gz: int):
        dev = get_device()
        stream = get_stream(dev)
        return stream, (
            _global_scratch(gx * gy * gz * per_program, align, dev, stream) if per_program else None
        )

    if layout == "3.6":
        # launch(grid, stream, fn, coop, pdl, scratch, profile scratch, meta, launch meta, hooks, *args)
        def call(grid, args):
            gx, gy, gz = grid
            stream, scratch = stream_and_scratch(gx, gy, gz)
            launch(
                gx, gy, gz, stream, function, coop, pdl, scratch, None, packed, None, None, None, *args, *tail
            )

    else:
        # 3.9: launch(grid, stream, fn, coop, pdl, meta, launch meta, hooks, scratch, profile scratch,
        # argument annotations, signature, args)
        annotations, signature = run.arg_annotations, run.kernel_signature

        def call(grid, args):
            gx, gy, gz = grid
            stream, scratch = stream_and_scratch(gx, gy, gz)
            launch(
                gx, gy, gz, stream, function, coop, pdl, packed, None, None, None, scratch, None,
                annotations, signature, (*args, *tail),
            )  # fmt: skip

    # which path an entry takes (tests, bench), as attributes on the closure: the call stays cheap
    call.direct, call.run, call.tma_meta = True, run, None  # type: ignore[attr-defined]  # see above
    return call


def _run_launch(run, function, packed, tail: tuple):
    """A call ``(grid, args)`` through ``CudaLauncher.__call__`` (any Triton release)."""

    def call(grid, args):
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        run(*grid, stream, function, packed, None, None, None, *args, *tail)

    call.direct, call.run, call.tma_meta = False, run, None  # type: ignore[attr-defined]  # as above
    return call


def _raw_launch(run):
    """The C ``launch`` that Triton 3.6 wraps for kernels taking host-built tensor descriptors (the
    wrapper encodes every descriptor on every call), or None where it cannot be found."""
    for cell in getattr(run.launch, "__closure__", None) or ():
        fn = cell.cell_contents
        if type(fn).__name__ == "builtin_function_or_method" and fn.__name__ == "launch":
            return fn
    return None


def host_descriptors() -> bool:
    """Whether Hopper GEMMs captured into CUDA graphs load through host-built TMA descriptors:
    where the cached launch can hand them encoded (Triton 3.6's launcher) unless
    ``ISOAUDIT_GEMM_HOST_TMA=0``. Launch shape only: the same loads, the same bits
    (``test_kernel_built_descriptors_same_bits_gpu``)."""
    return (
        HAVE_TRITON
        and triton.__version__.startswith("3.6.")
        and os.environ.get("ISOAUDIT_GEMM_HOST_TMA", "1") == "1"
    )


_TMA_MAPS: dict[tuple, object] = {}
_TMA_MAPS_MAX = 4096


def tma_map(ptr: int, rows: int, cols: int, row_stride: int, meta: dict) -> object:
    """A host-encoded TMA descriptor (``CUtensorMap``) of a row-major 2-D operand for a kernel
    compiled with host descriptors (``meta``: that kernel's ``tensordesc_meta`` entry), cached by
    everything it encodes: a weight's descriptor is encoded once, and an activation buffer the
    allocator hands out again (or a CUDA-graph's static one) reuses its own."""
    key = (
        ptr,
        rows,
        cols,
        row_stride,
        meta["swizzle"],
        meta["elem_size"],
        meta["elem_type"],
        *meta["block_size"],
    )
    hit = _TMA_MAPS.get(key)
    if hit is None:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

        if len(_TMA_MAPS) >= _TMA_MAPS_MAX:
            _TMA_MAPS.clear()
        hit = _TMA_MAPS[key] = triton.runtime.driver.active.utils.fill_tma_descriptor(
            ptr,
            meta["swizzle"],
            meta["elem_size"],
            TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
            meta["block_size"],
            [rows, cols],
            [row_stride, 1],
            0,
        )
    return hit


class CachedLauncher:
    """Launch a compiled kernel without Triton's per-call Python work.

    ``kernel[grid](...)`` binds every argument, recomputes the specialisation key and looks the
    compiled kernel up on every call (~30-40 us of host time on the H200's host). A call site that
    knows what its kernel specialises on (argument dtypes, which integers are 1 or multiples of 16,
    which pointers are 16-byte aligned) passes that as ``key``: the first call with a key launches
    through Triton and keeps the compiled kernel and the constexpr tail; later calls hand the
    runtime arguments straight to the compiled kernel's C launcher (``_direct_launch``, for the
    Triton releases whose layout it knows; else through ``CudaLauncher.__call__``). Same compiled
    code, same bits.

    The key must determine Triton's specialisation of the runtime arguments, or a call could run
    code compiled for another alignment. Under the interpreter (or where Triton returns no
    compiled kernel) every call takes the ordinary path. Launch hooks (profilers) see only the
    first call of a key. A cached launch that raises warns once and turns the cache off for every
    launcher (Triton's own launch from then on).
    """

    enabled = True  # False: every call through Triton's own launch (the bench's "before")
    direct = True  # False: cached calls through CudaLauncher.__call__, not the C launch (bench, tests)

    def __init__(self, kernel: _LazyKernel, max_entries: int = 4096) -> None:
        self.kernel = kernel
        self.max_entries = max_entries
        self._cache: dict = {}

    def entry(self, key):
        """The cached call ``(grid, args)`` of ``key``, or None. Its ``tma_meta`` is None, or (a
        kernel taking host descriptors) each descriptor's ``tensordesc_meta``: the call then takes
        each descriptor expanded as Triton's launcher does, ``(tma_map(...), *shape, *strides)``."""
        return self._cache.get(key) if self.enabled else None

    def launch_cached(self, key, grid: tuple[int, ...], args: tuple) -> bool:
        """Launch from the cache entry of ``key`` if there is one; False (nothing launched) if not.

        For a call site that passes raw pointers (``data_ptr()`` ints) here and the tensors to
        ``__call__`` on a miss: the launcher takes either, and an int skips its ``data_ptr`` call
        and ``cuPointerGetAttribute`` check (so the call site must check the tensors are CUDA)."""
        hit = self._cache.get(key) if self.enabled else None
        if hit is None:
            return False
        try:
            hit(grid, args)
        except (TypeError, ValueError, RuntimeError) as exc:  # a launcher of another Triton version
            warnings.warn(
                f"isoaudit.kernels: cached launch failed ({exc!r:.200}); using Triton's", stacklevel=3
            )
            CachedLauncher.enabled = False
            return False
        return True

    def __call__(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict, **options) -> None:
        hit = self.entry(key)  # (an entry taking encoded host descriptors is the call site's to use)
        if hit is not None and hit.tma_meta is None and self.launch_cached(key, grid, args):
            return
        compiled = self.kernel[grid](*args, **constexprs, **options)
        if interpreting() or not hasattr(compiled, "packed_metadata") or len(grid) != 3:
            return
        jit_fn = self.kernel.built()
        names = jit_fn.arg_names[len(args) :]
        if set(names) != set(constexprs):
            return  # defaults in the signature: keep the ordinary path
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        run, tail = compiled.run, tuple(constexprs[n] for n in names)
        layout = launch_layout(run) if self.direct else None
        metas = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
        if metas:  # host descriptors: cached only where the call site can hand them encoded
            raw = _raw_launch(run) if layout == "3.6" else None
            if raw is None:
                return
            call = _direct_launch(run, compiled.function, compiled.packed_metadata, tail, "3.6", raw)
            call.tma_meta = tuple(metas)
        elif layout is not None:
            call = _direct_launch(run, compiled.function, compiled.packed_metadata, tail, layout)
        else:
            call = _run_launch(run, compiled.function, compiled.packed_metadata, tail)
        self._cache[key] = call


def as_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x.reshape(-1, k)``, without the call (~0.6 us) where it would return x's own view: x 2-D
    with rows of k, each dim of size > 1 or already carrying the stride ``reshape`` would give it
    (``reshape`` rewrites the stride of a size-1 dim, and Triton specialises on strides)."""
    if x.dim() == 2 and k > 0:  # (reshape refuses k == 0: keep its error)
        m, kx = x.shape
        if kx == k:
            s0, s1 = x.stride()
            if (m != 1 or s0 == k * s1) and (k != 1 or s1 == 1):
                return x
    return x.reshape(-1, k)


def tma_ready(ptr: int, strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether TMA can read a 2-D operand as it lies: unit inner stride, 16-byte aligned base and
    rows."""
    return strides[1] == 1 and (strides[0] * itemsize) % 16 == 0 and ptr % 16 == 0


def aligned(*tensors: torch.Tensor) -> int:
    """Bit i set when tensor i's data is 16-byte aligned (what Triton specialises pointers on)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits
