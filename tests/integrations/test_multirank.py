"""Many ranks, one run: a data-parallel GRPO job under the real ``torchrun`` (three gloo processes,
DistributedDataParallel), each rank a trainer and an engine worker with its own
``isoaudit.session``, all sending to one real `isoaudit serve` with its comparison worker on.

Engine rank r samples its own prompt groups and trainer rank r trains on engine rank r + 1's, so no
sample is recorded by the same rank on both sides: the comparator must pair them by (run, step,
sample_key) alone. Rank 2's session closes after step 0 while the rank keeps training: the
service's per-rank counters (``GET /v1/runs/{id}/ranks``) show it stopped, the others current."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store

from tests.service.processes import serve

RUN = "dp-grpo"
WORLD, STEPS, GROUP = 3, 3, 2
STOP_RANK, STOP_AFTER = 2, 0


@pytest.mark.slow
def test_ranks_send_to_one_service_pair_across_ranks_and_a_stopped_rank_shows(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    store = Store(url)
    token = create_token(store, "dp")
    port = free_port()
    server = serve(url, port, worker=True, env={"ISOAUDIT_WORKER_INTERVAL_S": "0.1"})
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}"]
    command += [f"--master-port={free_port()}", "-m", "isoaudit.collectors.integrations.torchrun"]
    command += ["--model", str(tiny_qwen3), "--run-id", RUN, "--steps", str(STEPS), "--group", str(GROUP)]
    command += ["--stop-sending-rank", str(STOP_RANK), "--stop-sending-after", str(STOP_AFTER)]
    env = {**os.environ, "ISOAUDIT_URL": f"http://127.0.0.1:{port}", "ISOAUDIT_TOKEN": token}
    try:
        job = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
        assert job.returncode == 0, job.stderr[-4000:]
        ranks = {
            r["rank"]: r for r in (json.loads(line) for line in job.stdout.splitlines() if line[:1] == "{")
        }
        assert sorted(ranks) == list(range(WORLD))
        for rank, result in ranks.items():
            assert result["trained_from"] == [(rank + 1) % WORLD] * STEPS
            for side, summary in result["summary"].items():
                assert summary["sent"] > 0 and summary["dropped"] == summary["rejected"] == 0, (rank, side)
        # Steps up to STOP_AFTER have every rank's samples on both sides; later ones miss what rank 2
        # would have sent: its engine's samples (rollout) and its trainer's (engine rank 0's samples).
        full, partial = WORLD * GROUP, (WORLD - 2) * GROUP
        want = [
            (s, full if s <= STOP_AFTER else WORLD * GROUP - GROUP, full if s <= STOP_AFTER else partial)
            for s in range(STEPS)
        ]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = [(s.step, s.rollout_samples, s.compared_samples) for s in store.steps(RUN)]
            if got == want:
                break
            time.sleep(0.2)
        assert got == want
        for step in range(STEPS):  # every pair was recorded by two different ranks
            samples = store.samples(RUN, step)
            by_key: dict[str, dict[str, int]] = {}
            for s in samples:
                by_key.setdefault(str(s.sample_key), {})[s.side] = s.rank  # type: ignore[assignment]
            pairs = [sides for sides in by_key.values() if len(sides) == 2]
            assert pairs and all(p["rollout"] == (p["trainer"] + 1) % WORLD for p in pairs), (step, pairs)
        # Ranks finish a step at different moments, so a step may be compared as its pairs complete
        # (revision > 1); its last comparison covers every pair.
        assert [(r.step, r.n_samples) for r in store.step_results(RUN)] == [(s, c) for s, _, c in want]

        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}
        ) as api:
            response = api.get(f"/v1/runs/{RUN}/ranks")
        assert response.status_code == 200, response.text
        activity = {(r["side"], r["rank"]): r for r in response.json()}
        assert set(activity) == {(side, rank) for side in ("rollout", "trainer") for rank in range(WORLD)}
        for (side, rank), r in activity.items():
            last = STOP_AFTER if rank == STOP_RANK else STEPS - 1
            assert (r["last_step"], r["steps"], r["samples"]) == (last, last + 1, (last + 1) * GROUP), (
                side,
                r,
            )
            assert r["stopped"] is (rank == STOP_RANK) and r["steps_behind"] == STEPS - 1 - last
            assert r["processes"] and all(p.endswith(f"/{rank}") for p in r["processes"]), r["processes"]
        # The dashboard's run page: the table marks rank 2 stopped, its lines drop to zero.
        from isoaudit.dashboard.pages.run.ranks import rank_view

        rows, figure = rank_view(store, RUN)
        assert {(row["side"], row["rank"]): row["status"] for row in rows} == {
            (side, rank): "stopped" if rank == STOP_RANK else "sending"
            for side in ("rollout", "trainer")
            for rank in range(WORLD)
        }
        lines = {trace.name: list(trace.y) for trace in figure.data}
        for side in ("rollout", "trainer"):
            assert lines[f"{side}/{STOP_RANK}"] == [GROUP] * (STOP_AFTER + 1) + [0] * (STEPS - 1 - STOP_AFTER)
            assert lines[f"{side}/0"] == [GROUP] * STEPS
    finally:
        server.terminate()
        server.wait(30)
        store.dispose()
