"""HF's MoE families (Qwen3-MoE, Mixtral) through :mod:`isoaudit.kernels.moe`.

``patch()``/``unpatch()`` (called by :func:`isoaudit.kernels.enable` beside :func:`isoaudit.kernels.adapters.patch`)
swap the forwards of HF's router (``*TopKRouter``: :func:`isoaudit.kernels.moe.route`, fp32 logits) and
fused experts (``*Experts``: :func:`isoaudit.kernels.moe.expert_outputs` then :func:`isoaudit.kernels.moe.combine`)
and route Mixtral's RMSNorm like the other families' norms; the sparse block keeps HF's structure
(``gate`` then ``experts``), so the modules the collectors hook (``layers.i.router`` on ``mlp.gate``,
``layers.i.combine`` on ``mlp.experts``) run in both modes. Kernels off, HF's own modules run
(model-dtype router, ``torch.topk``, experts looped with ``index_add_``): the native baseline.

:func:`instrument` numbers a model's MoE blocks, hooks their routers, so
:func:`isoaudit.kernels.moe.trace_routing` records the selected experts per token and layer in both modes,
and gives each experts module an :class:`ExpertSlots` child: the per-slot expert outputs
(``layers.i.experts``, one row a token: its k outputs in slot order), computed inside the
invariant experts with the kernels on, and by HF's own experts implementation when a hook asks for
them with the kernels off. :class:`HFMoECausalLM` is :class:`isoaudit.kernels.adapters.HFCausalLM`
for these families, tagging its tokens (trainer: batch row and position; engine: slot and position);
its decode step records routing into a device buffer, so the engine can replay it from a CUDA graph
where the MoE layers read nothing on the host (kernels on, the host-sync-free experts).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn

from . import dispatch, moe
from .adapters import HFCausalLM, _rmsnorm_forward, family_classes, observed

_FAMILIES = [("qwen3_moe", "Qwen3Moe"), ("mixtral", "Mixtral")]
_saved: dict[str, list[tuple[type[Any], Any]]] = {}


def _classes(suffix: str) -> list[type[Any]]:
    return family_classes(_FAMILIES, suffix)


class ExpertSlots(nn.Module):
    """The identity, called with the per-slot expert outputs ``(T, k * H)`` (token-major, slot
    order) before the combine: the module the ``layers.i.experts`` region hooks."""

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        return slots


def _wants_slots(experts: nn.Module) -> ExpertSlots | None:
    slots = getattr(experts, "slots", None)
    if isinstance(slots, ExpertSlots) and observed(slots):
        return slots
    return None


def _block_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's sparse MoE block (router, then experts) with the invariant contract's checks."""
    act = getattr(getattr(self.experts, "config", None), "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.hidden_act: the invariant experts implement SwiGLU ('silu'), not {act!r}")
    if self.training and getattr(self, "jitter_noise", 0) > 0:
        raise ValueError(
            "config.router_jitter_noise: the invariant MoE layer has no router jitter; set it to 0"
        )
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    _, weights, experts = self.gate(x)
    if getattr(self, "_moe_layer", None) is None:
        moe.record(None, experts)  # not instrumented: counted by active traces, not recorded
    return self.experts(x, experts, weights).reshape(hidden_states.shape)


def _router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HF's router outputs (logits, top-k weights, top-k experts) from :func:`isoaudit.kernels.moe.route`:
    fp32 logits of the batch-invariant GEMM, the stable top-k, weights in a fixed order (fp32)."""
    x = hidden_states.reshape(-1, self.weight.shape[1])
    r = moe.route(x, self.weight, self.top_k, getattr(self, "norm_topk_prob", True))
    return r.logits, r.weights, r.experts


def _experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Every (token, slot) expert output in routing order, then the fixed-order fp32 combine."""
    y = moe.expert_outputs(hidden_states, top_k_index, self.gate_up_proj, self.down_proj)
    slots = getattr(self, "slots", None)
    if isinstance(slots, ExpertSlots):
        t, k, h = y.shape
        y = slots(y.reshape(t, k * h)).reshape(t, k, h)
    return moe.combine(y, top_k_weights.float(), hidden_states.dtype)


