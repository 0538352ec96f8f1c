"""bench/scale.py (the figures of docs/scale.md) runs end to end at a tiny size: real `isoaudit serve`
processes, the worker, one and two replicas. The full 512 x 8k measurement is a bench, not a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


@pytest.mark.slow
def test_scale_bench_runs_at_a_tiny_size() -> None:
    command = [sys.executable, str(BENCH), "--tiny", "--database", "sqlite", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    cost = figures["cost"]
    assert cost["wire"] > figures["raw_bytes"]  # base64 in JSON costs more than the arrays
    assert cost["rest"] > 0 and cost["ingest"] > 0 and cost["compare"] > 0
    assert cost["fingerprints"]["records"] == 2 * 8  # one sample per side over a 1-layer model's 8 regions
    assert figures["one"]["samples_per_s"] > 0 and figures["two"]["samples_per_s"] > 0
    assert "two replicas against one" in done.stdout
