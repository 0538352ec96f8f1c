"""HF's MoE families (Qwen3-MoE, Mixtral) through :func:`kernels.moe.moe_layer`.

``patch()``/``unpatch()`` (called by :func:`kernels.enable` beside :func:`kernels.adapters.patch`)
swap the forward of HF's sparse MoE blocks for :func:`kernels.moe.moe_layer` on the block's own
router and expert weights, and route Mixtral's RMSNorm like the other families'. Kernels off, HF's
own block runs (model-dtype router, ``torch.topk``, experts looped with ``index_add_``): the
native baseline.

:func:`instrument` numbers a model's MoE blocks and hooks their routers, so
:func:`kernels.moe.trace_routing` records the selected experts per token and layer in both modes;
:class:`HFMoECausalLM` is :class:`kernels.adapters.HFCausalLM` for these families, tagging its
tokens (trainer: batch row and position; engine: slot and position).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn as nn

from . import moe
from .adapters import HFCausalLM, _rmsnorm_forward

_FAMILIES = [("qwen3_moe", "Qwen3Moe"), ("mixtral", "Mixtral")]
_saved: dict[str, list[tuple[type, Any]]] = {}


def _classes(suffix: str) -> list[type]:
    out = []
    for mod, prefix in _FAMILIES:
        try:
            m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        except Exception:
            continue
        cls = getattr(m, f"{prefix}{suffix}", None)
        if cls is not None:
            out.append(cls)
    return out


def _block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF sparse MoE block forward on the invariant layer (same weights, same routing contract)."""
    act = getattr(getattr(self.experts, "config", None), "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.hidden_act: the invariant experts implement SwiGLU ('silu'), not {act!r}")
    if self.training and getattr(self, "jitter_noise", 0) > 0:
        raise ValueError(
            "config.router_jitter_noise: the invariant MoE layer has no router jitter; set it to 0"
        )
    gate = self.gate
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = moe.moe_layer(
        x,
        gate.weight,
        self.experts.gate_up_proj,
        self.experts.down_proj,
        gate.top_k,
        getattr(gate, "norm_topk_prob", True),  # Mixtral always renormalises the top-k
        layer=getattr(self, "_moe_layer", None),
    )
    return out.reshape(hidden_states.shape)


def patch() -> None:
    """Install the invariant MoE block and Mixtral's routed RMSNorm (idempotent)."""
    if _saved:
        return
    _saved["blocks"] = [(cls, cls.forward) for cls in _classes("SparseMoeBlock")]
    for cls, _ in _saved["blocks"]:
        cls.forward = _block_forward
    _saved["norms"] = [
        (cls, cls.forward) for cls in _classes("RMSNorm") if cls.__name__.startswith("Mixtral")
    ]
    for cls, _ in _saved["norms"]:
        cls.forward = _rmsnorm_forward


def unpatch() -> None:
    """Restore what :func:`patch` replaced."""
    for cls, fwd in _saved.pop("blocks", []) + _saved.pop("norms", []):
        cls.forward = fwd


def moe_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, sparse MoE block) of an HF Qwen3-MoE / Mixtral model."""
    classes = tuple(_classes("SparseMoeBlock"))
    inner = getattr(model, "model", model)
    return [(i, layer.mlp) for i, layer in enumerate(inner.layers) if isinstance(layer.mlp, classes)]


def _record_router(layer: int):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        moe.record(layer, output[2])  # HF routers return (logits, weights, selected experts)

    return hook


def _packed_in(module: nn.Module, args: tuple) -> tuple | None:
    """Blocks take (B, L, H); the engine's packed (T, H) rows enter as one sequence."""
    x = args[0]
    module._moe_packed = x.ndim == 2  # type: ignore[attr-defined]
    return (x[None], *args[1:]) if x.ndim == 2 else None


def _packed_out(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    return output[0] if getattr(module, "_moe_packed", False) else None


def instrument(model: nn.Module) -> int:
    """Number the MoE blocks of an HF model by decoder layer, hook their routers so routing traces
    see native runs too, and let the blocks take packed (T, H) rows. Idempotent; returns how many
    MoE layers the model has."""
    blocks = moe_blocks(model)
    for i, block in blocks:
        if getattr(block, "_moe_layer", None) is None:
            block._moe_layer = i
            block.gate.register_forward_hook(_record_router(i))
            block.register_forward_pre_hook(_packed_in)
            block.register_forward_hook(_packed_out)
    return len(blocks)


class HFMoECausalLM(HFCausalLM):
    """:class:`HFCausalLM` for HF's MoE families, its tokens tagged for routing traces."""

    # The MoE dispatch reads routed counts on the host, so the decode step cannot be captured in a
    # CUDA graph: the engine runs ``step`` for every decode step instead.
    decode = None

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if instrument(model) == 0:
            raise ValueError("model: no Qwen3-MoE / Mixtral sparse MoE block found")

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
