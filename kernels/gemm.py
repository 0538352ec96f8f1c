"""Batch-invariant GEMM: ``y = x @ w.T (+ bias)`` whose every row is independent of the batch.

Why it is invariant: the tile shape (BLOCK_M, BLOCK_N, BLOCK_K), warps, pipeline depth and the
load path (TMA descriptors or pointers) are a function of the weight shape, dtype and device
capability only, never of M; each output element is accumulated in fp32 over K in ascending BLOCK_K
steps. Weights the active split policy names (:class:`~isoaudit.kernels.gemm_policy.SplitPolicy`:
narrow weights on the H200, by (N, K) alone) take a fixed split-K: K is cut into spans set by the
weight shape and the span sums are added in one order, whether one program sums them in turn or,
at small M, the spans run as programs and a tile's last one, found by an atomic count, adds them;
the policy is stated in each side's manifest. So a row's bits
do not depend on how many other rows are in the batch or where it sits (M and the program count
are also excluded from Triton's integer specialisation, so M=1 compiles to the same code as M=2048).

On Hopper (capability >= 9.0) bf16/fp16 weights take a persistent kernel: one program per SM
walks the output tiles in a fixed grouped order, loading through TMA descriptors. The grid size
depends on M, but that only changes which program computes a tile, not the tile's sums. On the
H200 (9.0) only, a small-M call narrows its tile to fill the SMs: BLOCK_K, the K order and the
instruction stay fixed, so the bits do too. Which tile, grid and load path a call takes is the
pure policy of :mod:`isoaudit.kernels.gemm_policy`; this module holds the kernel, its torch
reference and the launch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import replace
from functools import cache, lru_cache
from typing import Any

import torch

from ._triton import (
    HAVE_TRITON,
    CachedLauncher,
    as_rows,
    dot_precision,
    host_descriptors,
    interpreting,
    jit,
    resolve,
    scratch_allocator,
    tl,
    tma_map,
    tma_ready,
    triton,
)
from .gemm_policy import GemmConfig, gemm_config, on_split_change, plan_tiles

if HAVE_TRITON:
    from triton.runtime import _allocation
    from triton.tools.tensor_descriptor import TensorDescriptor


if HAVE_TRITON:

    @triton.jit
    def _span_sum(
        a, b, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, pid_m, pid_n, k_lo, k_hi,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TMA: tl.constexpr,
        A_PTR: tl.constexpr,
        SPAN: tl.constexpr = 0,
    ):  # fmt: skip
        """One tile's fp32 sum over K in [k_lo, k_hi), from zero, in ascending BLOCK_K steps.
        SPAN > 0 (one loop for a whole split K): the sum restarts from zero at every SPAN
        boundary and each span's sum is added, in order, to a running total (0 + p0 + p1 + ...),
        which is returned."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPAN > 0:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if TMA:
                if A_PTR:
                    x = tl.load(
                        a + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                        mask=(offs_m[:, None] < M) & ((k0 + offs_k) < K)[None, :],
                        other=0.0,
                    )
                else:
                    x = a.load([pid_m * BLOCK_M, k0])
                w = b.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
            else:
                k_ok = (k0 + offs_k) < K
                x = tl.load(
                    a + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & k_ok[None, :],
                    other=0.0,
                )
                w = tl.load(
                    b + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=k_ok[:, None] & (offs_n[None, :] < N),
                    other=0.0,
                )
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            if SPAN > 0:
                if ((k0 + BLOCK_K) % SPAN == 0) | (k0 + BLOCK_K >= k_hi):
                    total = total + acc
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPAN > 0:
            return total
        return acc

    @triton.jit
    def _store_tile(
        c, acc, bias_ptr, M, N, stride_cm, stride_cn, pid_m, pid_n,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TMA: tl.constexpr,
        A_PTR: tl.constexpr,
        SPLIT_EPILOGUE: tl.constexpr,
    ):  # fmt: skip
        """Bias in fp32, one rounding, the store (TMA descriptor or masked pointers)."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        if TMA and not A_PTR:
            if SPLIT_EPILOGUE:
                lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                c.store([pid_m * BLOCK_M, pid_n * BLOCK_N], lo.to(c.dtype))
                c.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], hi.to(c.dtype))
            else:
                c.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c.dtype))
        else:
            tl.store(
                c + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                acc.to(c.dtype.element_ty),
                mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
            )

    @jit(do_not_specialize=["M", "num_programs"])
    def _gemm_kernel(
        a,
        b,
        c,
        bias_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bn,
        stride_bk,
        stride_cm,
        stride_cn,
        num_programs,
        partials,
        counters,
        HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        TMA: tl.constexpr,
        SPLIT_EPILOGUE: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
        DEVICE_DESC: tl.constexpr,
        A_PTR: tl.constexpr,
        K_SPLIT: tl.constexpr,
        SPLIT_GRID: tl.constexpr,
    ):
        # With TMA, a/b/c are tensor descriptors (out-of-bounds reads are zeros, writes dropped),
        # passed in or (DEVICE_DESC) built here from pointers; otherwise they are pointers with
        # explicit masks. A_PTR (TMA, fewer rows than one tile): a and c stay pointers, since a
        # descriptor box mostly past M measured twice as slow; the weight still streams by TMA.
        # Same tile walk, K order and instruction either way.
        # K_SPLIT > 0: K in spans of K_SPLIT, each summed from zero, the span sums added in order.
        # SPLIT_GRID (few tiles): span s is program (tile, s) on axis 1; it writes its fp32 sum to
        # ``partials`` and the tile's last program to finish (an atomic count per tile) adds all
        # spans in ascending order, whichever program ran them: the same adds as one program
        # summing the spans in turn (SPLIT_GRID False), so M never changes a bit.
        if TMA:
            if DEVICE_DESC:
                C_BLOCK_N: tl.constexpr = BLOCK_N // 2 if SPLIT_EPILOGUE else BLOCK_N
                if not A_PTR:
                    a = tl.make_tensor_descriptor(a, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
                    c = tl.make_tensor_descriptor(c, [M, N], [stride_cm, 1], [BLOCK_M, C_BLOCK_N])
                b = tl.make_tensor_descriptor(b, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        for tile in tl.range(
            tl.program_id(0),
            num_m * num_n,
            num_programs,
            # unflattened with a split: the split grid's body (an atomic, a branch, a loop) fails
            # Triton 3.6's nested-loop fusion, and the spans' loop measured faster unflattened
            flatten=TMA and K_SPLIT == 0,
            warp_specialize=WARP_SPECIALIZE,
        ):
            # Grouped order for L2 reuse; it changes which program runs a tile, not its sums.
            first_m = (tile // group) * GROUP_M
            size_m = tl.minimum(num_m - first_m, GROUP_M)
            pid_m = first_m + ((tile % group) % size_m)
            pid_n = (tile % group) // size_m
            if not SPLIT_GRID:
                # The whole K in one loop; with K_SPLIT it restarts its sum at every span
                # boundary and adds the span sums in order (0 + p0 + p1 + ...: the grid's adds).
                # (A loop over (tile, span) pairs, and the tile walk flattened into this one,
                # measured slower on the H200; flattened, ptxas serializes the wgmma chain.)
                acc = _span_sum(
                    a, b, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, pid_m, pid_n, 0, K,
                    PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, TMA, A_PTR, K_SPLIT,
                )  # fmt: skip
                _store_tile(
                    c, acc, bias_ptr, M, N, stride_cm, stride_cn, pid_m, pid_n,
                    HAS_BIAS, BLOCK_M, BLOCK_N, TMA, A_PTR, SPLIT_EPILOGUE,
                )  # fmt: skip
            else:
                # The split grid: fp32 span sums, one BLOCK_M x BLOCK_N slab per (span, tile);
                # counters[tile] counts the spans stored; the last adds them in span order
                # (0 + p0 + p1 + ...) and sets the count back to zero.
                span = tl.program_id(1)
                acc = _span_sum(
                    a, b, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, pid_m, pid_n,
                    span * K_SPLIT, tl.minimum(span * K_SPLIT + K_SPLIT, K),
                    PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, TMA, A_PTR,
                )  # fmt: skip
                spans = tl.cdiv(K, K_SPLIT)
                tiles = num_m * num_n
                slab = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                tl.store(partials + (span * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + slab, acc)
                tl.debug_barrier()
                done = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
                if done == spans - 1:
                    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for s2 in range(0, spans):
                        total = total + tl.load(
                            partials + (s2 * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + slab,
                            cache_modifier=".cg",
                        )
                    tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")
                    _store_tile(
                        c, total, bias_ptr, M, N, stride_cm, stride_cn, pid_m, pid_n,
                        HAS_BIAS, BLOCK_M, BLOCK_N, TMA, A_PTR, SPLIT_EPILOGUE,
                    )  # fmt: skip

    _LAUNCH = CachedLauncher(_gemm_kernel)


#: The reference GEMM's row block (see :func:`gemm_reference`): a multiple of the row blocks CPU
#: BLAS kernels use (4, 8, 16).
REFERENCE_ROWS = 16


def gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_k: int | None = None,
    k_split: int = 0,
) -> torch.Tensor:
    """The arithmetic the kernel defines: fp32 products, fp32 partial sums per BLOCK_K slab, the
    slabs added in ascending k (within each ``k_split`` span, from zero, the span sums then added
    in ascending order), bias added in fp32, one rounding to ``out_dtype`` at the end.
    (Inside one slab the hardware's dot order applies, so kernel and reference agree to rounding.)"""
    n, k = weight.shape
    bk = block_k or gemm_config(n, k, weight.dtype).block_k
    rows = math.prod(x.shape[:-1])
    xf = x.reshape(rows, k).float()  # not (-1, k): K may be 0 (an empty leaf)
    # Rows padded with zeros to a multiple of REFERENCE_ROWS: a BLAS sums a row's products in an
    # order of its own for the rows past its last full block of rows (seen on an AMD EPYC: rows 1,
    # 2, 7, 9 of a call differed from the same rows inside 8, 20 or 40), so every real row is
    # computed inside a full block, whatever the call's row count.
    xf = torch.nn.functional.pad(xf, (0, 0, 0, -rows % REFERENCE_ROWS))
    wf = weight.float()
    acc = torch.zeros(xf.shape[0], n, dtype=torch.float32, device=x.device)
    span = k_split or max(k, 1)
    for s0 in range(0, k, span):
        part = torch.zeros_like(acc)
        for k0 in range(s0, min(s0 + span, k), bk):
            hi = min(k0 + bk, s0 + span)
            part = part + xf[:, k0:hi] @ wf[:, k0:hi].T
        acc = acc + part
    acc = acc[:rows]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype or x.dtype).reshape(*x.shape[:-1], n)


