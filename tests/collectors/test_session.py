"""isoaudit.isoaudit.session: where records go (arguments, then the environment, then SQLite), both sides
attached through one session, control applied at each side's next step, and close() detaching
everything, idempotently, with a summary per side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from isoaudit.collectors.sessions import DatabaseDestination, ServiceDestination, destination_from

import isoaudit
from isoaudit import MemoryDestination, StepBatch


def test_destination_from_arguments_then_environment_then_sqlite(tmp_path: Path) -> None:
    env = {"ISOAUDIT_URL": "http://isoaudit:8000", "ISOAUDIT_TOKEN": "iso_x"}
    service = destination_from(environ=env)
    assert isinstance(service, ServiceDestination) and service.url == "http://isoaudit:8000"
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert isinstance(destination_from(database_url=db, environ=env), DatabaseDestination)  # explicit wins
    direct = destination_from(environ={"ISOAUDIT_DATABASE_URL": "postgresql://h/db"})
    assert isinstance(direct, DatabaseDestination) and direct.url == "postgresql+psycopg://h/db"
    assert destination_from(environ={}).url == "sqlite:///./isoaudit.db"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="token: .*tokens create"):
        destination_from(environ={"ISOAUDIT_URL": "http://isoaudit:8000"})


def _engine(model: torch.nn.Module):
    from isoaudit.kernels.adapters import HFCausalLM
    from isoaudit.kernels.engine import RolloutEngine

    return RolloutEngine(HFCausalLM(model), max_len=64)


def test_both_sides_switch_at_their_next_step_and_close_detaches_everything(load) -> None:
    model = load("qwen3")
    engine = _engine(model)
    switched: list[tuple[str, str]] = []
    audit = isoaudit.session("s-1", destination=MemoryDestination(), strict=True, report=False)
    audit.start()  # without `with`, as a framework callback would
    trainer = audit.watch_trainer(
        model, regions=["embed"], remediation_hook=lambda _m, m: switched.append(("t", m))
    )
    rollout = audit.watch_engine(
        engine, regions=["embed"], remediation_hook=lambda _m, m: switched.append(("e", m))
    )
    prompts = [[5, 6, 7], [8, 9]]
    for step in range(3):
        if step == 1:
            audit.control.set("invariant")  # type: ignore[attr-defined]
        trainer.begin_step(step)
        completions = engine.generate(prompts, [3, 2], seed=step)
        assert rollout.mode == ("invariant" if step >= 1 else "native")  # switched before its forward
        rollout.record_step(step, completions)
        with torch.no_grad():
            trainer.record_step(step, StepBatch.padded(prompts, [c.tokens for c in completions]))
        assert trainer.mode == ("invariant" if step >= 1 else "native")
    assert switched == [
        ("t", "invariant"),
        ("e", "invariant"),
    ]  # each once: the trainer's begin_step came first
    audit.weights_changed(7, "d" * 64)
    sinks = audit.destination.sinks  # type: ignore[attr-defined]
    summary = audit.close()
    assert audit.close() is summary  # idempotent
    assert summary.sides["trainer"].sent > 0 and summary.sides["rollout"].sent > 0
    assert all(s.dropped == 0 and s.rejected == 0 and s.errors == 0 for s in summary.sides.values())
    assert str(summary).startswith("isoaudit run s-1: trainer sent")
    manifests = {side: sinks[side].of_kind("manifest") for side in ("trainer", "rollout")}
    for side, found in manifests.items():
        assert found[-1].runtime.remediation == "invariant" and found[-1].runtime.control_version == 1, side
        assert (found[-1].weight_version, found[-1].weight_digest) == ("7", "d" * 64)
    keys = {side: {s.sample_key for s in sinks[side].of_kind("sample")} for side in sinks}
    assert keys["trainer"] == keys["rollout"] and len(keys["trainer"]) == 6  # 2 samples x 3 steps
    # Every hook is gone: the model and the engine are as before.
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "generate" not in vars(engine) and "step" not in vars(engine.model)
    trainer.detach()  # a second detach is harmless
    with pytest.raises(RuntimeError, match="closed"):
        audit.watch_trainer(model)


def test_a_side_that_cannot_switch_says_so(load) -> None:
    model = load("llama")
    with isoaudit.session("s-2", destination=MemoryDestination(), strict=True, report=False) as audit:
        trainer = audit.watch_trainer(model, regions=None, remediation_hook=None)
        audit.control.set("invariant")  # type: ignore[attr-defined]
        batch = StepBatch.padded([[1, 2, 3]], [[4, 5]])
        with torch.no_grad():
            trainer.record_step(0, batch)
        report = trainer.mode_report
        assert (report.requested, report.applied) == (
            "invariant",
            "native",
        ) and "remediation_hook" in report.reason
        trainer.record_step(1, batch)
        sink = audit.destination.sinks["trainer"]  # type: ignore[attr-defined]
    latest = sink.of_kind("manifest")[-1].runtime
    assert (latest.remediation, latest.remediation_requested) == ("native", "invariant")
    assert "remediation_hook" in latest.remediation_native


def test_direct_writes_by_default_read_control_from_the_store(load, tmp_path: Path, monkeypatch) -> None:
    from isoaudit.audit.db import Store

    url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    monkeypatch.delenv("ISOAUDIT_URL", raising=False)
    monkeypatch.setenv("ISOAUDIT_DATABASE_URL", url)
    model = load("qwen3")
    applied: list[str] = []
    with isoaudit.session("s-3", control_interval=0.0, report=False) as audit:
        trainer = audit.watch_trainer(model, regions=None, remediation_hook=lambda _m, m: applied.append(m))
        batch = StepBatch.padded([[1, 2, 3, 4]], [[5, 6, 7]])
        with torch.no_grad():
            trainer.record_step(0, batch, logprobs=[np.full(3, -0.5, np.float32)])
        assert audit.flush(30)
        store = Store(url)
        store.set_control("s-3", "invariant", 0)
        with torch.no_grad():
            trainer.record_step(1, batch)
        assert applied == ["invariant"]
    assert store.manifests("s-3", side="trainer")[-1].runtime.remediation == "invariant"
    assert len(store.samples("s-3", 0)) == 1
    store.dispose()


def test_control_never_raises_and_backs_off_while_the_service_is_down(caplog) -> None:
    import socket
    import time

    from isoaudit.collectors.control import Control, ServiceControl

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    channel = ServiceControl("r", f"http://127.0.0.1:{port}", "iso_x", interval=0.0, timeout=0.5)
    started = time.perf_counter()
    assert channel.desired() is None and channel.desired() is None  # the second is inside the backoff
    assert time.perf_counter() - started < 2.0
    assert sum("cannot read run 'r'" in r.getMessage() for r in caplog.records) == 1
    channel.offer(Control(mode="invariant", version=3))  # an ingest reply still gets through
    channel.offer(Control(mode="native", version=2))  # an older version never wins
    assert channel.desired() == Control(mode="invariant", version=3)
    channel.close()


def test_a_hung_service_holds_the_step_at_most_the_control_wait() -> None:
    """A service that accepts connections but never answers (a frozen process) must not hold the
    job for the client's timeout: the refresh goes on in the background, the step waits ``wait``."""
    import socket
    import time

    from isoaudit.collectors.control import Control, ServiceControl

    with socket.create_server(("127.0.0.1", 0)) as hung:  # listens (the kernel accepts), never reads
        port = hung.getsockname()[1]
        channel = ServiceControl("r", f"http://127.0.0.1:{port}", "iso_x", interval=0.0, timeout=3.0)
        channel.wait = 0.05
        took = []
        for _ in range(20):  # twenty steps while one refresh hangs for its 3 s timeout
            started = time.perf_counter()
            assert channel.desired() is None
            took.append(time.perf_counter() - started)
        assert max(took) < 0.5 and sum(took) < 1.0, took  # not 3 s, and not 0.05 s at every step
        channel.offer(Control(mode="invariant", version=1))  # an ingest reply still gets through meanwhile
        assert channel.desired() == Control(mode="invariant", version=1)
        channel.close()


def test_session_options_name_every_keyword_of_session() -> None:
    """Adapters pass ``SessionOptions`` on to ``session``: the two list the same keywords."""
    import inspect

    from isoaudit.collectors.sessions import SessionOptions, session

    keywords = set(inspect.signature(session).parameters) - {"run"}
    assert set(SessionOptions.__annotations__) == keywords
