"""Batch-invariant FP8 grouped GEMM for MoE experts: every expert's rows in one launch, each row
with the bits of the invariant W8A8 linear (:func:`isoaudit.kernels.fp8.fp8_linear`) on its own
expert's weight.

Rows arrive grouped by expert, as :mod:`isoaudit.kernels.moe_grouped` takes them: group g is rows
``offsets[g]:offsets[g+1]`` through expert ``experts[g]`` (the host table), or experts 0..E-1 in
order with their row counts in a device table (:func:`isoaudit.kernels.moe_grouped.sort_groups`, no
host read). The operands are those of :mod:`isoaudit.kernels.fp8`:

* each expert's E4M3 weight in 128x128 blocks with fp32 scales, the experts stacked into one
  (E, N, K) / (E, ceil(N/128), ceil(K/128)) pair (:func:`fp8_experts`: made from the (E, N, K)
  master once, re-made in place when the master's version or storage changes, never while a CUDA
  graph is being captured; a block never straddles two experts, so expert e's blocks are those
  ``fp8_weight(master[e])`` makes);
* the activation quantized once for all groups, per token per 128 of K (:func:`quantize_act`, or
  :func:`gather_quant` reading each sorted row from its token): a token's scales depend on that
  token alone, so quantizing the grouped rows gives every group the bits quantizing its rows alone
  would.

A program computes one (BLOCK_M rows of one group) x BLOCK_N tile: tiles never straddle groups
(rows past the group's end load as zeros and are not stored). Its arithmetic is the W8A8 kernel's
own Triton code, :func:`isoaudit.kernels.fp8._fp8_span`, called once per tile over the whole K with
the split span :func:`isoaudit.kernels.fp8.weight_split` gives the expert's (N, K): each 128-K block
an FP8 MMA from zero, promoted by ``a_scale[m] * w_scale[n // 128]`` in fp32 and added in
ascending K, the sum restarting at every span and the span sums added in order; one rounding to
the output dtype. ``fp8_linear`` runs the same adds (its split grid, for at most 128 rows, sums
each span in a program of its own and then the spans in order: the same adds), and the tile
(:func:`grouped_tile`, one of :data:`isoaudit.kernels.fp8.TILE_TABLE`'s) changes where an element
is computed, never its adds. So a row's bits are ``fp8_linear(its group's rows, W_e)``'s: they do
not depend on how many rows its expert or any other expert got.

On the CPU the torch reference (:func:`isoaudit.kernels.fp8.w8a8_reference` per group, exact block
sums) gives the bits ``fp8_linear`` gives there. Backward (:func:`fp8_grouped_linear`):
straight-through in the master dtype, per group, as :func:`isoaudit.kernels.fp8.fp8_linear`'s.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import fp8 as _fp8
from ._triton import (
    HAVE_TRITON,
    CachedLauncher,
    aligned,
    cdiv,
    interpreting,
    jit,
    next_power_of_2,
    resolve,
    tl,
)
from .fp8 import Fp8Tile, MasterCache, w8a8_reference, weight_split
from .fp8_quant import FP8, GROUP, _rows_per_program, quantize_act, quantize_act_reference, quantize_weight
from .gemm import _device_traits
from .moe_grouped import _Grouped, _tile_table, silu_mul, sort_groups

if HAVE_TRITON:
    from .fp8 import _fp8_span  # the W8A8 kernel's per-tile arithmetic
    from .fp8_quant import _quantize_rows  # the activation quantizer's arithmetic

    @jit(do_not_specialize=["n_groups"])
    def _fp8_grouped_kernel(
        a, a_s, b, b_s, c, table, idx, n_groups, N, K,
        stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPAN_BLOCKS: tl.constexpr,
        LAG: tl.constexpr,
        EVEN_K: tl.constexpr,
        DEVICE_TABLE: tl.constexpr,
        E_P2: tl.constexpr,
        SCATTER: tl.constexpr,
    ):  # fmt: skip
        # Program (t, pid_n): row tile t of the grouped rows, column tile pid_n. DEVICE_TABLE:
        # ``table`` is (3, E) int32 (inclusive cumsum of each expert's tiles, first row, end row;
        # groups are experts 0..E-1, n_groups = E) and the grid an upper bound on the tiles; else
        # ``table`` is (3, n_tiles) int32 (expert, first row, end row of the tile's group).
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        if DEVICE_TABLE:
            offs_e = tl.arange(0, E_P2)
            tile_cum = tl.load(table + offs_e, mask=offs_e < n_groups, other=2147483647)
            n_tiles = tl.load(table + n_groups - 1)
            # the expert whose tiles hold t (clamped: programs past the real tiles do nothing)
            e = tl.minimum(tl.sum((tile_cum <= t).to(tl.int32), axis=0), n_groups - 1)
            lo = tl.load(table + n_groups + e)
            r1 = tl.load(table + 2 * n_groups + e)
            first = tl.load(table + e) - (r1 - lo + BLOCK_M - 1) // BLOCK_M
            r0 = lo + (t - first) * BLOCK_M
        else:
            n_tiles = n_groups
            e = tl.load(table + t)
            r0 = tl.load(table + n_groups + t)
            r1 = tl.load(table + 2 * n_groups + t)
        if t < n_tiles:
            r0_64 = r0.to(tl.int64)
            e_64 = e.to(tl.int64)
            # The tile's rows are rows [0, r1 - r0) of the group's slab from r0: pid_m 0 of an
            # (r1 - r0)-row operand, the expert's weight and scales as the (N, K) operand; the
            # activation pre-quantized (FUSED_QUANT off, every one of the tile's rows read).
            acc = _fp8_span(
                a + r0_64 * stride_am, a_s + r0_64 * stride_asm, b + e_64 * stride_be, b_s + e_64 * stride_bse,
                r1 - r0, N, K, stride_am, stride_asm, stride_bn, stride_bsn, 0, pid_n, 0, tl.cdiv(K, BLOCK_K),
                BLOCK_M, BLOCK_N, BLOCK_K, SPAN_BLOCKS, LAG, EVEN_K, False, False, BLOCK_M,
            )  # fmt: skip
            offs_m = tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = offs_m < r1 - r0
            if SCATTER:  # sorted row r goes to c[idx[r]] (back to routing order)
                dst = tl.load(idx + r0_64 + offs_m, mask=rows, other=0).to(tl.int64)
            else:
                dst = r0_64 + offs_m
            tl.store(
                c + dst[:, None] * stride_cm + offs_n[None, :],
                acc.to(c.dtype.element_ty),
                mask=rows[:, None] & (offs_n[None, :] < N),
            )

    _LAUNCH = CachedLauncher(_fp8_grouped_kernel)

    @jit(do_not_specialize=["S"])
    def _gather_quant_kernel(
        x, idx, q, s, S, K, stride_xm, stride_sm,
        TOPK: tl.constexpr,
        GROUP_K: tl.constexpr,
        ROWS: tl.constexpr,
        OUT_FP8: tl.constexpr,
    ):  # fmt: skip
        # Program (i, j): sorted rows [i*ROWS, i*ROWS + ROWS), group j; row r is token idx[r] // TOPK
        # of x, quantized by the quantizer's own arithmetic (each row's group reduced on its own).
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * GROUP_K + tl.arange(0, GROUP_K)
        r_ok = rows < S
        src = tl.load(idx + rows, mask=r_ok, other=0).to(tl.int64) // TOPK
        ok = r_ok[:, None] & (cols < K)[None, :]
        v = tl.load(x + src[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        y, scale = _quantize_rows(v, OUT_FP8)
        tl.store(q + rows[:, None].to(tl.int64) * K + cols[None, :], y, mask=ok)
        tl.store(s + rows.to(tl.int64) * stride_sm + tl.program_id(1), scale, mask=r_ok)

    _GATHER = CachedLauncher(_gather_quant_kernel)


# ---------------------------------------------------------------------------------------------
# The experts' E4M3 copies


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (E, N, K), scales (E, ceil(N/128), ceil(K/128))) of an (E, N, K) master: each expert's
    128x128 blocks (:func:`quantize_weight`'s bits). With N a multiple of 128 the experts' blocks
    are those of the (E*N, K) matrix: one launch."""
    e, n, k = w.shape
    if e and n % GROUP == 0:
        q, s = quantize_weight(w.reshape(e * n, k))
        return q.view(e, n, k), s.view(e, n // GROUP, cdiv(k, GROUP))
    parts = [quantize_weight(w[i]) for i in range(e)]
    if not parts:
        dtype = torch.float32 if w.device.type != "cuda" or interpreting() else FP8
        return w.new_empty(0, n, k, dtype=dtype), w.new_empty(
            0, cdiv(n, GROUP), cdiv(k, GROUP), dtype=torch.float32
        )
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


class Fp8Experts:
    """The E4M3 deploy copy of an (E, N, K) expert master: ``q`` (E, N, K) and ``scale``
    (E, ceil(N/128), ceil(K/128)), contiguous, re-made in place when the master's data changes (so
    a CUDA graph captured over them sees the new weights at its next replay)."""

    __slots__ = ("q", "scale", "version", "ptr")

    def __init__(self, master: torch.Tensor) -> None:
        self.q, self.scale = _quantize_experts(master.detach())
        self.version, self.ptr = master._version, master.data_ptr()

    def refresh(self, master: torch.Tensor) -> None:
        if master._version == self.version and master.data_ptr() == self.ptr:
            return
        q, s = _quantize_experts(master.detach())
        if q.shape == self.q.shape and q.device == self.q.device and q.dtype == self.q.dtype:
            self.q.copy_(q)
            self.scale.copy_(s)
        else:  # the master moved or changed shape: new buffers (no graph can hold the old ones)
            self.q, self.scale = q, s
        self.version, self.ptr = master._version, master.data_ptr()


_EXPERTS: MasterCache[Fp8Experts] = MasterCache(Fp8Experts)


def fp8_experts(master: torch.Tensor) -> Fp8Experts:
    """The cached E4M3 copy of an (E, N, K) expert master, found by the master's identity (one dict
    get, its version and data pointer compared); quantized on first use, re-made in place when the
    master changed, never under CUDA-graph capture."""
    return _EXPERTS.get(master)


def refresh_fp8_experts() -> int:
    """Re-quantize every cached expert copy whose master changed (a weight sync before replaying
    decode graphs); returns how many were re-made."""
    return _EXPERTS.refresh_all()


# ---------------------------------------------------------------------------------------------
# Launches


_TILES: dict[tuple, tuple[object, Fp8Tile]] = {}


def grouped_tile(s: int, groups: int, n: int, k: int, device: torch.device) -> Fp8Tile:
    """The tile of a grouped call of ``s`` rows in ``groups`` groups on an (N, K) weight: the
    :data:`isoaudit.kernels.fp8.TILE_TABLE` row of the mean rows per group, then its first tile
    whose programs (``groups`` x the tiles of a mean group) fill the device, else the row's last.
    Which tile runs changes no bit (every tile of the table is one the FP8 GPU tests prove equal)."""
    table = _fp8.TILE_TABLE
    key = (s, groups, n, k, device)
    hit = _TILES.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    g = max(groups, 1)
    m = cdiv(s, g)
    sms = _device_traits(device)[1]
    row = next((tiles for max_m, tiles in table if max_m == 0 or m <= max_m), table[-1][1])
    tile = next((t for t in row if g * cdiv(m, t.block_m) * cdiv(n, t.block_n) >= sms), row[-1])
    if len(_TILES) >= 8192:
        _TILES.clear()
    _TILES[key] = (table, tile)
    return tile


class _Plan:
    """One (weight shape, tile, table kind) launch's constexprs and options; hashed by identity."""

    __slots__ = ("constexprs", "options", "block_m", "block_n")

    def __init__(self, constexprs: dict, options: dict, block_m: int, block_n: int) -> None:
        self.constexprs, self.options, self.block_m, self.block_n = constexprs, options, block_m, block_n


@lru_cache(maxsize=1024)
def _plan(n: int, k: int, n_exp: int, tile: Fp8Tile, device_table: bool, scatter: bool) -> _Plan:
    """The launch of an (E, N, K) weight: the split span ``fp8_linear`` gives (N, K) (summed in
    turn in the tile's program: the same adds as its split grid), the tile's shape."""
    span = weight_split(n, k) // GROUP
    spans = cdiv(cdiv(k, GROUP), span) if span else 1
    constexprs = dict(
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=GROUP,
        SPAN_BLOCKS=span if spans > 1 else 0,
        LAG=tile.lag and k > 0,
        EVEN_K=k % GROUP == 0,
        DEVICE_TABLE=device_table,
        E_P2=next_power_of_2(n_exp) if device_table else 1,
        SCATTER=scatter,
    )
    return _Plan(
        constexprs, dict(num_warps=tile.num_warps, num_stages=tile.num_stages), tile.block_m, tile.block_n
    )


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    idx: torch.Tensor | None,
    n_groups: int,
    grid_m: int,
    plan: _Plan,
) -> None:
    n, k = wq.shape[1], wq.shape[2]
    idx_arg = idx if idx is not None else table
    args = (
        xq, xs, wq, ws, out, table, idx_arg, n_groups, n, k,
        xq.stride(0), xs.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
    )  # fmt: skip
    # what Triton specialises on: every integer but n_groups, the dtypes, the pointers' alignment
    key = (
        plan, xq.dtype, wq.dtype, out.dtype, *args[8:], aligned(xq, xs, wq, ws, out, table, idx_arg), xq.device,
    )  # fmt: skip
    _LAUNCH(key, (grid_m, cdiv(n, plan.block_n), 1), args, plan.constexprs, **plan.options)


