"""The engine's quantization, for its manifest's ``quant`` runtime fact (the mapping of
:data:`isoaudit.audit.quantization.QUANT_FIELDS` the comparator reads): weight and activation
formats with their scale granularity (static or dynamic; per-tensor, per-token, per-channel,
per-token-group or block), the KV cache's dtype, and where the quantized weights come from.

Read in the worker from vLLM's own configs: the quant config the engine built (``Fp8Config``'s
``weight_block_size`` and ``activation_scheme``; an online config's weight and activation quant
keys; any other method by its name and the bit width and group size it states) and the cache
config's ``cache_dtype``. Nothing quantized gives no fact at all, as on the trainer's side.
"""

from __future__ import annotations

from typing import Any

#: Scale granularity names, by vLLM's ``GroupShape`` (row, col); -1 spans the dimension.
_SHAPES = {(-1, -1): "per-tensor", (1, -1): "per-token", (-1, 1): "per-channel"}

#: Short names of quantized dtypes, by the torch dtype's name.
_DTYPES = {"float8_e4m3fn": "e4m3", "float8_e4m3fnuz": "e4m3", "float8_e5m2": "e5m2", "int8": "int8"}

#: Scale dtypes of plain (non-microscaling) formats.
_FLOAT_SCALES = {"float32", "float16", "bfloat16"}

#: Unquantized KV-cache dtypes (the cache keeps the model's float format).
_PLAIN_CACHE = {"auto", "bfloat16", "float16", "half", "float32", "float"}

#: The activations an online method quantizes dynamically by default, by its weights' format and
#: granularity (vLLM's online FP8 methods: per-tensor weights with a per-tensor dynamic activation
#: scale, blocks with per-token groups, per-channel weights with per-token scales; MXFP8 both in MX
#: groups). Other online methods leave activations unquantized or do not say: none is claimed.
_ONLINE_ACTIVATIONS = {
    ("e4m3", "per-tensor"): "e4m3 per-tensor dynamic",
    ("e4m3", "per-channel"): "e4m3 per-token dynamic",
    ("e4m3", "block"): "e4m3 per-token-group 1x{col} dynamic",
    ("mxfp8", "group"): "mxfp8 per-token-group 1x{col} dynamic",
}


def _dtype(value: Any) -> str:
    name = str(getattr(value, "name", None) or value).removeprefix("torch.")
    return _DTYPES.get(name, name)


def _format(key: Any) -> str:
    """A ``QuantKey``'s format: its dtype, or the microscaling family its scales make it (power-of-two
    scales, stored as E8M0 or its bytes, per 32 values: MXFP8/MXFP4; a second-level scale: NVFP4)."""
    base = _dtype(key.dtype)
    if getattr(key, "scale2", None) is not None:
        return "nvfp4"
    if _dtype(key.scale.dtype) not in _FLOAT_SCALES:
        return "mxfp8" if base == "e4m3" else "mxfp4"
    return base


def _granularity(shape: Any, operand: str) -> tuple[str, str]:
    """(words, kind) of a ``GroupShape`` for ``operand`` (weights or activations): ``per-tensor``,
    ``per-token``, ``per-channel``, a group (``group 1xN`` of a weight row, ``per-token-group 1xN``
    of an activation row) or ``block RxC``."""
    row, col = int(shape[0]), int(shape[1])
    if (row, col) in _SHAPES:
        return _SHAPES[(row, col)], _SHAPES[(row, col)]
    if row == 1:
        return (f"per-token-group 1x{col}" if operand == "activations" else f"group 1x{col}"), "group"
    return f"block {row}x{col}", "block"


def quant_key(key: Any, operand: str = "weights") -> str | None:
    """A vLLM ``QuantKey`` in words: ``"e4m3 per-tensor static"``, ``"e4m3 block 128x128 static"``."""
    if key is None:
        return None
    scale = key.scale
    granularity, _ = _granularity(scale.group_shape, operand)
    return f"{_format(key)} {granularity} {'static' if scale.static else 'dynamic'}"


def _fp8(config: Any) -> dict[str, str | None]:
    """vLLM's ``Fp8Config``: block weights with per-token-group dynamic activations, else per-tensor
    weight scales with per-tensor activation scales, static or dynamic (``activation_scheme``)."""
    block = getattr(config, "weight_block_size", None)
    scheme = str(getattr(config, "activation_scheme", "dynamic"))
    if block:
        rows, cols = (int(v) for v in block)
        return {
            "weights": f"e4m3 block {rows}x{cols}",
            "activations": f"e4m3 per-token-group 1x{cols} {scheme}",
        }
    return {"weights": "e4m3 per-tensor", "activations": f"e4m3 per-tensor {scheme}"}


def _online(config: Any) -> dict[str, str | None]:
    """vLLM's online quantization config (``quantization="fp8_per_tensor"`` and the like): the
    linear layers' spec, else the MoE layers'."""
    args = config.args
    spec = args.linear or args.moe
    if spec is None:  # per-layer targets: a shorthand name per pattern
        names = sorted(set((args.targets or {}).values()))
        return {"weights": "online " + ",".join(names) if names else "online", "activations": None}
    weights = quant_key(spec.weight)
    activations = quant_key(spec.activation, "activations")
    if activations is None and spec.weight is not None:
        shape = spec.weight.scale.group_shape
        _, kind = _granularity(shape, "weights")
        default = _ONLINE_ACTIVATIONS.get((_format(spec.weight), kind))
        activations = default.format(col=int(shape[1])) if default is not None else None
    return {"weights": weights, "activations": activations}


def _other(config: Any, method: str) -> dict[str, str | None]:
    """Any other method: its name, with the weight bit width and group size it states."""
    parts = [method]
    bits = getattr(config, "weight_bits", None)
    if isinstance(bits, int):
        parts.append(f"{bits}-bit")
    group = getattr(config, "group_size", None)
    if isinstance(group, int) and group > 0:
        parts.append(f"group {group}")
    scheme = getattr(config, "activation_scheme", None)
    return {"weights": " ".join(parts), "activations": f"{method} {scheme}" if scheme else None}


def describe(quant_config: Any, cache_dtype: Any, model_dtype: Any = None) -> dict[str, Any]:
    """``{"quant": {...}}`` for an engine with this quant config (None: unquantized weights), KV-cache
    dtype and model dtype; ``{}`` when nothing is quantized."""
    out: dict[str, str | None] = {"weights": None, "activations": None, "kv_cache": None, "source": None}
    if quant_config is not None:
        method = str(quant_config.get_name())
        if method == "fp8":
            out.update(_fp8(quant_config))
        elif method == "online":
            out.update(_online(quant_config))
        else:
            out.update(_other(quant_config, method))
        if method == "online":  # quantized at load from the checkpoint's float weights
            out["source"] = _dtype(model_dtype) if model_dtype is not None else None
        else:  # quantized offline: the checkpoint holds the quantized weights
            out["source"] = "checkpoint"
    cache = str(cache_dtype) if cache_dtype is not None else "auto"
    if cache.removeprefix("torch.") not in _PLAIN_CACHE:
        out["kv_cache"] = cache
    if not any(out[name] for name in ("weights", "activations", "kv_cache")):
        return {}
    return {"quant": out}


def quant_facts(vllm_config: Any) -> dict[str, Any]:
    """The ``quant`` fact of the engine ``vllm_config`` describes (:func:`describe`)."""
    return describe(
        getattr(vllm_config, "quant_config", None),
        vllm_config.cache_config.cache_dtype,
        vllm_config.model_config.dtype,
    )
