"""What this process quantizes, for its manifest (``RuntimeFacts.quant``, read by
:mod:`isoaudit.audit.quantization`): the weight and activation formats with their scale granularity
and the dtype of the masters they are quantized from, while :mod:`isoaudit.kernels` routes linear
layers through its FP8 path. Read from already imported modules only (no import of the kernels)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from isoaudit.collectors.held_weights import checkpoint_name, tensor_digests
from torch import nn

#: The reference FP8 path's formats (``kernels.fp8_quant``): E4M3 weights in 128x128 blocks,
#: activations per token per 128 of K, or one dynamic scale for the whole batch.
WEIGHTS_FP8 = "e4m3 block 128x128"
ACTIVATIONS = {"group": "e4m3 per-token-group 1x128", "tensor": "e4m3 per-tensor dynamic"}


def act_scaling() -> str | None:
    """The FP8 linear's activation scaling ("group" or "tensor"), or None when it is not loaded."""
    fp8 = sys.modules.get("isoaudit.kernels.fp8")
    return getattr(fp8, "_ACT_SCALING", None) if fp8 is not None else None


def quantization_facts(master_dtype: str | None, *, source: str | None = None) -> dict[str, Any]:
    """``{"quant": {...}}`` while the FP8 mode routes this process, else ``{}`` (nothing quantized).
    ``source``: the dtype the quantized weights are made from when it is not the masters' own (a
    bf16 export of fp32 masters)."""
    routing = sys.modules.get("isoaudit.kernels.dispatch")
    if routing is None or not routing.is_enabled() or not routing.is_fp8():
        return {}
    scaling = act_scaling() or "group"
    return {
        "quant": {
            "weights": WEIGHTS_FP8,
            "activations": ACTIVATIONS.get(scaling, scaling),
            "kv_cache": None,
            "source": source or master_dtype,
        }
    }


def effective_digests(model: nn.Module) -> dict[str, str]:
    """While the FP8 mode routes this process: the digest of each linear layer's *effective* weight
    (its 128x128 block quantization, dequantized to fp32: what the FP8 GEMM multiplies by), by
    checkpoint name, beside the masters' own digests; ``{}`` otherwise. Two sides that quantize
    the same masters the same way report equal effective digests; a bf16 export quantized against
    fp32 masters does not."""
    routing = sys.modules.get("isoaudit.kernels.dispatch")
    quant = sys.modules.get("isoaudit.kernels.fp8_quant")
    if routing is None or quant is None or not routing.is_enabled() or not routing.is_fp8():
        return {}
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    named = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and module is not head and module.weight.ndim == 2:
                q, scale = quant.quantize_weight(module.weight.detach())
                named.append((checkpoint_name(f"{name}.weight"), quant.dequantize_weight(q, scale)))
    return tensor_digests(named)


def quantizes_activations() -> bool:
    """Whether this process's forward quantizes activations now (the FP8 mode routes it)."""
    facts = quantization_facts(None).get("quant") or {}
    return bool(facts.get("activations"))
