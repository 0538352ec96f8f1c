"""The compiled-engine acceptance of :mod:`tests.vllm.test_compiled_inprocess` with the engine's
workers in other processes (the isoaudit worker extension, ``collective_rpc``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.vllm.compiled_flow import run_flow  # noqa: E402
from tests.vllm.test_compiled_inprocess import check_compiled_flow  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def flow(tiny_qwen3: Path) -> dict[str, Any]:
    return run_flow(tiny_qwen3, processes=True)


def test_compiled_engine_in_worker_processes(flow: dict[str, Any]) -> None:
    assert flow["stats"].get("link", "worker_extension") is not None
    check_compiled_flow(flow)