def patch() -> None:
    """Install the invariant router, experts and block, and Mixtral's routed RMSNorm (idempotent)."""
    if _saved:
        return
    for key, suffix, forward in (
        ("blocks", "SparseMoeBlock", _block_forward),
        ("routers", "TopKRouter", _router_forward),
        ("experts", "Experts", _experts_forward),
    ):
        _saved[key] = [(cls, cls.forward) for cls in _classes(suffix)]
        for cls, _ in _saved[key]:
            cls.forward = forward
    _saved["norms"] = [
        (cls, cls.forward) for cls in _classes("RMSNorm") if cls.__name__.startswith("Mixtral")
    ]
    for cls, _ in _saved["norms"]:
        cls.forward = _rmsnorm_forward


def unpatch() -> None:
    """Restore what :func:`patch` replaced."""
    for key in ("blocks", "routers", "experts", "norms"):
        for cls, fwd in _saved.pop(key, []):
            cls.forward = fwd


def moe_blocks(model: nn.Module) -> list[tuple[int, Any]]:
    """(decoder layer index, sparse MoE block) of an HF Qwen3-MoE / Mixtral model."""
    classes = tuple(_classes("SparseMoeBlock"))
    inner: Any = getattr(model, "model", model)
    return [(i, layer.mlp) for i, layer in enumerate(inner.layers) if isinstance(layer.mlp, classes)]


def _record_router(layer: int):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        moe.record(layer, output[2])  # HF routers return (logits, weights, selected experts)

    return hook


def _packed_in(module: Any, args: tuple) -> tuple | None:
    """Blocks take (B, L, H); the engine's packed (T, H) rows enter as one sequence."""
    x = args[0]
    module._moe_packed = x.ndim == 2
    return (x[None], *args[1:]) if x.ndim == 2 else None


