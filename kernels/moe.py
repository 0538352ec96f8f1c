"""Mixture-of-experts layers whose bits do not depend on the batch, the expert placement, the
number of expert-parallel ranks or the expert buffers' capacity.

An MoE layer is three regions (the collectors' ``layers.i.router``, ``layers.i.experts`` and
``layers.i.combine``), each with one fixed arithmetic when :func:`isoaudit.kernels.enable` is on:

* **router**: fp32 logits ``x W_g^T`` from the batch-invariant GEMM (:func:`dispatch.linear_fp32`,
  the same call on the trainer and the engine); the top-k by logit with the tie rule
  :data:`TIE_RULE` (unique integer keys, so no sort's stability is relied on); the selected weights
  ``e^(l_j - l_max) / den`` with the invariant ``exp`` of :mod:`isoaudit.kernels.cpu` (IEEE operations only,
  the same bits on any device and at any tensor position), ``den`` summed over the k slots left to
  right (``norm_topk_prob``) or over all experts by a fixed tree.
* **experts**: each expert's rows through the batch-invariant GEMM and SiLU, so a (token, slot)
  output depends on that token's row and that expert's weights only, not on which other tokens
  went to the expert, on which rank the expert lives or on padding rows in its buffer.
* **combine**: every (token, slot) output is put back at its place in the routing order
  (token-major, then top-k slot order), never in rank or arrival order, and a token's output is
  ``sum_s w_s y_s`` in fp32 over slots 0..k-1 in that order, rounded once to the model dtype.

Kernels off, the layer is what HF's eager MoE does: router logits in the model dtype, softmax in
fp32, ``torch.topk``, experts looped in expert (or arrival) order with ``index_add_`` in the
model dtype: the native mismatch the audit measures.

Routing is recorded, on both sides and in both modes, by :func:`trace_routing`: the selected
experts per token and MoE layer, keyed by (sequence, position) when the model tags its tokens
(:func:`tokens`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import cpu as _cpu
from . import dispatch, moe_router
from . import fp8 as _fp8
from . import fp8_grouped as _fp8g
from . import gemm as _gemm
from ._triton import HAVE_TRITON, interpreting
from .moe_grouped import grouped_config, grouped_glu, grouped_linear, grouped_scatter, sort_groups

__all__ = [
    "TIE_RULE",
    "ExpertParallel",
    "RouteCall",
    "Routing",
    "RoutingTrace",
    "StepRoutes",
    "agreement",
    "combine",
    "expert_outputs",
    "expert_outputs_distributed",
    "grouped_ffn",
    "host_sync_free",
    "run_experts",
    "moe_layer",
    "route",
    "stable_topk",
    "tokens",
    "trace_routing",
]

TIE_RULE = (
    "experts ranked by fp32 router logit, descending; equal logits (+0 equals -0) rank the lower "
    "expert index first; +inf and -inf rank as the largest and least finite fp32 values (so +inf "
    "ties with 3.4028235e38) and NaN ranks below them all, as -inf"
)
MAX_EXPERTS = 1 << 16

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


# ---------------------------------------------------------------------------------------------
# Router


def _order_key(z: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the fp32 values (infinities as the extreme finite values, NaN as -inf,
    below them; -0 as +0), then by lower index: unique
    per row, so ``topk`` over them has one answer on every backend."""
    z = torch.nan_to_num(z.float() + 0.0, nan=float("-inf"))  # -0 + 0 = +0
    b = z.view(torch.int32).to(torch.int64)
    ordered = torch.where(b >= 0, b, -(b & 0x7FFFFFFF) - 1)  # monotone in the float value
    idx = torch.arange(z.shape[-1], device=z.device, dtype=torch.int64)
    return ordered * MAX_EXPERTS + (MAX_EXPERTS - 1 - idx)


