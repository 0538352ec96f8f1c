"""The control of the FP8 KV-cache test: the same engine and trainer with a bf16 KV cache is never
diagnosed ``quantization`` and states no ``quant`` fact; the batch probe, asked for, runs on vLLM's
bf16 path and what it records (0 where vLLM-CPU's forward does not depend on the batch) is no
quantization evidence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from isoaudit.audit.quantization import BATCH_PROBE  # noqa: E402

from tests.vllm.conftest import engine  # noqa: E402
from tests.vllm.quant_kv import LAST, run_case  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[Any]:
    with engine(tiny_qwen3, kv_cache_dtype="bfloat16") as llm:
        yield llm


def test_bf16_kv_cache_is_not_quantization(llm: Any, tiny_qwen3: Path) -> None:
    found, tm, rm = run_case(llm, tiny_qwen3, "kv-bf16", batch_probe="always")
    assert rm.runtime.model_extra["kv_cache_dtype"] == "bfloat16"
    assert "quant" not in rm.runtime.model_extra
    kinds = [c.diagnosis.kind for c in found]
    print(kinds, [c.diagnosis.sentence for c in found])
    assert "quantization" not in kinds and set(kinds) <= {"numerical", "clean"}, kinds
    stats, samples = LAST["rollout_stats"], LAST["rollout_samples"]
    probed = [s.path[BATCH_PROBE] for s in samples if BATCH_PROBE in s.path]
    print("vllm bf16 batch probe", probed, {k: v for k, v in stats.items() if "probe" in k})
    assert stats["batch_probe_samples"] == 2 and stats["batch_probe_errors"] == 0 and len(probed) == 2
    # vLLM-CPU's bf16 forward of these sequences does not depend on the batch composition
    assert probed == [0.0, 0.0]
