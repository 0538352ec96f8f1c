"""Held-weight digests (``collectors.held_weights``): what they depend on, a hand-computed value,
the trainer's manifest at attach and at a version change, and the engine's fused-name split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from isoaudit.collectors.held_weights import ROW, checkpoint_name, module_digests, tensor_digests
from isoaudit.collectors.held_weights import _splitmix64 as splitmix64
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import TrainerCollector
from isoaudit.collectors.vllm.weights import trainer_parts
from torch import nn


def reference(tensor: torch.Tensor) -> int:
    """The digest by hand, in Python integers: Σ_r b_r Σ_c w_rc a_c mod 2**64 over 16-bit words."""
    words = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().view(np.int16).astype(np.int64).tolist()
    a = ((splitmix64(np.arange(ROW), 0x1D0A0D17) >> np.uint64(44)) | np.uint64(1)).tolist()
    rows = (len(words) + ROW - 1) // ROW
    b = (splitmix64(np.arange(rows), 0x5EED0B1E) | np.uint64(1)).tolist()
    total = 0
    for r in range(rows):
        chunk = words[r * ROW : (r + 1) * ROW]
        total += b[r] * sum(w * a[c] for c, w in enumerate(chunk))
    return total % 2**64


def value(digest: str) -> int:
    return int(digest.rpartition(":")[2], 16)


@pytest.mark.parametrize("shape", [(3,), (7, 300), (2, ROW + 5)], ids=["tiny", "tail", "rows+tail"])
def test_digest_is_the_hand_computed_value(shape: tuple[int, ...]) -> None:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    [(name, digest)] = tensor_digests([("w", t)]).items()
    assert digest.startswith(f"bfloat16[{','.join(map(str, shape))}]:")
    assert value(digest) == reference(t)


def test_a_slice_digests_like_the_tensor_it_equals() -> None:
    fused = torch.randn(96, 64).to(torch.bfloat16)
    out = tensor_digests([("k", fused[32:64]), ("copy", fused[32:64].clone()), ("q", fused[:32])])
    assert out["k"] == out["copy"] != out["q"]


def test_every_single_word_change_and_row_order_change_the_digest() -> None:
    t = torch.randn(5, ROW + 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    base = tensor_digests([("t", t)])["t"]
    words = t.view(torch.int16)
    for flat in [0, 1, ROW - 1, ROW, 3 * ROW + 17, t.numel() - 1]:
        changed = words.clone().reshape(-1)
        changed[flat] ^= 1  # the lowest mantissa bit of one element
        assert tensor_digests([("t", changed.view(torch.bfloat16).reshape(t.shape))])["t"] != base
    swapped = t.clone()
    swapped[[0, 1]] = t[[1, 0]]
    assert tensor_digests([("t", swapped)])["t"] != base


def test_dtype_and_shape_are_named_apart_from_the_bytes() -> None:
    t = torch.randn(4, 8).to(torch.bfloat16)
    out = tensor_digests([("bf16", t), ("fp32", t.float()), ("flat", t.reshape(-1))])
    assert out["bf16"].startswith("bfloat16[4,8]:") and out["fp32"].startswith("float32[4,8]:")
    assert value(out["bf16"]) == value(out["flat"])  # same bytes; the label tells the shapes apart
    assert out["bf16"] != out["flat"]


def test_checkpoint_names_drop_wrapper_prefixes() -> None:
    assert (
        checkpoint_name("module._orig_mod.model.layers.0.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 16, bias=False)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.proj(self.embed(input_ids))


def test_the_trainer_manifest_carries_digests_at_attach_and_after_a_version_change() -> None:
    model = Tiny()
    sink = MemorySink()
    handle = TrainerCollector(model, run="held", sink=sink, regions=None, strict=True)
    first = handle.manifest
    assert first is not None and set(first.weight_tensor_digests) == {"embed.weight", "proj.weight"}
    assert first.weight_tensor_digests == module_digests(model)
    with torch.no_grad():
        model.proj.weight.add_(1.0)
    handle.weights_changed("1")
    second = handle.manifest
    assert second is not None and second.weight_version == "1"
    assert second.weight_tensor_digests["embed.weight"] == first.weight_tensor_digests["embed.weight"]
    assert second.weight_tensor_digests["proj.weight"] != first.weight_tensor_digests["proj.weight"]
    handle.detach()


class Fused(nn.Module):
    """What vLLM's QKVParallelLinear exposes: output_sizes of the fused rows (tp 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.output_sizes = [64, 32, 32]
        self.tp_size = 1
        self.weight = nn.Parameter(torch.randn(128, 16))


def test_a_fused_engine_parameter_is_named_in_the_trainers_vocabulary() -> None:
    module = Fused()
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    parts = dict(
        trainer_parts("model.layers.3.self_attn.qkv_proj", module, "weight", module.weight.data, packed)
    )
    assert list(parts) == [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(parts["model.layers.3.self_attn.k_proj.weight"], module.weight.data[64:96])
    # a module not in the mapping keeps its name
    assert [n for n, _ in trainer_parts("model.norm", module, "weight", module.weight.data, packed)] == [
        "model.norm.weight"
    ]
