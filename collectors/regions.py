"""Canonical regions (DESIGN.md, "Canonical regions") mapped onto a model's module names.

A region is a module whose output we fingerprint, plus a *tap* that says how to read the canonical
tensor out of whatever the module returns. The taps exist because the two sides package the same
quantity differently: HF decoder layers return a tensor (or a tuple led by it), vLLM's return
``(hidden, residual)`` whose sum is the residual stream, and ``logits`` is compared in float32. The
trainer collector uses the HF family maps here; the vLLM collector declares its own maps with the same
:class:`RegionSpec` and :class:`Tap`, so both sides emit the same canonical names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch
from isoaudit.audit.regions import LAYER_REGIONS, MOE_REGIONS, canonical_regions, is_canonical, region_order
from torch import nn

#: Per-layer regions in forward order (DESIGN.md), as ``isoaudit.audit.regions`` defines them.
LAYER_PARTS: tuple[str, ...] = LAYER_REGIONS


class Tap(StrEnum):
    """How to read a region's tensor out of its module's output."""

    FIRST = "first"  # the tensor itself, or the first tensor of a tuple / ModelOutput
    SUM = "sum"  # first + second tensor: the residual stream of a layer returning (hidden, residual)
    FP32 = "fp32"  # the first tensor, cast to float32 (the canonical dtype of ``logits``)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):  # ModelOutput is an OrderedDict
        return [v for v in output.values() if isinstance(v, torch.Tensor)]
    if isinstance(output, list | tuple):
        return [v for v in output if isinstance(v, torch.Tensor)]
    return []


def read_tap(output: Any, tap: Tap, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """The canonical tensor of a module output as ``[rows, hidden]``, or ``None`` when the output has
    no tensor to read. ``rows`` (flat row indices) selects rows *before* any cast, so padding costs
    nothing and a float32 copy of the logits is made only of the rows kept."""
    found = _tensors(output)
    if not found:
        return None
    tensor = found[0] + found[1] if tap is Tap.SUM and len(found) > 1 else found[0]
    if rows is not None:
        tensor = tensor.reshape(-1, tensor.shape[-1]).index_select(0, rows)
    return tensor.float() if tap is Tap.FP32 else tensor


@dataclass(frozen=True)
class RegionSpec:
    """One canonical region bound to a module name of a concrete model."""

    name: str
    module: str
    tap: Tap = Tap.FIRST


@dataclass(frozen=True)
class FamilyMap:
    """Module-name templates of one model family; ``{i}`` stands for the layer index."""

    family: str
    layers: str  # the ModuleList of decoder layers (its length is the layer count)
    embed: str
    final_norm: str
    logits: str
    layer: Mapping[str, str]
    taps: Mapping[str, Tap] = field(default_factory=dict)  # keyed by "embed", "logits", a layer part, ...
    #: MoE families: templates of the MoE regions (``router``, ``experts``, ``combine``) a sparse
    #: layer has, and why this side cannot observe the others. A dense layer of the same
    #: model simply lacks the modules; :func:`resolve_regions` leaves them out there.
    moe: Mapping[str, str] = field(default_factory=dict)
    moe_unobserved: Mapping[str, str] = field(default_factory=dict)

    def specs(self, num_layers: int) -> list[RegionSpec]:
        """The region specs of a model with ``num_layers`` layers, in forward order."""
        specs = [RegionSpec("embed", self.embed, self.taps.get("embed", Tap.FIRST))]
        for i in range(num_layers):
            for part in LAYER_PARTS:
                if part == "mlp":  # the MoE regions run inside the mlp block, before its output
                    specs += [
                        RegionSpec(
                            f"layers.{i}.{sub}", self.moe[sub].format(i=i), self.taps.get(sub, Tap.FIRST)
                        )
                        for sub in MOE_REGIONS
                        if sub in self.moe
                    ]
                specs.append(
                    RegionSpec(
                        f"layers.{i}.{part}", self.layer[part].format(i=i), self.taps.get(part, Tap.FIRST)
                    )
                )
        specs.append(RegionSpec("final_norm", self.final_norm, self.taps.get("final_norm", Tap.FIRST)))
        specs.append(RegionSpec("logits", self.logits, self.taps.get("logits", Tap.FP32)))
        return specs


def llama_style_map(
    family: str, *, logits: str = "lm_head", taps: Mapping[str, Tap] | None = None
) -> FamilyMap:
    """The module names Llama-style decoders share, in HF and in vLLM alike: the attention output is
    ``o_proj``'s and a decoder layer's output is the residual stream after it. The two differ only in
    where the logits come from and in how some outputs are packaged (``taps``)."""
    return FamilyMap(
        family=family,
        layers="model.layers",
        embed="model.embed_tokens",
        final_norm="model.norm",
        logits=logits,
        layer={
            "input_norm": "model.layers.{i}.input_layernorm",
            "attn": "model.layers.{i}.self_attn.o_proj",
            "post_attn_norm": "model.layers.{i}.post_attention_layernorm",
            "mlp": "model.layers.{i}.mlp",
            "out": "model.layers.{i}",
        },
        taps=dict(taps or {}),
    )


def has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class Catalog:
    """One side's knowledge of model families: its maps by ``model_type``, the map it tries on a model
    it does not know, and how a module named in an explicit map is read."""

    side: str  # for messages: "trainer" or "vLLM"
    families: Mapping[str, FamilyMap]
    generic: Callable[[str], FamilyMap]
    tap_for: Callable[[str], Tap]
    model_noun: str = "model"  # for messages: what the hooked model is called on this side
    #: run on a model of an MoE family before its regions are bound (HF: add the per-slot tap)
    prepare_moe: Callable[[nn.Module], Any] | None = None

    def family_of(self, model: nn.Module, model_type: str | None) -> FamilyMap:
        if model_type is not None and model_type in self.families:
            return self.families[model_type]
        # An unregistered model laid out like Llama (many are) gets the same map, checked module by module.
        generic = self.generic(str(model_type or "unknown"))
        if has_module(model, generic.layers) and all(has_module(model, s.module) for s in generic.specs(1)):
            return generic
        raise ValueError(
            f"regions: no {self.side} map for model type {model_type!r} (known: {sorted(self.families)}); "
            "pass regions={canonical name: module name}"
        )


def hf_moe_map(family: str) -> FamilyMap:
    """HF's Qwen3-MoE / Mixtral layout: ``mlp`` is the sparse block, ``mlp.gate`` its router (its
    logits, read in fp32) and ``mlp.experts`` the fused experts, whose output is already the
    weighted combine; the per-slot expert outputs come out of ``mlp.experts.slots``, the tap
    :func:`isoaudit.kernels.adapters_moe.instrument` adds (see :func:`_instrument_moe`)."""
    dense = llama_style_map(family, taps={"router": Tap.FP32})
    return replace(
        dense,
        moe={
            "router": "model.layers.{i}.mlp.gate",
            "experts": "model.layers.{i}.mlp.experts.slots",
            "combine": "model.layers.{i}.mlp.experts",
        },
        moe_unobserved={
            "experts": "HF's fused experts module returns only the weighted combine (per-slot expert outputs stay inside it)"
        },
    )


def _instrument_moe(model: nn.Module) -> None:
    """Give an HF MoE model's experts their per-slot tap (``isoaudit.kernels.adapters_moe.instrument``)."""
    from isoaudit.kernels.adapters_moe import instrument

    instrument(model)