def fp8_grouped_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    experts: list[int],
    offsets: list[int],
    out_dtype: torch.dtype = torch.bfloat16,
    impl: str | None = None,
    tile: Fp8Tile | None = None,
) -> torch.Tensor:
    """``out[offsets[g]:offsets[g+1]] = dq(xq[those rows]) @ dq(wq[experts[g]]).T`` for quantized
    (S, K) activations (``xs`` (S, ceil(K/128))) and stacked (E, N, K) weights (``ws`` (E,
    ceil(N/128), ceil(K/128))): one Triton launch on CUDA (or the interpreter, fp32 operands holding
    E4M3 values), :func:`isoaudit.kernels.fp8.w8a8_reference` per group elsewhere. Each group's rows
    get the bits ``w8a8_gemm(rows, wq[e], ...)`` gives them. ``tile``: the launch's tile (default
    :func:`grouped_tile`; it changes no bit)."""
    s, k = xq.shape
    n_exp, n, _ = wq.shape
    out = torch.empty(s, n, dtype=out_dtype, device=xq.device)
    if resolve(impl, xq) == "torch":
        for g, e in enumerate(experts):
            lo, hi = offsets[g], offsets[g + 1]
            if hi > lo:
                out[lo:hi] = w8a8_reference(xq[lo:hi], xs[lo:hi], wq[e], ws[e], None, out_dtype)
        return out
    if n == 0:
        return out
    groups = sum(1 for g in range(len(experts)) if offsets[g + 1] > offsets[g])
    tile = tile or grouped_tile(s, groups, n, k, xq.device)
    table = _tile_table(experts, offsets, tile.block_m, xq.device)
    n_tiles = table.shape[1]
    if n_tiles == 0:
        return out
    plan = _plan(n, k, n_exp, tile, False, False)
    _launch(
        _unit_rows(xq),
        _unit_rows(xs),
        _unit_rows(wq),
        _unit_rows(ws),
        out,
        table,
        None,
        n_tiles,
        n_tiles,
        plan,
    )
    return out


