"""The real vLLM engine (CPU build) with an FP8 KV cache against the HF bf16 trainer: every sample is
diagnosed ``quantization`` naming the KV cache, asymmetric (cannot be made exact), with the
prefill-token and decode differences reported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.vllm.conftest import engine  # noqa: E402
from tests.vllm.quant_kv import run_case  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[Any]:
    with engine(tiny_qwen3, kv_cache_dtype="fp8") as llm:
        yield llm


def test_fp8_kv_cache_is_diagnosed_quantization(llm: Any, tiny_qwen3: Path) -> None:
    found, tm, rm = run_case(llm, tiny_qwen3, "kv-fp8")
    assert rm.runtime.model_extra["kv_cache_dtype"].startswith("fp8")
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
