"""Sequence parallelism that leaves the logits' bits as they are without it.

Ranks hold contiguous slices of every sequence (:func:`seq_slices`) and keep their own output
slice throughout. Nothing adds across ranks in a new order; every reduction is the one the
non-SP model performs:

* **Per-token ops** (norms, projections, router, experts, combine, lm_head) run on a rank's slice
  alone: they are batch-invariant, so a token's bits do not depend on which other tokens share
  the call.
* **Attention** all-gathers K and V along the sequence (data movement, no arithmetic) and runs the
  rank's queries against them at their absolute positions: the kernel's reduction over keys is a
  fixed tree of key tiles at absolute positions, the same for a query whatever else is in the
  call, so no ring-style merge of per-rank partial softmaxes (whose order would follow the ranks).
* **Row-parallel layers with TP** (:func:`tree_gemm_reduce_scatter`): each rank's subtree roots
  of the tree GEMM (:mod:`isoaudit.kernels.tree_gemm`) for every token go to the rank owning that token's
  slice (an all-to-all in place of the all-gather), which combines them by the same tree:
  Megatron's reduce-scatter, with TP=1's additions.

:func:`sp_hidden` runs a decoder this way, for all ranks on one device (simulated) or for this
process's rank of a real group (:func:`process_group_seq_gather`): our
:class:`isoaudit.kernels.models.moe_lm.MoELM`, or HF's Llama/Qwen3 (dense) and Qwen3-MoE/Mixtral (MoE)
decoders with the ops of :class:`isoaudit.kernels.adapters.HFCausalLM` (the engine path, bitwise HF's own
forward with the kernels on). ``python -m isoaudit.kernels.moe_check`` checks both under torchrun.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from . import dispatch, moe
from .tree_gemm import subtree_root, tree_plan, tree_reduce

#: Gathers one tensor per local rank, (B, len_r, ...), into the full sequence (B, n, ...).
SeqGather = Callable[[dict[int, torch.Tensor]], torch.Tensor]
#: ``all_to_all(parts)``: parts[d] goes to rank d; returns what every rank sent here, in rank order.
AllToAll = Callable[[list[torch.Tensor]], list[torch.Tensor]]

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def seq_slices(n: int, world: int) -> list[tuple[int, int]]:
    """Balanced contiguous [lo, hi) position ranges of a length-n sequence over ``world`` ranks
    (the first ``n % world`` ranks hold one position more)."""
    if world < 1:
        raise ValueError(f"world must be at least 1, not {world}")
    base, extra = divmod(n, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + base + (r < extra))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def simulated_seq_gather(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """All ranks on this device: their slices in rank order."""
    return torch.cat([parts[r] for r in sorted(parts)], dim=1)


def process_group_seq_gather(n: int, group: ProcessGroup | None = None) -> SeqGather:
    """This process's rank of a real group (one local slice): an all-gather of the slices, padded
    to the longest and trimmed back."""
    import torch.distributed as dist

    def gather(parts: dict[int, torch.Tensor]) -> torch.Tensor:
        ((rank, t),) = parts.items()
        world = dist.get_world_size(group)
        sl = seq_slices(n, world)
        width = max(hi - lo for lo, hi in sl)
        pad = torch.zeros(t.shape[0], width, *t.shape[2:], dtype=t.dtype, device=t.device)
        pad[:, : t.shape[1]] = t
        wire = pad.view(torch.uint8)  # the bits, whatever dtypes the backend supports
        out = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(out, wire, group=group)
        full = [o.view(t.dtype) for o in out]
        return torch.cat([f[:, : hi - lo] for f, (lo, hi) in zip(full, sl, strict=True)], dim=1)

    return gather


class SPLayer(Protocol):
    """One decoder layer as :func:`sp_hidden` runs it on a rank's slice (T rows)."""

    scale: float

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (T, Hq, D), keys and values (T, Hkv, D) at absolute positions ``pos`` (T,)."""
        ...

    def attended(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention: ``x`` plus the output projection of ``o``."""
        ...

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP / MoE block."""
        ...


class SPModel(Protocol):
    """A decoder as :func:`sp_hidden` runs it: embedding, layers, final norm."""

    layers: Sequence[SPLayer]

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def final(self, x: torch.Tensor) -> torch.Tensor: ...


class _OursLayer:
    def __init__(self, blk: Any) -> None:
        self.blk, self.att = blk, blk.mixer
        self.scale = self.att.cfg.head_dim**-0.5

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> Any:
        return self.att.qkv(self.blk.norm1(x), pos)

    def attended(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return x + dispatch.linear(o.reshape(x.shape[0], -1), self.att.o.weight)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.blk.mlp(self.blk.norm2(h))


class _Ours:
    """:class:`isoaudit.kernels.models.moe_lm.MoELM` (``embed``, ``blocks``, ``norm``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers: Sequence[SPLayer] = [_OursLayer(blk) for blk in model.blocks]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)


