"""The control of the FP8 KV-cache test: the same engine and trainer with a bf16 KV cache is never
diagnosed ``quantization``."""

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
    with engine(tiny_qwen3, kv_cache_dtype="bfloat16") as llm:
        yield llm


def test_bf16_kv_cache_is_not_quantization(llm: Any, tiny_qwen3: Path) -> None:
    found, tm, rm = run_case(llm, tiny_qwen3, "kv-bf16")
    assert rm.runtime.model_extra["kv_cache_dtype"] == "bfloat16"
    kinds = [c.diagnosis.kind for c in found]
    print(kinds, [c.diagnosis.sentence for c in found])
    assert "quantization" not in kinds and set(kinds) <= {"numerical", "clean"}, kinds