def fp8_grouped_counts(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    groups: torch.Tensor,
    tile: Fp8Tile,
    out_dtype: torch.dtype = torch.bfloat16,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fp8_grouped_gemm` with groups = experts 0..E-1 in order, their rows in ``groups``, a
    (3, E) int32 device table for ``tile.block_m`` (:func:`isoaudit.kernels.moe_grouped.device_groups`
    or a :func:`isoaudit.kernels.moe_grouped.sort_groups` slice): no host read; the grid is an upper
    bound (cdiv(S, BLOCK_M) + min(E, S) row tiles) and programs past the real tiles return.
    ``perm``: sorted row r is stored at row ``perm[r]`` (the scatter back to routing order). Triton
    only (CUDA, or the interpreter)."""
    s = xq.shape[0]
    n_exp, n, k = wq.shape
    out = torch.empty(s, n, dtype=out_dtype, device=xq.device)
    if s == 0 or n == 0:
        return out
    plan = _plan(n, k, n_exp, tile, True, perm is not None)
    grid_m = cdiv(s, tile.block_m) + min(n_exp, s)
    _launch(
        _unit_rows(xq), _unit_rows(xs), _unit_rows(wq), _unit_rows(ws), out, groups, perm, n_exp, grid_m, plan
    )
    return out


def gather_quant(x: torch.Tensor, perm: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (S, K), scales (S, ceil(K/128))) of the sorted rows ``x[perm[r] // top_k]``, one launch:
    :func:`isoaudit.kernels.fp8_quant.quantize_act`'s arithmetic (its Triton code), so the bits of
    ``quantize_act(x[perm // top_k])``. q is E4M3 on CUDA, the fp32 values before the cast under the
    interpreter (as ``quantize_act`` gives there)."""
    s = perm.numel()
    k = x.shape[1]
    g = cdiv(k, GROUP)
    fp8 = not interpreting()
    q = torch.empty(s, k, dtype=FP8 if fp8 else torch.float32, device=x.device)
    sc = torch.empty(s, g, dtype=torch.float32, device=x.device)
    if s == 0 or k == 0:
        return q, sc
    x = _unit_rows(x)
    rows = _rows_per_program(k)  # as the quantizer kernel
    key = (x.dtype, k, x.stride(0), top_k, rows, aligned(x, perm, q, sc), fp8, x.device)
    cx = dict(TOPK=top_k, GROUP_K=GROUP, ROWS=rows, OUT_FP8=fp8)
    _GATHER(
        key, (cdiv(s, rows), g, 1), (x, perm, q, sc, s, k, x.stride(0), g), cx, num_warps=4 if rows > 1 else 1
    )
    return q, sc


# ---------------------------------------------------------------------------------------------
# The layer's calls


def _forward(x: torch.Tensor, master: torch.Tensor, experts: list[int], offsets: list[int]) -> torch.Tensor:
    """Grouped rows through their experts in W8A8, in x's dtype: on CUDA the quantizer kernel then
    one grouped launch; on the CPU the torch references (the bits ``fp8_linear`` gives there)."""
    entry = fp8_experts(master)
    a = _unit_rows(x)
    if a.is_cuda and HAVE_TRITON:
        xq, xs = quantize_act(a)
        return fp8_grouped_gemm(xq, xs, entry.q, entry.scale, experts, offsets, x.dtype)
    xq, xs = quantize_act_reference(a)
    return fp8_grouped_gemm(xq, xs, entry.q, entry.scale, experts, offsets, x.dtype, impl="torch")


class _Fp8Grouped(_Grouped):
    """Forward in W8A8 (the grouped kernel); backward straight-through in the master dtype, per
    group (:class:`~isoaudit.kernels.moe_grouped._Grouped`'s, as
    :func:`isoaudit.kernels.fp8.fp8_linear`'s: correct, not invariant: the contract is the
    forward's bits)."""

    @staticmethod
    def forward(ctx, x, weight, experts, offsets):
        ctx.save_for_backward(x, weight)
        ctx.groups = (experts, offsets)
        return _forward(x, weight, experts, offsets)


def fp8_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, experts: list[int], offsets: list[int]
) -> torch.Tensor:
    """``out[offsets[g]:offsets[g+1]] = fp8_linear(x[offsets[g]:offsets[g+1]], weight[experts[g]])``
    bit for bit, for x (S, K) and an (E, N, K) master, in one grouped launch on CUDA;
    differentiable (straight-through to ``x`` and ``weight`` in their own dtypes)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Fp8Grouped.apply(x, weight, experts, offsets)
    return _forward(x, weight, experts, offsets)


def expert_outputs_fp8(
    x: torch.Tensor,
    flat: torch.Tensor,
    top_k: int,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """(T*k, H) SwiGLU expert outputs in routing order for (T, H) tokens ``x`` and their routed
    experts ``flat`` (T*k,), with the E4M3 experts ``gate_up`` = (q (E, 2I, H), scales) and ``down``
    = (q (E, H, I), scales); no host read (CUDA-graph capturable): a stable counting sort of the rows
    by expert with the tile tables (:func:`isoaudit.kernels.moe_grouped.sort_groups`), each sorted
    row quantized from its token (:func:`gather_quant`), the gate-up grouped GEMM, SiLU(g) * u
    (:func:`isoaudit.kernels.moe_grouped.silu_mul`, the roundings of ``dispatch.silu(g) * u``), the
    product quantized (:func:`quantize_act`) and the down grouped GEMM storing each row back at its
    (token, slot) place. Every row has the bits of the per-expert W8A8 path. Triton only (CUDA, or
    the interpreter with fp32 operands)."""
    (gq, gs), (dq, ds) = gate_up, down
    n_exp, n2, h = gq.shape
    s = flat.numel()
    groups = min(n_exp, s)
    t1 = grouped_tile(s, groups, n2, h, x.device)
    t2 = grouped_tile(s, groups, dq.shape[1], dq.shape[2], x.device)
    perm, tables = sort_groups(flat, n_exp, (t1.block_m, t2.block_m))
    xq, xs = gather_quant(x, perm, top_k)
    gu = fp8_grouped_counts(xq, xs, gq, gs, tables[0], t1, x.dtype)
    hq, hs = quantize_act(silu_mul(gu), impl="triton")
    return fp8_grouped_counts(hq, hs, dq, ds, tables[1], t2, x.dtype, perm=perm)


def expert_outputs_fast(
    x: torch.Tensor, flat: torch.Tensor, top_k: int, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """:func:`expert_outputs_fp8` on the cached E4M3 copies of the (E, 2I, H) and (E, H, I) masters."""
    gu, dn = fp8_experts(gate_up), fp8_experts(down)
    return expert_outputs_fp8(x, flat, top_k, (gu.q, gu.scale), (dn.q, dn.scale))


__all__ = [
    "Fp8Experts",
    "expert_outputs_fast",
    "expert_outputs_fp8",
    "fp8_experts",
    "fp8_grouped_counts",
    "fp8_grouped_gemm",
    "fp8_grouped_linear",
    "gather_quant",
    "grouped_tile",
    "refresh_fp8_experts",
]