def _packed_out(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    return output[0] if getattr(module, "_moe_packed", False) else None


def _native_slots(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """Kernels off, when the ``layers.i.experts`` region is hooked: the per-slot outputs of HF's
    own experts implementation (eager, ``grouped_mm``, ...), as that implementation computes them.
    Slot s's outputs are the module's forward with weight 1 on slot s and 0 on the others: the same
    rows grouped the same way, so the same bits, and ``y * 1 + 0`` is ``y`` exactly. That costs k
    more expert passes, on fingerprinted forwards only; the block's output is HF's, untouched."""
    if _saved or (slots := _wants_slots(module)) is None:
        return
    x, index, weights = args[0], args[1], args[2]
    t, k = index.shape
    forward = type(module).forward  # HF's (dispatching) forward, without this module's hooks
    with torch.no_grad():
        eye = torch.eye(k, dtype=weights.dtype, device=weights.device)
        y = [forward(module, x, index, eye[s].expand(t, k)) for s in range(k)]
    slots(torch.stack(y, dim=1).reshape(t, -1))


def instrument(model: nn.Module) -> int:
    """Number the MoE blocks of an HF model by decoder layer, hook their routers so routing traces
    see native runs too, give their experts the per-slot :class:`ExpertSlots` tap, and let the
    blocks take packed (T, H) rows. Idempotent; returns how many MoE layers the model has."""
    blocks = moe_blocks(model)
    for i, block in blocks:
        if getattr(block, "_moe_layer", None) is None:
            block._moe_layer = i
            block.gate.register_forward_hook(_record_router(i))
            block.register_forward_pre_hook(_packed_in)
            block.register_forward_hook(_packed_out)
            block.experts.slots = ExpertSlots()
            block.experts.register_forward_hook(_native_slots)
    return len(blocks)


class HFMoECausalLM(HFCausalLM):
    """:class:`HFCausalLM` for HF's MoE families, its tokens tagged for routing traces.

    :meth:`decode` routes every MoE layer's selected experts into a device buffer of its batch size
    (:class:`isoaudit.kernels.moe.StepRoutes`), never through a host copy, and :meth:`decoded` files
    them in the active traces after the step, so a replayed CUDA graph's routing is recorded as
    :meth:`step`'s is. :meth:`decode_capturable` says when the whole step is free of host reads."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if instrument(model) == 0:
            raise ValueError("model: no Qwen3-MoE / Mixtral sparse MoE block found")
        self._top_k = {i: int(block.gate.top_k) for i, block in moe_blocks(model)}
        self._step_routes: dict[tuple[int, torch.device], moe.StepRoutes] = {}

    def decode_capturable(self) -> bool:
        """On CUDA, with the kernels on and every MoE layer's router, experts and combine on the
        host-sync-free path (:func:`isoaudit.kernels.moe.host_sync_free`): not in the native mode
        (HF's experts find their tokens with ``nonzero``), with ``ISOAUDIT_MOE_FAST=0``, on the
        per-expert paths (``ISOAUDIT_MOE_GROUPED=0``, per-tensor FP8 activation scales) or with more
        experts than the one-launch router takes (:data:`isoaudit.kernels.moe_router.MAX_EXPERTS`)."""
        if not (super().decode_capturable() and dispatch.is_enabled()):
            return False
        return all(
            moe.host_sync_free(block.experts.gate_up_proj, block.experts.down_proj)
            for _, block in moe_blocks(self.model)
        )

    @torch.no_grad()
    def decode(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """:meth:`HFCausalLM.decode` (one token per cache slot, :meth:`step`'s arithmetic per token)
        with every MoE layer's selected experts written into this batch size's
        :class:`~isoaudit.kernels.moe.StepRoutes` buffer (on the device: inside a CUDA graph too);
        the engine calls :meth:`decoded` after the step to file them."""
        with self._routes(ids.shape[0], ids.device).recording():
            return super().decode(ids, positions, cache)

    def decoded(self, positions: np.ndarray, live: np.ndarray) -> None:
        """After a decode step of ``len(positions)`` rows (eager or replayed): its routing to the
        active traces, from one host copy of the step's buffer, row i tagged (slot i,
        ``positions[i]``) as :meth:`step` tags its tokens. Only ``live`` rows (requests' real
        tokens) are filed: padding slots and the positions finished requests re-run are not tokens
        the packed steps compute, so the traces hold what an eager generation's do."""
        routes = self._step_routes.get((len(positions), self.lm_head_weight.device))
        if routes is None:
            return
        rows = torch.from_numpy(np.flatnonzero(live))
        routes.flush(rows, torch.from_numpy(positions.astype(np.int64))[rows], rows)

    def _routes(self, rows: int, device: torch.device) -> moe.StepRoutes:
        """The decode routing buffer of ``rows`` slots, made once (graphs captured over it write
        into it at every replay)."""
        key = (rows, device)
        if key not in self._step_routes:
            self._step_routes[key] = moe.StepRoutes(self._top_k, rows, device)
        return self._step_routes[key]

    @torch.no_grad()
    def step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cu: torch.Tensor,
        slots: list[int],
        cache: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        lens = (cu[1:] - cu[:-1]).to(ids.device).long()
        seq = torch.tensor(slots, device=ids.device).repeat_interleave(lens)
        with moe.tokens(seq, positions):
            return super().step(ids, positions, cu, slots, cache)

    def full_hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, n = input_ids.shape
        dev = input_ids.device
        rows = torch.arange(b, device=dev).repeat_interleave(n)
        with moe.tokens(rows, torch.arange(n, device=dev).repeat(b)):
            return super().full_hidden(input_ids, attention_mask)
