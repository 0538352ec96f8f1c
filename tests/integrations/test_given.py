"""Both sides recorded from logprobs a framework already holds (verl's, SkyRL's, OpenRLHF's
driver-side tensors; TRL's server mode): the store pairs them and the comparator measures them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from isoaudit.collectors.integrations.given import GivenLogprobs, watch_given

import isoaudit
from isoaudit import StepBatch

PROMPTS = [[5, 6, 7], [8, 9]]
COMPLETIONS = [[10, 11], [12, 13, 14]]


def test_both_given_sides_pair_and_compare(tmp_path: Path) -> None:
    from isoaudit.audit.db import Store
    from isoaudit.audit.worker import ComparisonWorker

    url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    rollout_lp = [np.array([-1.0, -2.0], np.float32), np.array([-0.5, -0.25, -3.0], np.float32)]
    trainer_lp = torch.tensor([[-1.0, -2.5, 0.0], [-0.5, -0.25, -3.0]])  # [samples, max completion]
    with isoaudit.session("given", database_url=url, strict=True, report=False) as audit:
        rollout = watch_given(audit, "rollout", framework="skyrl", weight_version=3)
        trainer = watch_given(audit, "trainer", framework="skyrl", weight_version=3)
        batch = StepBatch.padded(PROMPTS, COMPLETIONS, temperature=0.7)
        assert (
            rollout.record_step(4, batch, rollout_lp).sample_keys
            == trainer.record_step(4, batch, trainer_lp, logprobs_layout="completion").sample_keys
        )
    summary = audit.close()
    assert {side: s.sent for side, s in summary.sides.items()} == {"rollout": 4, "trainer": 4}
    assert summary.comparison is not None and (summary.comparison.compared, summary.comparison.left) == (1, 0)
    store = Store(url)
    try:
        assert ComparisonWorker(store).run_once("given") == 0  # the session compared its step before closing
        [result] = store.step_results("given")
        assert result.step == 4
        assert result.metrics["logprob_abs_diff_max"] == pytest.approx(0.5)
        assert result.metrics["logprob_abs_diff_mean"] == pytest.approx(0.5 / 5)
        manifests = store.manifests("given")
        assert {m.side for m in manifests} == {"trainer", "rollout"}
        assert all(m.runtime.framework == "skyrl" and "*" in m.unobserved for m in manifests)
        for sample in store.samples("given", 4):
            assert sample.weight_version == "3" and sample.temperature == pytest.approx(0.7)
    finally:
        store.dispose()


def test_a_given_side_cannot_switch_kernels_and_says_why() -> None:
    with isoaudit.session("given-mode", destination=isoaudit.MemoryDestination(), report=False) as audit:
        side = watch_given(audit, "rollout", framework="verl")
        report = side.set_mode("invariant")
        assert (report.requested, report.applied) == ("invariant", "native")
        assert "verl" in report.reason


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"side": "critic"}, "side"), ({"semantics": "logits"}, "semantics")]
)
def test_bad_arguments_name_the_field(kwargs: dict[str, str], field: str) -> None:
    from isoaudit.collectors.sinks import MemorySink

    args = {"side": "rollout", "run": "r", "sink": MemorySink(), "framework": "verl", **kwargs}
    with pytest.raises(ValueError, match=f"^{field}:"):
        GivenLogprobs(**args)
