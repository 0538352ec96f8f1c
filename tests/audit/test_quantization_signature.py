"""The signature functions of ``audit.quantization`` on Δ arrays of known shape, and how a side's
manifest facts read as its quantization."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.quantization import position_onset, quantization_difference, quantization_of, step_sized

from tests import factories


def test_position_onset_finds_where_the_sides_part() -> None:
    rng = np.random.default_rng(0)
    delta = np.concatenate([rng.normal(0, 1e-3, 5), rng.normal(0, 5e-2, 10)])
    assert position_onset(delta) == 5
    assert position_onset(rng.normal(0, 1e-3, 15)) is None  # never parts
    assert position_onset(rng.normal(0, 5e-2, 15) + 0.1) is None  # parts at once


def test_step_sized_differences() -> None:
    steps = np.repeat([0.0625, -0.0625, 0.125], 6)
    assert step_sized(steps)
    assert not step_sized(np.random.default_rng(1).normal(0, 1e-2, 18))


def test_kv_cache_dtype_reads_as_quantization() -> None:
    fp8 = factories.manifest("rollout", "engine_decode", runtime={"kv_cache_dtype": "fp8_e4m3"})
    auto = factories.manifest("rollout", "engine_decode", runtime={"kv_cache_dtype": "auto"})
    bf16 = factories.manifest("trainer", runtime={"dtype": "bfloat16"})
    assert quantization_of(fp8)["kv_cache"] == "fp8_e4m3"
    assert quantization_of(auto)["kv_cache"] is None
    assert quantization_difference(bf16, auto) is None
    found = quantization_difference(bf16, fp8)
    assert found is not None and found["differing"] == {"kv_cache": {"trainer": None, "rollout": "fp8_e4m3"}}
    assert found["symmetric"] is False