@cache
def _device_traits(device: torch.device) -> tuple[tuple[int, int] | None, int]:
    """(capability, persistent program count) of a device; the interpreter gets (None, 2) so its
    tests still see programs that walk more than one tile."""
    if device.type != "cuda":
        return None, 2
    return torch.cuda.get_device_capability(device), torch.cuda.get_device_properties(
        device
    ).multi_processor_count


def _tma_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if TMA can read it (unit inner stride, 16-byte aligned base and rows), else a
    contiguous copy: the same values, so the same kernel and the same bits."""
    if tma_ready(t.data_ptr(), t.stride(), t.element_size()):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


# Global scratch Triton asks for at launch (the kernel-built TMA descriptors live there): one
# buffer per (device, stream) for eager launches, a fresh one under CUDA graph capture. The rule
# lives in ``_triton`` because the cached launcher applies it itself (see ``_global_scratch``).
_scratch = scratch_allocator


_SPLIT: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(sizes: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 span sums, int32 per-tile counters) for a split-grid launch. The counters start at
    zero and each tile's last program sets its count back to zero, so eager launches on one stream
    (which run in order) share one pair per (device, stream); a launch being captured into a CUDA
    graph gets its own pair (the zeroing is part of the graph)."""
    n_partial, n_tiles = sizes
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(n_partial, dtype=torch.float32, device=device), torch.zeros(
            n_tiles, dtype=torch.int32, device=device
        )
    dev = torch._C._cuda_getDevice()
    key = (dev, torch._C._cuda_getCurrentRawStream(dev))
    hit = _SPLIT.get(key)
    if hit is None or hit[0].numel() < n_partial or hit[1].numel() < n_tiles:
        hit = _SPLIT[key] = (
            torch.empty(max(n_partial, 1 << 16), dtype=torch.float32, device=device),
            torch.zeros(max(n_tiles, 1 << 12), dtype=torch.int32, device=device),
        )
    return hit