class _HFLayer:
    def __init__(self, owner: _HF, layer: Any) -> None:
        self.owner, self.layer, self.attn = owner, layer, layer.self_attn
        self.scale = float(self.attn.scaling)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> Any:
        from .adapters import _norm, _rotate_half

        t, d, attn = x.shape[0], self.owner.head_dim, self.attn
        h = _norm(self.layer.input_layernorm, x)
        q = attn.q_proj(h).view(t, -1, d)
        k = attn.k_proj(h).view(t, -1, d)
        v = attn.v_proj(h).view(t, -1, d)
        if hasattr(attn, "q_norm"):
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        cos, sin = self.owner.rope(x, pos)
        return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin), v

    def attended(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return x + self.attn.o_proj(o.reshape(x.shape[0], -1))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        from .adapters import _norm

        return h + self.layer.mlp(_norm(self.layer.post_attention_layernorm, h))


class _HF:
    """An HF Llama/Qwen3/Qwen3-MoE/Mixtral causal LM (or an :class:`~isoaudit.kernels.adapters.HFCausalLM`)
    with :class:`~isoaudit.kernels.adapters.HFCausalLM`'s per-layer ops; MoE blocks are instrumented so they
    take packed rows and record their routing."""

    def __init__(self, model: Any) -> None:
        model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
        from .adapters_moe import instrument

        instrument(model)
        self.inner: Any = model.model
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers: Sequence[SPLayer] = [_HFLayer(self, layer) for layer in self.inner.layers]
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner.rotary_emb(x[None], pos[None])
        return cos[0][:, None, :], sin[0][:, None, :]

    def final(self, x: torch.Tensor) -> torch.Tensor:
        from .adapters import _norm

        return _norm(self.inner.norm, x)


def sp_model(model: Any) -> SPModel:
    """``model`` as :func:`sp_hidden` runs it: our MoELM, an HF decoder (dense or MoE), an
    :class:`~isoaudit.kernels.adapters.HFCausalLM`, or an :class:`SPModel` already."""
    if hasattr(model, "layers") and hasattr(model, "final"):
        return model
    if hasattr(model, "blocks") and hasattr(model, "embed"):
        return _Ours(model)
    inner = getattr(model, "model", None)
    if hasattr(getattr(inner, "model", inner), "layers"):
        return _HF(model)
    raise TypeError(
        f"model: expected an MoELM, an HF Llama/Qwen3/Qwen3-MoE/Mixtral causal LM or an SPModel, "
        f"got {type(model).__name__}"
    )


def sp_hidden(
    model: Any,
    input_ids: torch.Tensor,
    world: int,
    ranks: Sequence[int] | None = None,
    gather: SeqGather = simulated_seq_gather,
) -> dict[int, torch.Tensor]:
    """The final hidden states of ``ranks`` (default all: simulated), each (B, len_r, hidden) for
    its slice of (B, n) ids (no padding), with sequence parallelism of degree ``world``. ``model``:
    anything :func:`sp_model` takes. Tokens are tagged (batch row, position) for routing traces."""
    view = sp_model(model)
    b, n = input_ids.shape
    dev = input_ids.device
    ranks = list(range(world)) if ranks is None else list(ranks)
    sl = seq_slices(n, world)
    pos = {r: torch.arange(*sl[r], device=dev).repeat(b) for r in ranks}
    rows = {r: torch.arange(b, device=dev).repeat_interleave(sl[r][1] - sl[r][0]) for r in ranks}
    x = {r: view.embed(input_ids[:, sl[r][0] : sl[r][1]].reshape(-1)) for r in ranks}
    for layer in view.layers:
        qkv = {r: layer.qkv(x[r], pos[r]) for r in ranks}
        shaped = {r: lambda t, r=r: t.view(b, sl[r][1] - sl[r][0], *t.shape[1:]) for r in ranks}
        kc = gather({r: shaped[r](qkv[r][1]) for r in ranks})  # (B, n, Hkv, D): slot b = row b
        vc = gather({r: shaped[r](qkv[r][2]) for r in ranks})
        for r in ranks:
            lo, hi = sl[r]
            cu = torch.arange(b + 1, device=dev, dtype=torch.int32) * (hi - lo)
            pos0 = torch.full((b,), lo, device=dev, dtype=torch.int32)
            kv_len = torch.full((b,), hi, device=dev, dtype=torch.int32)
            o = dispatch.attention(qkv[r][0], kc, vc, cu, pos0, kv_len, None, layer.scale)
            h = layer.attended(x[r], o)
            with moe.tokens(rows[r], pos[r]):
                x[r] = layer.mlp(h)
    return {r: view.final(x[r]).view(b, sl[r][1] - sl[r][0], -1) for r in ranks}


def tree_gemm_reduce_scatter(
    x_local: torch.Tensor,
    w_local: torch.Tensor,
    k: int,
    tp: int,
    rank: int,
    all_to_all: AllToAll,
    leaf: int = 256,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """One rank of a TP group with sequence parallelism: a row-parallel layer's output for this
    rank's slice of the M rows (:func:`seq_slices` over M), from its K columns of every row. The
    rank's subtree roots for every row are split by slice and exchanged (``all_to_all``), and the
    ``tp`` roots of each of its rows are combined by the same tree as without SP, so each row has
    the bits of :func:`isoaudit.kernels.tree_gemm.tree_gemm` (and of TP=1)."""
    root = subtree_root(x_local, w_local, tree_plan(k, leaf, tp), rank, impl)  # (M, N) fp32
    mine = all_to_all([root[lo:hi] for lo, hi in seq_slices(root.shape[0], tp)])
    return tree_reduce(torch.stack(mine)).to(out_dtype or x_local.dtype)


def tree_gemm_sp(
    x: torch.Tensor,
    weight: torch.Tensor,
    tp: int,
    leaf: int = 256,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
) -> list[torch.Tensor]:
    """:func:`tree_gemm_reduce_scatter` for all ``tp`` ranks on this device: each rank's output
    slice of ``x (M, K) @ weight.T``."""
    plan = tree_plan(x.shape[1], leaf, tp)
    roots = []
    for r in range(tp):
        lo, hi = plan.k_range(r)
        roots.append(subtree_root(x[:, lo:hi], weight[:, lo:hi], plan, r, impl))
    return [
        tree_reduce(torch.stack([root[lo:hi] for root in roots])).to(out_dtype or x.dtype)
        for lo, hi in seq_slices(x.shape[0], tp)
    ]


def process_group_all_to_all(group: ProcessGroup | None = None) -> AllToAll:
    """An all-to-all of row blocks over a ``torch.distributed`` group: ``parts[d]`` goes to rank d;
    this rank receives every rank's block for it (all of this rank's own block's shape)."""
    import torch.distributed as dist

    def exchange(parts: list[torch.Tensor]) -> list[torch.Tensor]:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = parts[rank].shape[0]
        out = parts[0].new_empty(world * mine, *parts[0].shape[1:])
        send = torch.cat([p.contiguous() for p in parts])
        dist.all_to_all_single(out, send, [mine] * world, [p.shape[0] for p in parts], group=group)
        return list(out.split(mine))

    return exchange
