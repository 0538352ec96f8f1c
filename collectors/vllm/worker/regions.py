"""The canonical regions on vLLM's own modules (DESIGN.md, "Canonical regions").

vLLM's Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) share module names, but package the
quantities differently from HF: a decoder layer returns ``(hidden, residual)`` whose *sum* is the
residual stream, ``RMSNorm(x, residual)`` fuses the residual add and returns ``(normed, x +
residual)`` (the first is the region), ``o_proj`` returns ``(out, bias)``, and the logits come from
``logits_processor`` outside the model's forward. The taps of :mod:`isoaudit.collectors.regions` read each of
these, so the engine emits exactly the trainer's canonical names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from isoaudit.collectors.regions import (
    Catalog,
    FamilyMap,
    ResolvedRegions,
    Tap,
    llama_style_map,
    resolve_regions,
)
from torch import nn


def vllm_map(family: str) -> FamilyMap:
    """vLLM's Llama-style layout: HF's module names; logits from ``logits_processor``; a layer's
    ``(hidden, residual)`` summed into the residual stream."""
    return llama_style_map(family, logits="logits_processor", taps={"out": Tap.SUM, "logits": Tap.FP32})


def vllm_moe_map(family: str) -> FamilyMap:
    """vLLM's Qwen3-MoE layout: ``mlp`` is the sparse block, ``mlp.gate`` the router
    (its logits, read in fp32), ``mlp.experts`` the fused-MoE runner, whose output is the weighted
    combine; the per-slot expert outputs stay inside its fused kernel."""
    dense = vllm_map(family)
    return replace(
        dense,
        taps={**dense.taps, "router": Tap.FP32},
        moe={"router": "model.layers.{i}.mlp.gate", "combine": "model.layers.{i}.mlp.experts"},
        moe_unobserved={"experts": "vLLM's fused-MoE kernel returns only the weighted combine"},
    )


#: The rollout side: vLLM families, keyed by the HF ``model_type`` of the checkpoint the engine serves.
VLLM_CATALOG = Catalog(
    side="vLLM",
    families={
        **{name: vllm_map(name) for name in ("llama", "mistral", "qwen2", "qwen3")},
        "qwen3_moe": vllm_moe_map("qwen3_moe"),
    },
    generic=vllm_map,
    tap_for=lambda name: Tap.FP32 if name == "logits" else Tap.SUM if name.endswith(".out") else Tap.FIRST,
    model_noun="engine's model",
)


def resolve_engine_regions(
    model: nn.Module, model_type: str | None, regions: str | Sequence[str] | Mapping[str, str] | None = "auto"
) -> ResolvedRegions:
    """Bind ``regions`` to the vLLM ``model``'s modules (:func:`isoaudit.collectors.regions.resolve_regions`
    with vLLM's maps: decoder layers ``layers.i.out`` read as hidden + residual, ``logits`` as float32)."""
    return resolve_regions(model, regions, model_type=model_type, catalog=VLLM_CATALOG)
