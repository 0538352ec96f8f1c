"""The canonical regions of a decoder forward, in forward order (DESIGN.md, "Canonical regions").

Both sides name what they hook with these names, so a fingerprint of ``layers.3.mlp`` from the
trainer and one from the engine are comparable, and the comparator can walk regions in order.
"""

from __future__ import annotations

import re

#: Sub-regions of one decoder layer, in forward order.
LAYER_REGIONS: tuple[str, ...] = ("input_norm", "attn", "post_attn_norm", "mlp", "out")

#: What an MoE layer adds inside its ``mlp``: the fp32 router logits (the experts each
#: token chose travel on the sample records, ``SampleLogprobs.routes``), the chosen experts' outputs
#: per token in slot order, and their weighted combine (before any shared expert is added).
MOE_REGIONS: tuple[str, ...] = ("router", "experts", "combine")

#: Every sub-region of a layer in forward order: the MoE ones run after the post-attention norm,
#: before the ``mlp`` block's output.
_LAYER_ORDER: tuple[str, ...] = ("input_norm", "attn", "post_attn_norm", *MOE_REGIONS, "mlp", "out")

_LAYER = re.compile(r"^layers\.(0|[1-9][0-9]*)\.([a-z_]+)$")
_REGION_KEY = re.compile(r"^(?P<region>.*)#(?P<index>[0-9]+)$", re.DOTALL)
_HEAD = {"embed": 0}
_TAIL = {"final_norm": 2, "logits": 3}


def canonical_regions(num_layers: int) -> list[str]:
    """``embed``, the five regions of each layer, ``final_norm``, ``logits``."""
    if num_layers < 0:
        raise ValueError(f"num_layers: must be >= 0, got {num_layers}")
    layers = [f"layers.{i}.{sub}" for i in range(num_layers) for sub in LAYER_REGIONS]
    return ["embed", *layers, "final_norm", "logits"]


def moe_regions(layers: list[int] | range) -> list[str]:
    """The MoE regions of the given (MoE) layers, in forward order."""
    return [f"layers.{i}.{sub}" for i in layers for sub in MOE_REGIONS]


def region_order(name: str) -> tuple[int, int, int, str]:
    """Sort key in forward order: ``sorted(regions, key=region_order)`` walks the forward pass.

    Names outside the canonical set never break a sort: ``layers.<i>.<other>`` sorts after layer
    ``i``'s canonical regions, anything else after ``logits`` (by name). :func:`is_canonical` tells
    the two apart.
    """
    if name in _HEAD:
        return (_HEAD[name], 0, 0, "")
    if name in _TAIL:
        return (_TAIL[name], 0, 0, "")
    match = _LAYER.match(name)
    if match:
        sub = match.group(2)
        if sub in _LAYER_ORDER:
            return (1, int(match.group(1)), _LAYER_ORDER.index(sub), "")
        return (1, int(match.group(1)), len(_LAYER_ORDER), sub)
    return (len(_HEAD) + len(_TAIL) + 1, 0, 0, name)


def is_canonical(name: str, num_layers: int | None = None) -> bool:
    """Whether ``name`` is a canonical region (of a ``num_layers``-layer model, when given)."""
    key = region_order(name)
    if key[3] or key[0] > 3:
        return False
    return num_layers is None or key[0] != 1 or key[1] < num_layers


def region_key(region: str, forward_index: int) -> str:
    """One call of a region as the comparator's grid names it: ``layers.2.mlp`` for its first call
    (``forward_index`` 0), ``layers.2.mlp#1`` for its second. Region names hold no ``#``."""
    return region if forward_index == 0 else f"{region}#{forward_index}"


def parse_region_key(key: str) -> tuple[str, int]:
    """Inverse of :func:`region_key`: ``(region, forward_index)``; a key without a ``#<n>`` suffix
    is the region's first call."""
    match = _REGION_KEY.match(key)
    return (match["region"], int(match["index"])) if match else (key, 0)
