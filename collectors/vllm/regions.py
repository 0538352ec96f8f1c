"""The canonical regions on vLLM's own modules (DESIGN.md, "Canonical regions").

vLLM's Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) share module names, but package the
quantities differently from HF: a decoder layer returns ``(hidden, residual)`` whose *sum* is the
residual stream, ``RMSNorm(x, residual)`` fuses the residual add and returns ``(normed, x +
residual)`` (the first is the region), ``o_proj`` returns ``(out, bias)``, and the logits come from
``logits_processor`` outside the model's forward. The taps of :mod:`collectors.regions` read each of
these, so the engine emits exactly the trainer's canonical names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from audit.regions import canonical_regions, is_canonical, region_order
from collectors.regions import FamilyMap, RegionSpec, ResolvedRegions, Tap


def _vllm_decoder(family: str) -> FamilyMap:
    return FamilyMap(
        family=family,
        layers="model.layers",
        embed="model.embed_tokens",
        final_norm="model.norm",
        logits="logits_processor",
        layer={
            "input_norm": "model.layers.{i}.input_layernorm",
            "attn": "model.layers.{i}.self_attn.o_proj",
            "post_attn_norm": "model.layers.{i}.post_attention_layernorm",
            "mlp": "model.layers.{i}.mlp",
            "out": "model.layers.{i}",
        },
        taps={"out": Tap.SUM, "logits": Tap.FP32},
    )


#: vLLM families, keyed by the HF ``model_type`` of the checkpoint the engine serves.
VLLM_FAMILIES: dict[str, FamilyMap] = {
    name: _vllm_decoder(name) for name in ("llama", "mistral", "qwen2", "qwen3")
}


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _family(model: nn.Module, model_type: str | None) -> FamilyMap:
    if model_type in VLLM_FAMILIES:
        return VLLM_FAMILIES[model_type]
    generic = _vllm_decoder(str(model_type or "unknown"))
    if _has(model, generic.layers) and all(_has(model, s.module) for s in generic.specs(1)):
        return generic  # laid out like Llama (many vLLM models are): the same map, checked below
    raise ValueError(
        f"regions: no vLLM map for model type {model_type!r} (known: {sorted(VLLM_FAMILIES)}); "
        "pass regions={canonical name: module name}"
    )


def resolve_engine_regions(
    model: nn.Module, model_type: str | None, regions: str | Sequence[str] | Mapping[str, str] | None = "auto"
) -> ResolvedRegions:
    """Bind ``regions`` to the vLLM ``model``'s modules.

    ``"auto"``: every canonical region of the family map. A sequence of canonical names: that
    subset. A mapping canonical name → module name: any model (decoder layers ``layers.i.out`` are
    read as hidden + residual, ``logits`` as float32, everything else as the first tensor).
    ``None`` or empty: no regions.
    """
    if regions is None or (not isinstance(regions, str) and len(regions) == 0):
        return ResolvedRegions([], {"*": "no regions requested"})
    if isinstance(regions, Mapping):
        specs = []
        for name, module in regions.items():
            if not is_canonical(name):
                raise ValueError(
                    f"regions: {name!r} is not a canonical region name (e.g. embed, layers.0.mlp, logits)"
                )
            if not _has(model, module):
                raise ValueError(f"regions: module {module!r} (for {name!r}) is not in the engine's model")
            tap = Tap.FP32 if name == "logits" else Tap.SUM if name.endswith(".out") else Tap.FIRST
            specs.append(RegionSpec(name, module, tap))
        specs.sort(key=lambda s: region_order(s.name))
        layers = [region_order(s.name)[1] for s in specs if region_order(s.name)[0] == 1]
        have = {s.name for s in specs}
        missing = {
            n: "not in the region map"
            for n in canonical_regions(max(layers) + 1 if layers else 0)
            if n not in have
        }
        return ResolvedRegions(specs, missing)
    if isinstance(regions, str) and regions != "auto":
        raise ValueError(f"regions: expected 'auto', a list of canonical names or a mapping, got {regions!r}")
    family = _family(model, model_type)
    specs = family.specs(len(model.get_submodule(family.layers)))  # type: ignore[arg-type]
    for spec in specs:
        if not _has(model, spec.module):
            raise ValueError(
                f"regions: the vLLM {family.family} map names {spec.module!r} for {spec.name!r}, not in the model"
            )
    if isinstance(regions, str):
        return ResolvedRegions(specs, {}, family.family)
    wanted = set(regions)
    unknown = sorted(wanted - {s.name for s in specs})
    if unknown:
        raise ValueError(f"regions: {unknown} are not regions of this model (it has {len(specs)} regions)")
    unobserved = {s.name: "not requested" for s in specs if s.name not in wanted}
    return ResolvedRegions([s for s in specs if s.name in wanted], unobserved, family.family)
