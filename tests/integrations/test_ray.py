"""Trainer and rollout engine as Ray actors on a local cluster, each with a collector inside,
sending to one real `isoaudit serve` (its own process, comparison worker on); the store ends up
with both sides of every sample compared."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tests.service.processes import serve  # noqa: E402

RUN = "ray-grpo"
STEPS, PROMPTS, GROUP = 2, 2, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_actors_send_to_one_service_and_both_sides_are_compared(tiny_qwen3: Path, tmp_path: Path) -> None:
    import ray
    from isoaudit.audit.auth import create_token
    from isoaudit.audit.db import Store
    from isoaudit.collectors.integrations.ray import run_ray_job

    url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    store = Store(url)
    token = create_token(store, "ray")
    port = free_port()
    server = serve(url, port, worker=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = run_ray_job(
            tiny_qwen3,
            run=RUN,
            steps=STEPS,
            prompts=PROMPTS,
            group=GROUP,
            env={"ISOAUDIT_URL": f"http://127.0.0.1:{port}", "ISOAUDIT_TOKEN": token},
            session_args={"spool_dir": str(tmp_path / "spool")},
        )
        for side in ("rollout", "trainer"):
            summary = result[side][side]
            assert summary["sent"] > 0 and summary["dropped"] == summary["rejected"] == summary["errors"] == 0
        assert len(result["steps"]) == STEPS
        n = PROMPTS * GROUP
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the service's worker compares in the background
            steps = store.steps(RUN)
            if [(s.trainer_samples, s.rollout_samples, s.compared_samples) for s in steps] == [
                (n, n, n)
            ] * STEPS:
                break
            time.sleep(0.5)
        assert [
            (s.step, s.trainer_samples, s.rollout_samples, s.compared_samples) for s in store.steps(RUN)
        ] == [(step, n, n, n) for step in range(STEPS)]
        for step in range(STEPS):
            pairs = store.samples(RUN, step)
            assert {s.weight_version for s in pairs} == {str(step)}
    finally:
        ray.shutdown()
        server.terminate()
        server.wait(30)
        store.dispose()
