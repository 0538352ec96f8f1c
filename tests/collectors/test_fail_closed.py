"""``session(..., fail_closed=True)``: a job stops at its first step boundary once a compared step of
its run is known to hold a non-identical token; closing waits for the comparison and raises unless
every stored step compared identical; identical runs pass; without the option nothing raises."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from isoaudit.collectors.integrations.given import GivenLogprobs, watch_given
from isoaudit.collectors.sessions import MemoryDestination, NotIdentical, ParityUnverified

import isoaudit
from isoaudit import StepBatch

PROMPTS = [[5, 6, 7], [8, 9]]
COMPLETIONS = [[10, 11], [12, 13, 14]]
ROLLOUT = [np.array([-1.0, -2.0], np.float32), np.array([-0.5, -0.25, -3.0], np.float32)]


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ISOAUDIT_WORKER_INTERVAL_S", "0.1")
    for name in ("ISOAUDIT_URL", "ISOAUDIT_COMPARE", "ISOAUDIT_ALERT_RULES", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    return f"sqlite:///{tmp_path / 'isoaudit.db'}"


def sides(audit: isoaudit.Session) -> tuple[GivenLogprobs, GivenLogprobs]:
    return watch_given(audit, "rollout", framework="skyrl"), watch_given(audit, "trainer", framework="skyrl")


def record(sides: tuple[GivenLogprobs, GivenLogprobs], step: int, *, moved: float = 0.0) -> None:
    """One step of both sides; the trainer's second token of the first sample is ``moved`` nats off."""
    rollout, trainer = sides
    batch = StepBatch.padded(PROMPTS, COMPLETIONS)
    trainer_lp = torch.tensor([[-1.0, -2.0 - moved, 0.0], [-0.5, -0.25, -3.0]])
    rollout.record_step(step, batch, ROLLOUT)
    trainer.record_step(step, batch, trainer_lp, logprobs_layout="completion")


def test_the_job_stops_at_the_first_step_boundary_after_a_differing_step(url: str) -> None:
    audit = isoaudit.session("fc-stop", database_url=url, compare="thread", fail_closed=True, report=False)
    steps = 0
    with pytest.raises(NotIdentical) as raised:
        with audit:
            both = sides(audit)
            record(both, 0, moved=0.5)
            for steps in range(1, 300):  # noqa: B007  # how far the job got is asserted below
                time.sleep(0.1)
                record(both, steps)  # raises before recording, once step 0 is known to differ
    assert raised.value.step == 0 and raised.value.differing_tokens == 1
    assert raised.value.max_abs_delta == pytest.approx(0.5)
    assert "step 0 is not identical: differing tokens: 1 of 5, max |Δ| 0.5" in str(raised.value)
    assert steps < 100  # stopped within seconds, not at the end
    assert audit.close().run_id == "fc-stop"  # closed by the with block, without raising again


def test_an_identical_run_closes_cleanly(url: str) -> None:
    with isoaudit.session(
        "fc-same", database_url=url, compare="thread", fail_closed=True, report=False
    ) as audit:
        both = sides(audit)
        for step in range(3):
            record(both, step)
        audit.check()
    summary = audit.close()
    assert summary.comparison is not None and summary.comparison.compared == 3


def test_close_waits_for_the_comparison_and_raises(url: str) -> None:
    audit = isoaudit.session("fc-close", database_url=url, compare="thread", fail_closed=True, report=False)
    both = sides(audit)
    record(both, 0)
    record(both, 1, moved=0.125)
    record(both, 2)
    audit.check()  # nothing known yet: the comparison is behind
    with pytest.raises(NotIdentical, match="step 1 is not identical") as raised:
        audit.close()
    assert raised.value.differing_tokens == 1 and raised.value.max_abs_delta == pytest.approx(0.125)
    audit.close()  # idempotent: only the first close raises


def test_steps_nobody_compared_are_unverified(url: str) -> None:
    audit = isoaudit.session(
        "fc-none", database_url=url, compare="none", compare_timeout=0.3, fail_closed=True, report=False
    )
    record(sides(audit), 0)
    with pytest.raises(ParityUnverified) as raised:
        audit.close()
    assert raised.value.steps_left == 1


def test_a_run_with_no_compared_step_is_unverified(url: str) -> None:
    audit = isoaudit.session("fc-empty", database_url=url, compare="thread", fail_closed=True, report=False)
    rollout, _ = sides(audit)
    rollout.record_step(0, StepBatch.padded(PROMPTS, COMPLETIONS), ROLLOUT)  # the trainer never records
    with pytest.raises(ParityUnverified, match="no step of the run was compared"):
        audit.close()


def test_without_the_option_nothing_raises_and_memory_is_refused(url: str) -> None:
    with isoaudit.session("fc-off", database_url=url, compare="thread", report=False) as audit:
        record(sides(audit), 0, moved=0.5)
        audit.check()
    assert audit.close().comparison is not None
    with pytest.raises(ValueError, match="fail_closed"):
        isoaudit.session("fc-mem", destination=MemoryDestination(), fail_closed=True)