def stable_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k selected experts per row of (T, E) logits, best first, under :data:`TIE_RULE`."""
    e = logits.shape[-1]
    if not 1 <= k <= e:
        raise ValueError(f"top_k must be in [1, {e}] (the number of experts), not {k}")
    if e > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, not {e}")
    return torch.topk(_order_key(logits.detach()), k, dim=-1, sorted=True).indices


class _Exp(torch.autograd.Function):
    """:func:`isoaudit.kernels.cpu.exp` (IEEE ops only: the same bits wherever an element sits and on any
    device) with its derivative."""

    @staticmethod
    def forward(ctx, x):
        y = _cpu.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def _exp(x: torch.Tensor) -> torch.Tensor:
    return _Exp.apply(x) if torch.is_grad_enabled() and x.requires_grad else _cpu.exp(x)


def _slot_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last (slot) dim left to right: slot 0 + slot 1 + ..."""
    acc = p[..., 0]
    for s in range(1, p.shape[-1]):
        acc = acc + p[..., s]
    return acc


@dataclass(frozen=True)
class Routing:
    """One layer's routing of T tokens: ``experts`` (T, k) int64 in slot order (best first),
    ``weights`` (T, k) fp32, ``logits`` (T, E) fp32."""

    experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> Routing:
    """Router of (T, H) hidden states with gate weight (E, H): invariant when the kernels are on,
    HF's native router (model-dtype logits, fp32 softmax, ``torch.topk``) when off. Outside
    autograd on the Triton devices, the top-k and weights are one launch of
    :mod:`isoaudit.kernels.moe_router` (the same bits as the torch ops below)."""
    fast = _fast_router(x, gate_weight)
    if fast:  # the GEMM without its autograd wrapper: the same kernel, less host time
        logits = _gemm.gemm(x, gate_weight, None, torch.float32)
    else:
        logits = dispatch.linear_fp32(x, gate_weight)
    if not dispatch.is_enabled():
        probs = torch.softmax(logits, dim=-1)
        w, idx = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return Routing(idx, w, logits)
    if fast and moe_router.supported(logits, top_k):
        idx, w = moe_router.route_logits(logits, top_k, norm_topk_prob)
        return Routing(idx, w, logits)
    return _route_torch(logits, top_k, norm_topk_prob)


def _route_torch(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """The invariant router's top-k and weights as torch ops (autograd, :mod:`isoaudit.kernels.cpu`, fallback)."""
    idx = stable_topk(logits, top_k)
    sel = logits.gather(1, idx)
    m = sel[:, :1].detach()  # the best logit: every exponent <= 0
    p = _exp(sel - m)
    den = _slot_sum(p) if norm_topk_prob else _cpu.tree_sum(_exp(logits - m))
    return Routing(idx, p / den[:, None], logits)


def _fast_router(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """The one-launch router epilogue applies: kernels on, Triton tensors, no gradient wanted,
    ``ISOAUDIT_MOE_FAST`` not 0."""
    if os.environ.get("ISOAUDIT_MOE_FAST", "1") == "0" or not (dispatch.is_enabled() and HAVE_TRITON):
        return False
    if not (x.is_cuda or (interpreting() and not dispatch._on_cpu(x))):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or gate_weight.requires_grad))


# ---------------------------------------------------------------------------------------------
# Experts and combine


