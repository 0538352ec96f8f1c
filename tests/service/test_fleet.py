"""bench/fleet.py (the "Fleet" figures of docs/scale.md) runs end to end at a tiny size: two real
`isoaudit serve` replicas, `isoaudit worker` processes, HttpSink collectors, retention, the one-worker
sweep, on PostgreSQL. What it asserts is counted, not timed: every step sent is stored and compared
once, nothing is dropped, and retention removes exactly what the policy names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fleet.py"
# --tiny: 2 jobs x 3 steps of 4 samples (x 2 sides), fingerprints of 2 samples per side over a
# 1-layer model's 8 regions at steps 0 and 2, 3 of 4 samples clean; retention --raw-days 0
# --fingerprint-steps 1; sweep of 2 and 4 samples, 2 steps each.
JOBS, STEPS, SAMPLES, REGIONS = 2, 3, 4, 8


@pytest.mark.postgres
@pytest.mark.slow
def test_fleet_bench_runs_at_a_tiny_size() -> None:
    if not os.environ.get("ISOAUDIT_TEST_POSTGRES_URL"):
        pytest.skip("ISOAUDIT_TEST_POSTGRES_URL is not set (make test sets it)")
    command = [sys.executable, str(BENCH), "--tiny", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    fleet = figures["fleet"]
    steps = JOBS * STEPS
    assert fleet["steps_sent"] == fleet["steps_compared"] == steps and fleet["drained"]
    assert fleet["dropped"] == 0
    assert sum(fleet["steps_per_worker"]) == steps  # each step compared by one worker, once
    for lag in fleet["lag"].values():
        assert lag["n"] == steps and 0 <= lag["p50"] <= lag["p95"] <= lag["max"]
    assert fleet["ingest_samples_per_s"] > 0 and fleet["compare_tokens_per_s"] > 0
    # --raw-days 0: every sample record goes once compared, midway or after the drain.
    midway = fleet["retention_midway"]
    assert midway["samples_deleted"] + fleet["samples_deleted"] == steps * SAMPLES * 2
    # Step 0's two fingerprinted samples are clean: one keeps its fingerprints (the control), the
    # other loses them, both sides; step 2 is within the newest step kept in full.
    assert midway["fingerprints_deleted"] + fleet["fingerprints_deleted"] == JOBS * REGIONS * 2
    assert 0 < fleet["arrays_after"] < fleet["arrays_total"]
    sweep = figures["sweep"]
    assert [p["samples"] for p in sweep][:1] == [2]
    assert all(p["steps_sent"] == 2 and isinstance(p["keeps_up"], bool) for p in sweep)
    assert all(p["steps_compared"] == 2 and p["lag"]["stored_compared"]["n"] == 2 for p in sweep)
    assert "one worker" in done.stderr