def _ensure_allocator() -> None:
    """Give Triton a scratch allocator unless the process (e.g. the engine) already set one. The
    setting is a context variable, so each thread that launches checks for itself."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def _descriptor(t: torch.Tensor, block: list[int]) -> Any:
    """A host-built TMA descriptor over all of ``t`` (Triton's ``TensorDescriptor``)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


_host_tma = host_descriptors()


class _GemmPlan(tuple):
    """(config, grid, constexprs, options, split scratch sizes or None), hashed by identity: the
    launch key holds the plan itself (one object per shape, kept alive by the key), so hashing it
    costs nothing per call."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __new__(cls, *fields: Any) -> _GemmPlan:
        return super().__new__(cls, fields)


@lru_cache(maxsize=8192)
def _plan(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    has_bias: bool,
    device: torch.device,
    config: GemmConfig | None,
    captured: bool = False,
) -> _GemmPlan:
    """Everything about one call that its shapes fix: the tile, the program count, the constexprs
    and launch options (computed once per shape, not per call). ``captured``: the call is being
    captured into a CUDA graph, where a TMA tile takes host-built descriptors (see :func:`gemm`)."""
    capability, sms = _device_traits(device)
    base = config or gemm_config(n, k, dtype, capability)
    if captured and base.tma and base.device_descriptors:
        base = replace(base, device_descriptors=False)
    tp = plan_tiles(base, m, n, k, sms, out_dtype.itemsize, interpreting())
    cfg = tp.config
    constexprs = dict(
        HAS_BIAS=has_bias,
        PRECISION=dot_precision(dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=8,
        TMA=cfg.tma,
        SPLIT_EPILOGUE=tp.split_epilogue,
        WARP_SPECIALIZE=cfg.warp_specialize,
        DEVICE_DESC=cfg.device_descriptors,
        A_PTR=tp.a_pointers,
        K_SPLIT=tp.k_split,
        SPLIT_GRID=tp.split_grid,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _GemmPlan(cfg, tp.grid, constexprs, options, tp.scratch)


on_split_change(_plan.cache_clear)  # plans of the weight's own config follow the split policy


class _Route(enum.Enum):
    """How a call reaches the kernel. Every route binds the same kernel arguments (the operands in
    the form the route hands over) and so runs the same compiled code with the same bits."""

    #: CUDA, kernel-built descriptors or pointer loads: a cache hit takes raw pointers (the route is
    #: only chosen once every tensor is known to be a CUDA one: an int skips the launcher's check).
    DIRECT = "direct"
    #: CUDA, host-built TMA descriptors (a call under CUDA-graph capture): a cache hit takes each
    #: descriptor encoded once per buffer (:func:`~isoaudit.kernels._triton.tma_map`) and expanded
    #: as Triton's launcher expands it, ``(descriptor, rows, cols, row stride, 1)``; a host-built
    #: descriptor is a kernel parameter, where a kernel-built one costs each program time before
    #: its first load.
    HOST_DESCRIPTORS = "host_descriptors"
    #: A tensor off CUDA: the interpreter's structure tests, or Triton's own error for a misplaced
    #: tensor. Only Triton's launch; host-built descriptors go uncached.
    GENERIC = "generic"


def _route(cfg: GemmConfig, weight: torch.Tensor, bias: torch.Tensor | None) -> _Route:
    """The route of a call with the launched tile ``cfg`` (``a`` and the output share x's device)."""
    if not (weight.is_cuda and (bias is None or bias.is_cuda)):
        return _Route.GENERIC
    return _Route.HOST_DESCRIPTORS if cfg.tma and not cfg.device_descriptors else _Route.DIRECT


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias`` for x of shape (..., K) and weight (N, K).
    ``config`` overrides the tile choice (for tuning; both sides must use the same one)."""
    if resolve(impl, x) == "torch":
        return gemm_reference(x, weight, bias, out_dtype)
    n, k = weight.shape
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    a = as_rows(x, k)
    m = a.shape[0]
    odt = out_dtype or x.dtype
    dev = x.device
    out = torch.empty(m, n, dtype=odt, device=dev)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    # Under CUDA-graph capture a TMA tile takes host-built descriptors, whether the tile is the
    # weight's own or an explicit ``config`` (the tree's slot pairs): their host cost is paid once,
    # at capture, and each replay saves the time a program spends building its own before the first
    # load; eager calls keep the kernel-built ones. The same loads either way, so the same bits
    # (``test_host_descriptor_launch_gpu``).
    captured = weight.is_cuda and _host_tma and torch._C._cuda_isCurrentStreamCapturing()
    plan = _plan(m, n, k, weight.dtype, odt, bias is not None, dev, config, captured)
    _launch(a, weight, bias, out, plan, dev, m, n, k, _route(plan[0], weight, bias))
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def _launch(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: _GemmPlan,
    dev: torch.device,
    m: int,
    n: int,
    k: int,
    route: _Route,
) -> None:
    """Launch one planned call by ``route``: a cached launch where the route has one and the key
    is cached, else Triton's own launch (which, keyed, fills the cache). The host work is cut to
    what the launch needs: each pointer and stride read once."""
    cfg, grid, constexprs, options, scratch = plan
    host_desc = cfg.tma and not cfg.device_descriptors
    a_ptr = constexprs["A_PTR"]
    itemsize = weight.dtype.itemsize  # a has weight's dtype (gemm casts x)
    w, pw, sw = weight, weight.data_ptr(), weight.stride()
    pa, sa = a.data_ptr(), a.stride()
    if cfg.tma:
        if not tma_ready(pw, sw, itemsize):
            w = _tma_operand(weight)
            pw, sw = w.data_ptr(), w.stride()
        if not a_ptr and not tma_ready(pa, sa, itemsize):
            a = _tma_operand(a)
            pa, sa = a.data_ptr(), a.stride()
        if not host_desc:
            _ensure_allocator()
    bias_arg, pb = (bias, bias.data_ptr()) if bias is not None else (w, pw)
    po = out.data_ptr()
    if scratch:
        partials, counters = _split_scratch(scratch, dev)
        pp, pc = partials.data_ptr(), counters.data_ptr()
    else:
        partials, counters, pp, pc = out, out, po, po
    so = (max(n, 1), 1)  # out.stride(): torch.empty(m, n) is row-major (a stride is never 0)
    # What Triton specialises the runtime arguments on: the plan fixes n, k, the dtypes and the
    # output; the strides of a and w and the pointers' 16-byte alignment (bit i: a, w, bias)
    # complete it (m and the program count are not specialised).
    key = (plan, *sa, *sw, (pa % 16 == 0) | (pw % 16 == 0) << 1 | (pb % 16 == 0) << 2)
    sizes = (m, n, k, *sa, *sw, *so, grid[0])
    if route is _Route.DIRECT:
        if _LAUNCH.launch_cached(key, grid, (pa, pw, po, pb, *sizes, pp, pc)):
            return
    elif route is _Route.HOST_DESCRIPTORS:
        entry = _LAUNCH.entry(key)
        if entry is not None and entry.tma_meta is not None:
            metas = entry.tma_meta
            wd = (tma_map(pw, n, k, sw[0], metas[0 if a_ptr else 1]), n, k, sw[0], 1)
            if a_ptr:
                head: tuple[Any, ...] = (pa, *wd, po)
            else:
                ad = (tma_map(pa, m, k, sa[0], metas[0]), m, k, sa[0], 1)
                head = (*ad, *wd, tma_map(po, m, n, n, metas[2]), m, n, n, 1)
            entry(grid, (*head, pb, *sizes, pp, pc))
            return
    if host_desc:  # Triton binds host descriptors itself, and keeps their metadata for the cache
        b_arg = _descriptor(w, [cfg.block_n, cfg.block_k])
        if a_ptr:
            a_arg, c_arg = a, out
        else:
            a_arg = _descriptor(a, [cfg.block_m, cfg.block_k])
            c_arg = _descriptor(out, [cfg.block_m, cfg.block_n // (2 if constexprs["SPLIT_EPILOGUE"] else 1)])
        abc: tuple[Any, ...] = (a_arg, b_arg, c_arg)
    else:
        abc = (a, w, out)
    args = (*abc, bias_arg, *sizes, partials, counters)
    if route is _Route.GENERIC and host_desc:
        _gemm_kernel[grid](*args, **constexprs, **options)
    else:
        _LAUNCH(key, grid, args, constexprs, **options)


class _Linear(torch.autograd.Function):
    """Forward through the invariant GEMM; backward through torch (the gradient's bits are not the
    contract, the forward's are)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return gemm(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2.to(weight.dtype) @ weight).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g2.T.to(weight.dtype) @ x.reshape(-1, x.shape[-1]).to(weight.dtype)).to(weight.dtype)
        gb = g2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Autograd-aware batch-invariant linear layer (``F.linear`` semantics)."""
    return _Linear.apply(x, weight, bias, out_dtype)
