"""HttpSink end to end: the real service over real HTTP, killed mid-run and restarted.

The training loop keeps its pace through the outage, records spool to disk, and after recovery every
record is in the store exactly once; the remediation mode set on the service reaches the trainer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from isoaudit.audit.api.app import create_app
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.settings import Settings
from isoaudit.collectors.control import ServiceControl
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import HttpSink
from isoaudit.collectors.trainer import attach

from tests.collectors.conftest import random_samples

RUN = "http-run"


def stored_count(store: Store, steps: int) -> int:
    n = len(store.manifests(RUN)) + (1 if store.get_run(RUN) else 0)
    for step in range(steps):
        n += len(store.samples(RUN, step)) + len(store.fingerprints(RUN, step))
    return n


def test_outage_mid_run_spools_and_everything_arrives_once(load, store: Store, tmp_path: Path) -> None:
    token = create_token(store, "proj")
    server = LiveServer(create_app(store, Settings(run_worker=False, default_alert_rules=False)))
    url = server.start()
    control = ServiceControl(RUN, url, token, interval=60.0)  # replies only: no poll in this test
    sink = HttpSink(
        url,
        token,
        spool_dir=tmp_path / "spool",
        timeout=2.0,
        backoff_initial=0.05,
        backoff_max=0.3,
        on_control=control.offer,
    )
    modes: list[str] = []
    model = load("qwen3")
    handle = attach(
        model,
        run=RUN,
        sink=sink,
        control=control,
        strict=True,
        keep_records=True,
        remediation_hook=lambda _m, mode: modes.append(mode),
    )
    prompts, completions = random_samples(4, seed=2)
    batch = StepBatch.padded(prompts, completions, temperature=0.9)
    produced, step_times = 2, []

    def step(i: int) -> None:
        nonlocal produced
        started = time.perf_counter()
        handle.begin_step(i)
        with torch.no_grad():
            model(**batch.model_inputs())
        produced += len(handle.record_step(i, batch).records)
        step_times.append(time.perf_counter() - started)

    try:
        for i in range(3):
            step(i)
        assert sink.flush(30) and sink.counters.spooled == 0
        healthy = max(step_times)

        server.stop()  # the service goes away mid-run
        for i in range(3, 8):
            step(i)
        assert not sink.flush(1.0)  # nothing can arrive now
        assert sink.counters.spooled > 0 and sink.counters.dropped == 0
        assert (
            max(step_times[3:]) < healthy + 1.5
        )  # the loop kept its pace (a stall would be the 2 s timeout, retried)

        server.start()
        assert sink.flush(30), sink.stats()
        assert sink.counters.replayed == sink.counters.spooled
        assert sink.counters.sent == produced and sink.counters.dropped == 0
        assert sink.counters.duplicates == 0  # nothing was sent twice
        assert stored_count(store, 8) == produced  # and all of it is stored
        assert handle.stats()["hook_errors"] == 0

        # The dashboard asks for the invariant kernels: the next ingest reply carries it, the
        # collector applies it at its step boundary and says so in a new manifest.
        store.set_control(RUN, "invariant", store.get_control(RUN).version)
        step(8)
        assert sink.flush(30)
        step(9)
        assert modes == ["invariant"] and handle.mode == "invariant"
        step(10)
        assert sink.flush(30)
        assert store.manifests(RUN, side="trainer")[-1].runtime.remediation == "invariant"
    finally:
        handle.detach()
        sink.close(timeout=5)
        server.stop()


def test_a_bad_token_is_refused_and_counted_not_raised(load, store: Store, tmp_path: Path) -> None:
    server = LiveServer(create_app(store, Settings(run_worker=False, default_alert_rules=False)))
    url = server.start()
    sink = HttpSink(url, "iso_0123456789abcdef_" + "x" * 30, spool_dir=tmp_path / "spool")
    try:
        handle = attach(load("llama"), run=RUN, sink=sink, regions=None, strict=True)
        prompts, completions = random_samples(2)
        handle.record_step(0, StepBatch.packed(prompts, completions))
        assert sink.flush(30)
        counters = sink.counters  # the run, its manifest(s) and both samples: every one refused, none spooled
        assert counters.sent == 0 and counters.spooled == 0 and counters.dropped == counters.queued >= 4
        handle.detach()
    finally:
        sink.close(timeout=5)
        server.stop()


def test_url_and_token_are_checked() -> None:
    with pytest.raises(ValueError, match="url"):
        HttpSink("localhost:8000", "t")
    with pytest.raises(ValueError, match="token"):
        HttpSink("http://localhost:8000", "")
