"""A session writing straight to a database compares its own run: nothing else started, alerts
evaluated by the configured rules, drained on close (bounded, with progress), never raising into the
job; off with ``compare="none"``; one comparer per run (rank 0's); none left behind when the job dies."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from isoaudit.audit.alerts.history import list_alerts
from isoaudit.audit.db import Backlog, Store
from isoaudit.collectors.comparer import compare_mode
from isoaudit.collectors.integrations.given import watch_given

import isoaudit
from isoaudit import StepBatch
from tests.service.processes import alive, children, wait_for

PROMPTS = [[5, 6, 7], [8, 9]]
COMPLETIONS = [[10, 11], [12, 13, 14]]
STEPS = 3
#: Fires on the job's 0.5 logprob gap from its first compared step.
RULES = "rules:\n  - {name: gap, metric: logprob_abs_diff_max, comparison: '>', threshold: 0.1, for: 1}\n"


def job(audit: isoaudit.Session, steps: int = STEPS) -> None:
    """Both sides from logprobs the job holds: the trainer's differ by 0.5 on one token per step."""
    rollout = watch_given(audit, "rollout", framework="skyrl")
    trainer = watch_given(audit, "trainer", framework="skyrl")
    batch = StepBatch.padded(PROMPTS, COMPLETIONS)
    rollout_lp = [np.array([-1.0, -2.0], np.float32), np.array([-0.5, -0.25, -3.0], np.float32)]
    trainer_lp = torch.tensor([[-1.0, -2.5, 0.0], [-0.5, -0.25, -3.0]])
    for step in range(steps):
        rollout.record_step(step, batch, rollout_lp)
        trainer.record_step(step, batch, trainer_lp, logprobs_layout="completion")


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    monkeypatch.setenv("ISOAUDIT_ALERT_RULES", str(rules))
    monkeypatch.setenv("ISOAUDIT_WORKER_INTERVAL_S", "0.1")
    for name in ("ISOAUDIT_URL", "ISOAUDIT_COMPARE", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    return f"sqlite:///{tmp_path / 'isoaudit.db'}"


def _workers_of(pid: int) -> list[int]:
    """The ``isoaudit worker`` children of ``pid``."""
    found = []
    for child in children(pid):
        try:
            if b"worker" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                found.append(child)
        except OSError:
            continue
    return found


def _nice(pid: int) -> int:
    """A process's nice value (/proc/PID/stat, field 19)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_the_session_compares_its_run_and_evaluates_alerts(url: str, mode: str, capsys) -> None:
    audit = isoaudit.session("own", database_url=url, compare=mode)  # type: ignore[arg-type]
    with audit:
        job(audit)
        if mode == "process":
            [comparer] = _workers_of(os.getpid())  # started with the first sink
            # It yields the CPU to the job and runs one BLAS thread (no spinning pools fighting torch's).
            wait_for(lambda: _nice(comparer) == 10, 30, "the comparer niced")
            assert b"OPENBLAS_NUM_THREADS=1" in Path(f"/proc/{comparer}/environ").read_bytes().split(b"\0")
    summary = audit.close()
    assert summary.comparison is not None
    assert (summary.comparison.compared, summary.comparison.left, summary.comparison.errors) == (STEPS, 0, 0)
    assert f"{STEPS} steps compared" in capsys.readouterr().err  # in the printed summary
    assert _workers_of(os.getpid()) == []  # stopped with the session
    store = Store(url)
    try:
        assert [r.step for r in store.step_results("own")] == list(range(STEPS))
        assert store.step_results("own")[0].metrics["logprob_abs_diff_max"] == pytest.approx(0.5)
        alerts = {a.rule: a for a in list_alerts(store, run_id="own")}
        assert alerts["gap"].state == "firing"  # the rules file's rule (the defaults fire too)
        assert store.backlog() == Backlog()
    finally:
        store.dispose()


def test_compare_none_leaves_the_steps_to_a_worker_and_other_ranks_start_none(url: str) -> None:
    with isoaudit.session("fleet", database_url=url, compare="none", report=False) as audit:
        job(audit)
    assert audit.close().comparison is None
    with isoaudit.session("ranked", database_url=url, rank=1, report=False) as audit:
        job(audit)
        assert _workers_of(os.getpid()) == []  # rank 0's session compares for the run
    assert audit.close().comparison is None
    store = Store(url)
    try:
        assert (store.backlog("fleet").steps, store.backlog("ranked").steps) == (STEPS, STEPS)
        assert store.compared_steps("fleet") == 0
    finally:
        store.dispose()


def test_the_mode_is_validated_naming_its_source(url: str) -> None:
    with pytest.raises(ValueError, match="^compare: expected one of process, thread, none, got 'sometimes'"):
        isoaudit.session("x", database_url=url, compare="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^ISOAUDIT_COMPARE: expected one of"):
        compare_mode(None, {"ISOAUDIT_COMPARE": "yes"})
    assert compare_mode(None, {"ISOAUDIT_COMPARE": "thread"}) == "thread" and compare_mode() == "process"
    with pytest.raises(ValueError, match="^compare_timeout: must be >= 0"):
        isoaudit.session("x", database_url=url, compare_timeout=-1)


def test_what_is_left_is_counted_and_its_command_compares_it(url: str, capsys) -> None:
    audit = isoaudit.session("hurried", database_url=url, compare_timeout=0)
    with audit:
        job(audit)
    comparison = audit.close().comparison
    assert comparison is not None and comparison.left is not None and comparison.left > 0
    path = url.removeprefix("sqlite:///")
    command = f"isoaudit worker --once --database-url 'sqlite:///{path}'"
    assert comparison.command == command and f"not yet: compare them with: {command}" in str(comparison)
    assert command in capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "isoaudit.cli", *shlex.split(command)[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    store = Store(url)
    try:
        assert store.backlog() == Backlog() and store.compared_steps("hurried") == STEPS
    finally:
        store.dispose()


def test_a_comparer_that_fails_never_raises_into_the_job(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys, caplog
) -> None:
    """Process mode with an interpreter that cannot start, thread mode with a rules file that does not
    parse: the job runs and closes, the wait is bounded and shows progress, the report counts the
    errors and names what is left and the command for it."""
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    audit = isoaudit.session("broken-process", database_url=url, compare_timeout=2.5, strict=True)
    started = time.monotonic()
    with audit:
        job(audit)
    summary = audit.close()
    assert time.monotonic() - started < 15
    assert summary.comparison is not None and summary.comparison.left == STEPS
    assert summary.comparison.errors >= 1
    err = capsys.readouterr().err
    assert f"isoaudit run broken-process: comparing, {STEPS} steps left" in err  # progress of a long wait
    assert "isoaudit worker --once --database-url" in err
    assert any("cannot start the comparison worker process" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()

    bad = Path(url.removeprefix("sqlite:///")).with_name("bad.yaml")
    bad.write_text("rules: [")
    monkeypatch.setenv("ISOAUDIT_ALERT_RULES", str(bad))
    audit = isoaudit.session(
        "broken-thread", database_url=url, compare="thread", compare_timeout=1, strict=True
    )
    with audit:
        job(audit)
    comparison = audit.close().comparison
    assert comparison is not None and comparison.left == STEPS and comparison.errors >= 1


def test_the_comparer_dies_with_a_killed_job(url: str, tmp_path: Path) -> None:
    """A job SIGKILLed mid-run takes its comparer process with it: no orphan keeps claiming steps."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            import isoaudit
            from tests.collectors.test_session_compares import job

            with isoaudit.session("killed", database_url={url!r}) as audit:
                job(audit)
                print("recorded", flush=True)
                time.sleep(600)
            """
        )
    )
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=root,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == b"recorded"
        wait_for(lambda: _workers_of(process.pid), 30, "the job's comparer process")
        [comparer] = _workers_of(process.pid)
        store = Store(url)
        try:
            wait_for(lambda: store.compared_steps("killed") == STEPS, 60, "the steps compared while it runs")
        finally:
            store.dispose()
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        gone = wait_for(lambda: not alive(comparer), 10, "the comparer gone with its job")
        print(f"the comparer was gone {gone:.2f} s after its job's SIGKILL")
    finally:
        if process.poll() is None:
            process.kill()


def _ctrl_c_as_from_a_shell() -> None:
    """The job's SIGINT as an interactive shell starts it: default and unblocked. A test run started
    in the background by a non-interactive shell (``make test &``, some CI runners) has SIGINT
    ignored, which every child inherits across exec; the job would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_stops_the_wait_and_the_summary_names_what_is_left(url: str, tmp_path: Path) -> None:
    """A closing job whose comparer cannot run waits up to ``compare_timeout``; Ctrl-C during that
    wait ends it at once, and the summary still says what is left and the command for it."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import faulthandler, signal, sys
            import isoaudit
            from tests.collectors.test_session_compares import job

            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where it hangs
            sys.executable = "/nonexistent/python"  # the comparer process cannot start
            with isoaudit.session("patient", database_url={url!r}, compare_timeout=120) as audit:
                job(audit)
            print("closed", flush=True)
            """
        )
    )
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(root)},
        text=True,
        preexec_fn=_ctrl_c_as_from_a_shell,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:  # progress of the wait, printed after 2 s
            if "comparing, 3 steps left" in line:
                break
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # say where every thread of the job waits
            process.send_signal(signal.SIGUSR1)
            time.sleep(1)
            process.kill()
            _, err = process.communicate()
            raise AssertionError(
                f"the job did not end 30 s after Ctrl-C; its threads:\n{err[-6000:]}"
            ) from None
        assert time.monotonic() - started < 15  # not the 120 s of compare_timeout
        assert process.returncode == 0 and out.strip() == "closed"
        assert "stopped waiting for the comparison" in err
        assert (
            "isoaudit run patient:" in err and "3 not yet: compare them with: isoaudit worker --once" in err
        )
    finally:
        if process.poll() is None:
            process.kill()
