"""A side recorded from logprobs the framework already computed, with no model or engine hooked.

Where a job's engine runs out of reach (a vLLM server in another Ray actor, TRL's ``vllm_mode=
"server"``) or the driver holds tensors but no model (verl's ``RayPPOTrainer``, SkyRL's
``on_step_end`` batch), the framework still has each sample's tokens and both sides' logprobs:
verl's ``rollout_log_probs`` / ``old_log_probs``, SkyRL's ``rollout_logprobs`` /
``action_log_probs``, OpenRLHF's ``rollout_log_probs`` / ``action_log_probs``. This collector
turns them into the same :class:`~isoaudit.audit.records.SampleLogprobs` records (keys derived from the
tokens, so they pair with whatever the other side recorded) and a manifest that says no region
is observed here, so the comparator reports "not observed", never "equal"::

    rollout = watch_given(audit, "rollout", framework="verl")
    rollout.record_step(step, batch, batch_rollout_logprobs)     # batch: an isoaudit.StepBatch

It cannot switch kernels (nothing of the engine is in reach): a remediation request is answered
with the reason, in the manifest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from isoaudit.audit.records import Case, LogprobSemantics, Record, Run, RuntimeFacts, Side
from isoaudit.collectors.assemble import keys_for, sample_records, sequence_tokens
from isoaudit.collectors.base import Collector, ModeReport, RolloutStep
from isoaudit.collectors.control import ControlChannel
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sessions import Session
from isoaudit.collectors.sinks.base import Sink
from isoaudit.collectors.trainer import LogprobsArg, LogprobsLayout, _given_logprobs

CASE: dict[Side, Case] = {"trainer": "trainer_recompute", "rollout": "engine_decode"}


class GivenLogprobs(Collector):
    """One side's samples from given tokens and logprobs. ``side``: ``trainer`` or ``rollout``;
    ``framework``: who computed them (the manifest's ``framework``); ``semantics``: ``processed``
    (after temperature and filtering, what RL frameworks use) or ``raw``."""

    def __init__(
        self,
        *,
        side: Side,
        run: str | Run,
        sink: Sink,
        framework: str,
        semantics: LogprobSemantics = "processed",
        control: ControlChannel | None = None,
        strict: bool = False,
        weight_version: str | int | None = None,
    ) -> None:
        if side not in CASE:
            raise ValueError(f"side: expected 'trainer' or 'rollout', got {side!r}")
        if semantics not in ("processed", "raw"):
            raise ValueError(f"semantics: expected 'processed' or 'raw', got {semantics!r}")
        self.side = side  # type: ignore[misc]  # set once here; the attribute is read-only for callers
        super().__init__(
            run=run,
            sink=sink,
            cases=(CASE[side],),
            control=control,
            strict=strict,
            weight_version=weight_version,
        )
        self.framework = framework
        self.semantics: LogprobSemantics = semantics
        self._begin([], {"*": f"logprobs given by {framework}; no model or engine hooked in this process"})

    def record_step(
        self,
        step: int,
        batch: StepBatch | Any,
        logprobs: LogprobsArg,
        *,
        logprobs_layout: LogprobsLayout = "auto",
        weight_version: str | int | None = None,
    ) -> RolloutStep | None:
        """Record ``batch``'s samples with ``logprobs`` (the layouts of
        :meth:`isoaudit.collectors.trainer.TrainerCollector.record_step`) as step ``step``."""
        report = self.guarded(
            "record_step", self._record, step, batch, logprobs, logprobs_layout, weight_version
        )
        self._step_boundary()
        return report

    def _record(
        self,
        step: int,
        batch_arg: StepBatch | Any,
        logprobs: LogprobsArg,
        layout: LogprobsLayout,
        weight_version: str | int | None,
    ) -> RolloutStep:
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step: must be an integer >= 0, got {step!r}")
        batch = StepBatch.coerce(batch_arg)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        _, target = batch.completion_rows()
        given = _given_logprobs(logprobs, batch, target, layout)
        lengths = [s.completion_len for s in batch.spans]
        if "lp" in given:
            flat = given["lp"].detach().cpu().numpy().astype(np.float32, copy=False)
            per_sample = np.split(flat, np.cumsum(lengths)[:-1])
        else:
            per_sample = [given[f"lp{i}"].detach().cpu().numpy() for i in range(batch.num_samples)]
        tokens = sequence_tokens(batch, batch.input_ids.detach().cpu().numpy())
        keys = keys_for(batch, tokens)
        records: list[Record] = []
        self._manifests(records)
        records += sample_records(
            run_id=self.run.run_id,
            step=int(step),
            side=self.side,
            batch=batch,
            tokens=tokens,
            keys=keys,
            logprobs=per_sample,
            weight_version=self.weight_version,
            semantics=self.semantics,
            validate=False,
        )
        self.sink.send(records)
        self.counters.steps += 1
        self.counters.samples += batch.num_samples
        return RolloutStep(int(step), keys, 0)

    def _runtime(self) -> RuntimeFacts:
        return RuntimeFacts(framework=self.framework, logprobs_mode=f"{self.semantics}_logprobs")

    def _apply_mode(self, mode: str, version: int | None) -> ModeReport:
        reason = (
            None if mode == "native" else f"logprobs given by {self.framework}: no kernels to switch here"
        )
        return ModeReport(mode, "native", reason, version)

    def _remove_hooks(self) -> None:
        return None


def watch_given(
    audit: Session,
    side: Side,
    *,
    framework: str,
    semantics: LogprobSemantics = "processed",
    weight_version: str | int | None = None,
) -> GivenLogprobs:
    """A :class:`GivenLogprobs` for ``side`` on the session's sink and control channel (closed and
    counted with the session's other collectors)."""
    # Session has no public hook for a collector it does not build itself (reported to the lead);
    # its own _common/_add are what watch_trainer and watch_vllm use.
    collector = GivenLogprobs(
        side=side,
        framework=framework,
        semantics=semantics,
        weight_version=weight_version,
        **audit._common(side),
    )
    return audit._add(collector)
