"""The engine's ``quant`` fact from real vLLM quant configs built on the CPU (no engine, no GPU):
``Fp8Config``'s block and per-tensor schemes, the online shorthands' weight and activation keys, a
weight-only method, the KV-cache dtype; and how the comparator reads what they state."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from isoaudit.audit.quantization import quantization_difference  # noqa: E402
from isoaudit.collectors.vllm.worker.quant_facts import describe  # noqa: E402

from tests import factories  # noqa: E402

pytestmark = pytest.mark.vllm


def _online(name: str):
    from vllm.config.quantization import _ONLINE_SHORTHANDS
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    return OnlineQuantizationConfig(_ONLINE_SHORTHANDS[name])


def test_fp8_config_block_and_per_tensor() -> None:
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    block = describe(Fp8Config(weight_block_size=[128, 128]), "auto", torch.bfloat16)["quant"]
    assert block == {
        "weights": "e4m3 block 128x128",
        "activations": "e4m3 per-token-group 1x128 dynamic",
        "kv_cache": None,
        "source": "checkpoint",
    }
    dynamic = describe(Fp8Config(), "fp8", torch.bfloat16)["quant"]
    assert dynamic["weights"] == "e4m3 per-tensor"
    assert dynamic["activations"] == "e4m3 per-tensor dynamic" and dynamic["kv_cache"] == "fp8"
    static = describe(Fp8Config(activation_scheme="static"), "auto")["quant"]
    assert static["activations"] == "e4m3 per-tensor static"


def test_online_shorthands() -> None:
    per_tensor = describe(_online("fp8_per_tensor"), "auto", torch.bfloat16)["quant"]
    assert per_tensor == {
        "weights": "e4m3 per-tensor static",
        "activations": "e4m3 per-tensor dynamic",
        "kv_cache": None,
        "source": "bfloat16",  # quantized at load from the checkpoint's bf16 weights
    }
    per_block = describe(_online("fp8_per_block"), "auto", torch.bfloat16)["quant"]
    assert per_block["weights"] == "e4m3 block 128x128 static"
    assert per_block["activations"] == "e4m3 per-token-group 1x128 dynamic"
    per_channel = describe(_online("fp8_per_channel"), "auto", torch.bfloat16)["quant"]
    assert per_channel["activations"] == "e4m3 per-token dynamic"
    mx = describe(_online("mxfp8"), "auto", torch.bfloat16)["quant"]
    assert mx["weights"].startswith("mxfp8 group 1x32") and mx["activations"].startswith("mxfp8")
    weight_only = describe(_online("int8_per_channel_weight_only"), "auto", torch.bfloat16)["quant"]
    assert weight_only["weights"] == "int8 per-channel static" and weight_only["activations"] is None


def test_weight_only_method_and_kv_cache_alone() -> None:
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    awq = describe(AutoAWQConfig(4, 128, False, False), "auto")["quant"]
    assert awq["weights"] == "auto_awq 4-bit group 128" and awq["activations"] is None
    assert describe(None, "fp8_e4m3") == {
        "quant": {"weights": None, "activations": None, "kv_cache": "fp8_e4m3", "source": None}
    }
    assert describe(None, "auto") == {} and describe(None, "bfloat16") == {}


def test_comparator_reads_the_engine_fact() -> None:
    """Per-tensor dynamic activations are batch-mate dependent; static ones and per-token groups
    are not; an FP8 rollout against a bf16 trainer is asymmetric."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    trainer = factories.manifest("trainer", runtime={"dtype": "bfloat16"})
    cases = {
        "dynamic": (describe(Fp8Config(), "auto", torch.bfloat16), ["rollout"]),
        "static": (describe(Fp8Config(activation_scheme="static"), "auto", torch.bfloat16), []),
        "block": (describe(Fp8Config(weight_block_size=[128, 128]), "auto", torch.bfloat16), []),
    }
    for name, (facts, per_tensor) in cases.items():
        rollout = factories.manifest("rollout", "engine_decode", runtime=facts)
        found = quantization_difference(trainer, rollout)
        assert found is not None and found["per_tensor_dynamic"] == per_tensor, name
        assert set(found["differing"]) == {"weights", "activations"} and found["symmetric"] is False
