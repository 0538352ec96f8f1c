"""What this process quantizes, for its manifest (``RuntimeFacts.quant``, read by
:mod:`isoaudit.audit.quantization`): the weight and activation formats with their scale granularity
and the dtype of the masters they are quantized from, while :mod:`isoaudit.kernels` routes linear
layers through its FP8 path. Read from already imported modules only (no import of the kernels)."""

from __future__ import annotations

import sys
from typing import Any

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