#: The trainer side: HF transformers families, keyed by ``config.model_type``.
HF_CATALOG = Catalog(
    side="trainer",
    families={
        **{name: llama_style_map(name) for name in ("llama", "qwen2", "qwen3", "mistral")},
        **{name: hf_moe_map(name) for name in ("qwen3_moe", "mixtral")},
    },
    generic=llama_style_map,
    tap_for=lambda name: Tap.FP32 if name == "logits" else Tap.FIRST,
    prepare_moe=_instrument_moe,
)


RegionsArg = str | Mapping[str, str] | Sequence[str] | None


@dataclass(frozen=True)
class ResolvedRegions:
    """What a collector hooks, and what it cannot observe (for the manifest)."""

    specs: list[RegionSpec]
    unobserved: dict[str, str]
    family: str | None = None

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]


def resolve_regions(
    model: nn.Module,
    regions: RegionsArg = "auto",
    *,
    model_type: str | None = None,
    catalog: Catalog = HF_CATALOG,
) -> ResolvedRegions:
    """Bind ``regions`` to ``model``'s modules.

    ``"auto"``: every canonical region, from the ``catalog``'s map of ``model_type`` (by default
    ``model.config.model_type``). A sequence of canonical names: that subset of the auto map. A
    mapping: canonical name → module name (any model). ``None`` or empty: no regions (logprobs only).
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
            if not has_module(model, module):
                raise ValueError(
                    f"regions: module {module!r} (for {name!r}) is not in the {catalog.model_noun}"
                )
            specs.append(RegionSpec(name, module, catalog.tap_for(name)))
        specs.sort(key=lambda s: region_order(s.name))
        return ResolvedRegions(specs, _missing(specs, _layer_count(specs)))
    if isinstance(regions, str) and regions != "auto":
        raise ValueError(f"regions: expected 'auto', a list of canonical names or a mapping, got {regions!r}")
    if model_type is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = catalog.family_of(model, model_type)
    if family.moe and catalog.prepare_moe is not None:
        catalog.prepare_moe(model)
    specs = family.specs(len(model.get_submodule(family.layers)))  # type: ignore[arg-type]  # get_submodule returns a Module; the layers' container is an nn.ModuleList
    moe_unobserved: dict[str, str] = {}
    if family.moe:  # MoE regions exist only in the sparse layers
        sparse = [s for s in specs if s.name.rsplit(".", 1)[-1] in MOE_REGIONS]
        specs = [s for s in specs if s not in sparse or has_module(model, s.module)]
        moe_layers = sorted({region_order(s.name)[1] for s in specs if s.name.endswith(".router")})
        hooked = {s.name for s in specs}
        moe_unobserved = {
            f"layers.{i}.{sub}": why
            for i in moe_layers
            for sub, why in family.moe_unobserved.items()
            if f"layers.{i}.{sub}" not in hooked
        }
    for spec in specs:
        if not has_module(model, spec.module):
            raise ValueError(
                f"regions: the {family.family} map names {spec.module!r} for {spec.name!r}, not in the model"
            )
    if not isinstance(regions, str):
        wanted = list(regions)
        known = {s.name for s in specs}
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise ValueError(
                f"regions: {unknown} are not regions of this model (it has {len(specs)} regions)"
            )
        specs = [s for s in specs if s.name in set(wanted)]
        unobserved = {name: "not requested" for name in known - set(wanted)}
        return ResolvedRegions(specs, {**moe_unobserved, **unobserved}, family.family)
    return ResolvedRegions(specs, moe_unobserved, family.family)


def _layer_count(specs: Sequence[RegionSpec]) -> int:
    layers = [region_order(s.name)[1] for s in specs if region_order(s.name)[0] == 1]
    return max(layers) + 1 if layers else 0


def _missing(specs: Sequence[RegionSpec], num_layers: int) -> dict[str, str]:
    have = {s.name for s in specs}
    return {name: "not in the region map" for name in canonical_regions(num_layers) if name not in have}