@dataclass(frozen=True)
class ExpertParallel:
    """Where experts live and how their buffers are shaped (on one device: simulated ranks).

    ``placement[e]`` is expert e's rank (None: contiguous blocks of E / ranks experts); each rank
    runs its experts in that order. ``capacity`` is the rows of one expert buffer: an expert's rows
    are cut into buffers of ``capacity`` rows, the last zero-padded (dropless: a full buffer opens
    another; None: one buffer of exactly the routed rows)."""

    ranks: int = 1
    placement: tuple[int, ...] | None = None
    capacity: int | None = None

    def owners(self, n_experts: int) -> list[int]:
        """Expert -> rank."""
        if self.placement is None:
            per = -(-n_experts // self.ranks)
            return [e // per for e in range(n_experts)]
        if len(self.placement) != n_experts or not all(0 <= r < self.ranks for r in self.placement):
            raise ValueError(
                f"placement must give each of the {n_experts} experts a rank in [0, {self.ranks})"
            )
        return list(self.placement)

    def arrival_order(self, n_experts: int) -> list[int]:
        """The order results reach a token's rank: rank-major, then each rank's experts."""
        owners = self.owners(n_experts)
        return [e for r in range(self.ranks) for e in range(n_experts) if owners[e] == r]


SINGLE = ExpertParallel()


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU on its rows: ``down(silu(gate x) * up x)`` with ``gate_up`` (2I, H) the
    gate rows then the up rows (HF's concatenated layout) and ``down`` (H, I)."""
    g, u = dispatch.linear(x, gate_up).chunk(2, dim=-1)
    return dispatch.linear(dispatch.silu(g) * u, down)


def _use_grouped(x: torch.Tensor) -> bool:
    """The (bf16) grouped kernel where the kernels run Triton: CUDA, or CPU tensors sent to the
    Triton modules under the interpreter (``dispatch.set_cpu_impl("triton")``, TRITON_INTERPRET=1);
    ``ISOAUDIT_MOE_GROUPED=0`` turns it off. Not in the ``invariant-fp8`` mode (:func:`_use_fp8_grouped`)."""
    if not (dispatch.is_enabled() and HAVE_TRITON) or os.environ.get("ISOAUDIT_MOE_GROUPED", "1") == "0":
        return False
    if dispatch.is_fp8():
        return False
    return x.is_cuda or (interpreting() and not dispatch._on_cpu(x))


def _use_fp8_grouped(x: torch.Tensor) -> bool:
    """The ``invariant-fp8`` mode's FP8 grouped GEMM (:mod:`isoaudit.kernels.fp8_grouped`): one
    launch per projection on CUDA, the torch reference per group on the CPU, each row with the bits
    of the per-expert W8A8 linear. ``ISOAUDIT_MOE_GROUPED=0`` turns it off (each expert's rows then
    go through :func:`expert_ffn`, whose linears are the W8A8 linear), and so does the per-tensor
    activation scaling (``fp8.set_act_scaling("tensor")``, whose scale is the batch's)."""
    if (
        not (dispatch.is_enabled() and dispatch.is_fp8())
        or os.environ.get("ISOAUDIT_MOE_GROUPED", "1") == "0"
    ):
        return False
    return _fp8._ACT_SCALING == "group" and (HAVE_TRITON or not x.is_cuda)


_VIEWS: dict[int, tuple[weakref.ref, list[torch.Tensor]]] = {}


def _expert_views(w: torch.Tensor) -> Sequence[torch.Tensor]:
    """``w[e]`` for every expert, the same view objects call after call outside autograd, so
    :mod:`isoaudit.kernels.cpu`'s weight cache (keyed by the tensor, checked against its values) hits in
    the engine's steps; with gradients on, fresh views (they must carry the graph)."""
    if torch.is_grad_enabled():
        return w.unbind(0)
    hit = _VIEWS.get(id(w))
    if hit is not None and hit[0]() is w and hit[1][0].data_ptr() == w.data_ptr():
        return hit[1]
    views = list(w.detach().unbind(0))  # same storage: they see in-place weight updates

    def drop(_: object, key: int = id(w)) -> None:  # w was collected
        _VIEWS.pop(key, None)

    _VIEWS[id(w)] = (weakref.ref(w, drop), views)
    return views


def grouped_ffn(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: list[int], offsets: list[int]
) -> torch.Tensor:
    """SwiGLU experts on grouped rows: rows ``offsets[g]:offsets[g+1]`` through expert
    ``experts[g]``. On CUDA with the kernels on, one grouped-GEMM launch per projection
    (:mod:`isoaudit.kernels.moe_grouped`; in the ``invariant-fp8`` mode the FP8 grouped GEMM of
    :mod:`isoaudit.kernels.fp8_grouped`, also on the CPU as its torch reference); else each group
    through :func:`expert_ffn`. Either way a row's bits depend on the row and its expert only."""
    if _use_fp8_grouped(x):
        g, u = _fp8g.fp8_grouped_linear(x, gate_up, experts, offsets).chunk(2, dim=-1)
        return _fp8g.fp8_grouped_linear(dispatch.silu(g) * u, down, experts, offsets)
    if _use_grouped(x):
        g, u = grouped_linear(x, gate_up, experts, offsets).chunk(2, dim=-1)
        return grouped_linear(dispatch.silu(g) * u, down, experts, offsets)
    gu, dn = _expert_views(gate_up), _expert_views(down)
    outs = [
        expert_ffn(x[lo:hi], gu[e], dn[e])
        for e, lo, hi in zip(experts, offsets[:-1], offsets[1:], strict=True)
        if hi > lo
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


def run_experts(
    work: list[tuple[int, torch.Tensor]],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    capacity: int | None = None,
) -> list[torch.Tensor]:
    """One rank's experts: ``work`` is (expert, its rows (R, H)); returns each entry's outputs.
    With ``capacity``, an expert's rows go in buffers of that many rows, the last zero-padded (a
    static-shape dispatch buffer; dropless: a full buffer opens another); padding rows are
    computed and dropped, and the batch-invariant GEMM keeps them out of the real rows' bits."""
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be a positive number of rows, not {capacity}")
    bufs, experts, offsets, real = [], [], [0], []
    for e, xr in work:
        for buf in xr.split(capacity) if capacity is not None and xr.shape[0] else [xr]:
            pad = 0 if capacity is None else capacity - buf.shape[0]
            bufs.append(torch.cat([buf, buf.new_zeros(pad, buf.shape[1])]) if pad else buf)
            experts.append(e)
            offsets.append(offsets[-1] + bufs[-1].shape[0])
            real.append(buf.shape[0])
    if not bufs:
        return []
    y = grouped_ffn(torch.cat(bufs), gate_up, down, experts, offsets)
    per_buf = [y[lo : lo + n] for lo, n in zip(offsets[:-1], real, strict=True)]
    outs, i = [], 0
    for _, xr in work:
        n_bufs = max(1, -(-xr.shape[0] // capacity)) if capacity is not None else 1
        outs.append(torch.cat(per_buf[i : i + n_bufs]))
        i += n_bufs
    return outs


def _place(rows: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """``out[rows[i]] = values[i]`` for a permutation ``rows`` of range(n), as a gather (autograd)."""
    inv = torch.empty_like(rows)
    inv[rows] = torch.arange(rows.numel(), device=rows.device)
    return values[inv]


def expert_outputs(
    x: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ep: ExpertParallel = SINGLE,
) -> torch.Tensor:
    """(T, k, H): the output of token t's slot-s expert at [t, s], in the model dtype.

    Each rank (in turn, on this device) runs its experts on the rows routed to them, taken in
    routing order (token-major, slot order), in buffers of ``ep.capacity`` rows; every output
    then goes back to its (token, slot) place by index, whatever rank or buffer computed it."""
    t, k = experts.shape
    n_experts = gate_up.shape[0]
    flat = experts.reshape(-1)
    if ep.ranks == 1 and ep.capacity is None and _fast(x, gate_up, down):
        return _expert_outputs_fast(x, flat, k, gate_up, down).view(t, k, -1)
    owners = ep.owners(n_experts)
    # Rows sorted rank-major, then by expert; a stable sort keeps each expert's rows in routing
    # order (token-major, then slot order). One host read: the rows per expert.
    rank_of = torch.tensor(owners, device=flat.device)
    perm = torch.sort(rank_of[flat] * n_experts + flat, stable=True).indices
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    xs = x[perm // k]
    outs, lo = [], 0
    for r in range(ep.ranks):
        mine = [e for e in range(n_experts) if owners[e] == r and counts[e]]
        hi = lo + sum(counts[e] for e in mine)
        if ep.capacity is None:  # the rank's rows are one slab: one grouped call
            offsets = [0]
            for e in mine:
                offsets.append(offsets[-1] + counts[e])
            if mine:
                outs.append(grouped_ffn(xs[lo:hi], gate_up, down, mine, offsets))
        else:
            work, at = [], lo
            for e in mine:
                work.append((e, xs[at : at + counts[e]]))
                at += counts[e]
            outs += run_experts(work, gate_up, down, ep.capacity)
        lo = hi
    if not outs:
        return x.new_zeros(t, k, down.shape[1])
    return _place(perm, torch.cat(outs), t * k).view(t, k, -1)


def _fast(*ts: torch.Tensor) -> bool:
    """The host-sync-free path (one rank, no capacity, forward only, grouped kernel, at most
    :data:`isoaudit.kernels.moe_router.MAX_EXPERTS` experts; in the ``invariant-fp8`` mode on CUDA
    only): ``ISOAUDIT_MOE_FAST=0`` restores the host-table path."""
    if os.environ.get("ISOAUDIT_MOE_FAST", "1") == "0":
        return False
    if not (_use_fp8_grouped(ts[0]) and ts[0].is_cuda) and not _use_grouped(ts[0]):
        return False
    if ts[1].shape[0] > moe_router.MAX_EXPERTS:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def host_sync_free(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether a forward (no-grad) MoE layer over these experts, on their device and in the current
    mode, reads nothing on the host: the router's one launch, the experts' host-sync-free path
    (:func:`_fast`) and the combine. What decides whether a decode step over the layer can be
    captured in a CUDA graph (on CUDA); on the CPU it holds under the Triton interpreter only.
    Its routing is then recorded through a :class:`StepRoutes` buffer, not :func:`record`'s copy."""
    with torch.no_grad():
        return _fast(gate_up.new_empty(0, gate_up.shape[-1]), gate_up, down)


def _expert_outputs_fast(
    x: torch.Tensor, flat: torch.Tensor, k: int, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """(T*k, H) outputs in routing order in three launches and no host read: a stable counting
    sort of the rows by expert with the tile tables (:func:`isoaudit.kernels.moe_grouped.sort_groups`),
    the gate-up GEMM reading each sorted row from its token with SiLU(g) * u in its epilogue,
    and the down GEMM storing each row back at its (token, slot) place. The same tiles and the
    same roundings, so the same bits, as the host-table path. ``ISOAUDIT_MOE_GLU=0``: the SiLU
    product as its own launch after the GEMM. In the ``invariant-fp8`` mode:
    :func:`isoaudit.kernels.fp8_grouped.expert_outputs_fast` (sort, gather-quantize, gate-up GEMM,
    SiLU * up, quantize, down GEMM scattering back: six launches, no host read)."""
    if dispatch.is_fp8():
        return _fp8g.expert_outputs_fast(x, flat, k, gate_up, down)
    bm1 = grouped_config(gate_up.shape[1], gate_up.shape[2], gate_up.dtype)[0]
    bm2 = grouped_config(down.shape[1], down.shape[2], down.dtype)[0]
    perm, groups = sort_groups(flat, gate_up.shape[0], (bm1, bm2))
    fused = os.environ.get("ISOAUDIT_MOE_GLU", "1") != "0"
    h = grouped_glu(x, gate_up, groups[0], perm, k, fused=fused)
    return grouped_scatter(h, down, groups[1], perm)


def _all_to_all(
    t: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Rows of ``t`` sent ``send[d]`` to rank d, ``recv[s]`` received from rank s (stacked in rank
    order). Rows travel as bytes: the bits, whatever dtypes the backend supports (gloo: no bf16)."""
    import torch.distributed as dist

    wire = t.contiguous().view(torch.uint8) if t.ndim > 1 else t
    out = wire.new_empty(sum(recv), *wire.shape[1:])
    dist.all_to_all_single(out, wire, recv, send, group=group)
    return out.view(t.dtype) if wire is not t else out


def expert_outputs_distributed(
    x: torch.Tensor,
    experts: torch.Tensor,
    local: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    owners: Sequence[int],
    capacity: int | None = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """:func:`expert_outputs` for this rank's tokens in a real expert-parallel group: ``local``
    holds this rank's experts (id -> (gate_up, down)), ``owners[e]`` expert e's rank. Rows go to
    their experts' ranks and back by two all-to-alls; each comes back to its (token, slot) place by
    index, so the result is the single-device one bit for bit. Forward only."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    t, k = experts.shape
    flat = experts.reshape(-1)
    dest = torch.tensor(owners, device=flat.device)[flat]
    rows = [(dest == d).nonzero()[:, 0] for d in range(world)]  # per rank, routing order
    sent = torch.cat(rows)
    send = [int(r.numel()) for r in rows]
    counts = torch.tensor(send, dtype=torch.int64, device=x.device)  # NCCL: on the device
    recv = _all_to_all(counts, [1] * world, [1] * world, group).tolist()
    rx = _all_to_all(x[sent // k], send, recv, group)
    re = _all_to_all(flat[sent], send, recv, group)
    ry = rx.new_empty(rx.shape)  # expert outputs have the hidden width
    ids = sorted(local)
    work, where = [], []
    for j, e in enumerate(ids):  # j: the expert's index among this rank's
        mine = (re == e).nonzero()[:, 0]
        if mine.numel():
            work.append((j, rx[mine]))
            where.append(mine)
    if work:
        gate_up = torch.stack([local[e][0] for e in ids])
        down = torch.stack([local[e][1] for e in ids])
        for mine, y in zip(where, run_experts(work, gate_up, down, capacity), strict=True):
            ry[mine] = y
    back = _all_to_all(ry, recv, send, group)
    return _place(sent, back, t * k).view(t, k, -1)


def combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_s w[t, s] y[t, s]`` in fp32 over slots 0..k-1 in that order, rounded once to ``dtype``.
    On CUDA (forward, ``ISOAUDIT_MOE_FAST`` not 0) one launch of :mod:`isoaudit.kernels.moe_combine`, the
    same arithmetic op for op."""
    if (
        y.is_cuda
        and HAVE_TRITON
        and os.environ.get("ISOAUDIT_MOE_FAST", "1") != "0"
        and not (torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad))
    ):
        from .moe_combine import combine_rows

        return combine_rows(y, weights, dtype)
    acc = weights[:, 0, None] * y[:, 0].float()
    for s in range(1, y.shape[1]):
        acc = acc + weights[:, s, None] * y[:, s].float()
    return acc.to(dtype)


def _native_experts(
    x: torch.Tensor, r: Routing, gate_up: torch.Tensor, down: torch.Tensor, ep: ExpertParallel
) -> torch.Tensor:
    """HF's eager experts: each expert's rows weighted in the model dtype and ``index_add_``-ed
    into the output in arrival order (expert order on one rank)."""
    out = torch.zeros_like(x)
    w = r.weights.to(x.dtype)
    for e in ep.arrival_order(gate_up.shape[0]):
        tok, slot = (r.experts == e).nonzero(as_tuple=True)
        if tok.numel():
            y = expert_ffn(x[tok], gate_up[e], down[e]) * w[tok, slot, None]
            out = out.index_add(0, tok, y.to(x.dtype))
    return out


def moe_layer(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool = True,
    layer: int | None = None,
    ep: ExpertParallel = SINGLE,
) -> torch.Tensor:
    """A sparse MoE block on (T, H) hidden states: router (E, H), experts ``gate_up`` (E, 2I, H)
    and ``down`` (E, H, I). Records its routing as ``layer`` in any active :func:`trace_routing`."""
    r = route(x, gate_weight, top_k, norm_topk_prob)
    record(layer, r.experts)
    if not dispatch.is_enabled():
        return _native_experts(x, r, gate_up, down, ep)
    return combine(expert_outputs(x, r.experts, gate_up, down, ep), r.weights, x.dtype)


# ---------------------------------------------------------------------------------------------
# Routing traces (what the collectors record)


@dataclass(frozen=True)
class RouteCall:
    """One MoE layer call: ``experts`` (T, k) on the CPU in slot order (uint8 when E <= 256, else
    int16: a few bytes a token); ``seq``/``pos`` (T,) int64 the tokens' sequence key and absolute
    position when the model tagged them (:func:`tokens`), else None."""

    layer: int
    experts: torch.Tensor
    seq: torch.Tensor | None
    pos: torch.Tensor | None


class RoutingTrace:
    """The routing of every MoE layer call made while it was active, in call order.
    ``unlabelled`` counts calls of MoE blocks that had no layer index (an HF model not passed to
    :func:`isoaudit.kernels.adapters_moe.instrument`): they are not recorded."""

    def __init__(self) -> None:
        self.calls: list[RouteCall] = []
        self.unlabelled = 0

    def layers(self) -> list[int]:
        return sorted({c.layer for c in self.calls})

    def arrays(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's tokens as ``keys`` (N, 2) int64 (sequence, position), sorted, and their
        ``experts`` (N, k) in slot order. A token computed twice keeps its first routing (an engine
        may re-run a finished request's last position with filler tokens, as :mod:`isoaudit.kernels.engine`'s
        batched decode does). Needs tagged calls."""
        calls = [c for c in self.calls if c.layer == layer]
        for c in calls:
            if c.seq is None or c.pos is None:
                raise ValueError(f"layer {layer} was called without token tags (isoaudit.kernels.moe.tokens)")
        if not calls:
            return torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 0, dtype=torch.uint8)
        seq = torch.cat([c.seq for c in calls])  # type: ignore[misc]  # checked not None above
        pos = torch.cat([c.pos for c in calls])  # type: ignore[misc]  # checked not None above
        experts = torch.cat([c.experts.to(torch.int16) for c in calls])
        order = torch.sort(seq * (1 << 32) + pos, stable=True).indices  # call order within a key
        seq, pos, experts = seq[order], pos[order], experts[order]
        first = torch.ones(seq.numel(), dtype=torch.bool)
        first[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1])
        return torch.stack([seq[first], pos[first]], 1), experts[first].to(calls[0].experts.dtype)

    def table(self, layer: int) -> dict[tuple[int, int], tuple[int, ...]]:
        """(sequence, position) -> selected experts in slot order, for one layer (see :meth:`arrays`)."""
        keys, experts = self.arrays(layer)
        return {(s, p): tuple(e) for (s, p), e in zip(keys.tolist(), experts.tolist(), strict=True)}


_TRACES: contextvars.ContextVar[tuple[RoutingTrace, ...]] = contextvars.ContextVar("moe_traces", default=())
_TOKENS: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = contextvars.ContextVar(
    "moe_tokens", default=None
)


@contextlib.contextmanager
def trace_routing() -> Iterator[RoutingTrace]:
    """Record the routing of every MoE layer run inside the block (both modes, any model routed
    through :func:`moe_layer` or the HF MoE adapters)."""
    trace = RoutingTrace()
    reset = _TRACES.set((*_TRACES.get(), trace))
    try:
        yield trace
    finally:
        _TRACES.reset(reset)


@contextlib.contextmanager
def tokens(seq: torch.Tensor, pos: torch.Tensor) -> Iterator[None]:
    """Tag the rows of the MoE calls inside the block: row i is token ``(seq[i], pos[i])``.
    Models call this around a forward (trainer: batch row and position; engine: slot and
    position), so traces of the two sides line up token by token."""
    reset = _TOKENS.set((seq.reshape(-1), pos.reshape(-1)))
    try:
        yield
    finally:
        _TOKENS.reset(reset)


def record(layer: int | None, experts: torch.Tensor) -> None:
    """Add one call's selected experts (T, k) to the active traces (no-op when none is active).
    Inside :meth:`StepRoutes.recording` (a decode step), a numbered layer's experts go to that
    buffer instead, on the device: no host read, whether or not a trace is active."""
    steps = _STEP_ROUTES.get()
    if steps is not None and layer is not None:
        steps.write(layer, experts)
        return
    traces = _TRACES.get()
    if not traces:
        return
    if layer is None:  # never fail the traced job: count it, the collector can say so
        for tr in traces:
            tr.unlabelled += 1
        return
    tags = _TOKENS.get()
    seq = pos = None
    if tags is not None and tags[0].numel() == experts.shape[0]:
        seq, pos = (t.detach().to("cpu", torch.int64, copy=True) for t in tags)  # callers reuse buffers
    _append(traces, layer, experts.detach().cpu(), seq, pos)


def _append(
    traces: Sequence[RoutingTrace],
    layer: int,
    experts: torch.Tensor,
    seq: torch.Tensor | None,
    pos: torch.Tensor | None,
) -> None:
    """One :class:`RouteCall` of host ``experts`` (T, k), stored in the smallest dtype that holds
    them, appended to every trace."""
    top = int(experts.max()) if experts.numel() else 0
    small = experts.to(torch.int16 if top > 255 else torch.uint8)
    call = RouteCall(int(layer), small, seq, pos)
    for tr in traces:
        tr.calls.append(call)


class StepRoutes:
    """The selected experts of one decode step, every MoE layer's in one preallocated device
    buffer ``(layers, rows, max k)``: what a CUDA-graph-captured decode records routing into, since
    a replay runs no Python (so no :func:`record` host copy). Inside :meth:`recording` each
    numbered layer's :func:`record` call copies its (rows, k) experts into the buffer (an op a
    capture records, repeated by every replay); after the step, :meth:`flush` appends the step's
    :class:`RouteCall` objects to the active traces from one host copy of the buffer. A model
    keeps one per decode batch size, made before the first capture and kept as long as the
    graphs that write into it."""

    def __init__(self, top_k: Mapping[int, int], rows: int, device: torch.device) -> None:
        self.layers = sorted(top_k)
        self.top_k = [top_k[layer] for layer in self.layers]
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        width = max(self.top_k, default=0)
        self.buffer = torch.zeros(len(self.layers), rows, width, dtype=torch.int64, device=device)

    def write(self, layer: int, experts: torch.Tensor) -> None:
        """Copy layer ``layer``'s selected experts (rows, k) into its part of the buffer."""
        i = self._index.get(layer)
        if i is None:
            raise KeyError(f"layer {layer}: not one of this step's MoE layers {self.layers}")
        self.buffer[i, :, : self.top_k[i]].copy_(experts)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Send the numbered layers' :func:`record` calls inside the block to this buffer."""
        reset = _STEP_ROUTES.set(self)
        try:
            yield
        finally:
            _STEP_ROUTES.reset(reset)

    def flush(self, seq: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> None:
        """Append the last step's routing of buffer rows ``rows`` to the active traces (no-op, and
        no host read, when none is active): one :class:`RouteCall` per layer, in layer order (the
        order the step called them), row ``rows[j]`` tagged as token ``(seq[j], pos[j])``."""
        traces = _TRACES.get()
        if not traces:
            return
        host = self.buffer.cpu()  # the step's one host read
        for i, layer in enumerate(self.layers):
            _append(traces, layer, host[i, rows, : self.top_k[i]], seq, pos)


_STEP_ROUTES: contextvars.ContextVar[StepRoutes | None] = contextvars.ContextVar(
    "moe_step_routes", default=None
)


def agreement(a: RoutingTrace, b: RoutingTrace, layers: Sequence[int] | None = None) -> dict[int, float]:
    """Per layer, the fraction of the tokens both traces routed whose top-k *set* is the same."""
    out = {}
    for layer in layers if layers is not None else sorted(set(a.layers()) & set(b.layers())):
        (ka, ea), (kb, eb) = a.arrays(layer), b.arrays(layer)
        fa, fb = ka[:, 0] * (1 << 32) + ka[:, 1], kb[:, 0] * (1 << 32) + kb[:, 1]  # sorted, unique
        ia = torch.isin(fa, fb).nonzero()[:, 0]
        if ia.numel():
            ib = torch.searchsorted(fb, fa[ia])
            same = (ea[ia].sort(-1).values == eb[ib].sort(-1).values).all(-1)
            out[layer] = float(same.double().mean())
    return out
