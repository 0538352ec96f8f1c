"""`isoaudit serve` runs the comparison worker and alert evaluation as a child process it supervises
(in the API's process it would share one GIL with request handling): the child compares what is
ingested, is restarted when it dies, stops when the API stops, and dies with the API when the API
is SIGKILLed (no orphan left claiming steps)."""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.records import Batch

from tests import factories
from tests.service.processes import alive, children, serve, wait_for
from tests.service.workload import step_records


@pytest.mark.slow
def test_serve_supervises_its_worker_process_and_takes_it_down_with_itself(database_url: str):
    store = Store(database_url)
    token = create_token(store, "alpha")
    port = free_port()
    env = {"ISOAUDIT_WORKER_INTERVAL_S": "0.05", "ISOAUDIT_DEFAULT_ALERT_RULES": "0"}
    api = serve(database_url, port, worker=True, env=env)
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )

    def compared(step: int) -> bool:
        steps = {s["step"]: s for s in http.get("/v1/runs/run-1/steps").json()}
        return step in steps and steps[step]["compared_samples"] == 4

    def ingest(step: int) -> None:
        records = ([factories.run()] if step == 0 else []) + step_records(step, 0.01)
        body = Batch(records=records).model_dump_json()
        assert http.post("/v1/ingest", content=body).status_code == 200

    try:
        [first] = children(api.pid)
        ingest(0)
        wait_for(lambda: compared(0), 60, "step 0 compared by the child")
        assert api.poll() is None and alive(first)

        subprocess.run(["kill", "-9", str(first)], check=True)  # the worker dies: restarted
        restarted = wait_for(lambda: [c for c in children(api.pid) if c != first], 30, "a new worker")
        [second] = children(api.pid)
        ingest(1)
        wait_for(lambda: compared(1), 60, "step 1 compared by the restarted child")

        api.send_signal(signal.SIGTERM)  # the API stops: its worker stops with it
        assert api.wait(60) == -signal.SIGTERM  # after a graceful shutdown, as uvicorn ends
        assert not alive(second)

        api = serve(database_url, port, worker=True, env=env)
        [third] = children(api.pid)
        api.send_signal(signal.SIGKILL)  # the API dies: the kernel takes its worker down too
        api.wait(10)
        orphan_gone = wait_for(lambda: not alive(third), 10, "the orphaned worker to die")
    finally:
        http.close()
        if api.poll() is None:
            api.kill()
            api.wait(10)
        store.dispose()
    print(
        f"\nworker process: restarted {restarted:.1f} s after its SIGKILL; gone with the API's "
        f"SIGTERM; gone {orphan_gone:.2f} s after the API's SIGKILL"
    )
