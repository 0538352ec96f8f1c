"""The collector base: what the trainer, the reference-engine and the vLLM collectors share.

* **guarded recording**: :meth:`Collector.guarded` runs a hook or a step and never lets an error
  reach the job (unless ``strict=True``, for tests): it is counted and logged once;
* **counters** (:class:`CollectorCounters`, extended per side) and log-once warnings;
* **manifests** and their changes: one per case the side records, rebuilt when the runtime, the
  weights or the remediation mode change, sent only when their content changed;
* the **weight version and digest**: :meth:`Collector.weights_changed` is public, for jobs that
  sync weights their own way (verl and OpenRLHF broadcast over NCCL);
* **remediation at a step boundary**: each side calls :meth:`Collector._step_boundary` where a new
  mode can safely take effect; it asks the :class:`~isoaudit.collectors.control.ControlChannel`, applies a
  new desired mode (:meth:`Collector._apply_mode`, per side) and publishes the manifest with the
  mode it actually applied. A side that cannot apply a mode says so (``ModeReport.reason``).
* **the heap**: attaching freezes what the job holds (:mod:`isoaudit.collectors.heap`), so a full
  garbage collection that comes due in a collector call walks only what was allocated since;
* **detach**: idempotent, like ``torch.utils.hooks.RemovableHandle.remove``; a collector is also a
  context manager that detaches on exit.
* **hooks for companions** (a recorder riding along, e.g. :mod:`isoaudit.collectors.routing`): the public
  :meth:`Collector.before_send`, :meth:`Collector.on_detach` and :meth:`Collector.add_runtime_facts`,
  so nothing outside a collector has to wrap its private methods.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, ParamSpec, TypeVar

from isoaudit.audit.records import Case, Environment, Manifest, Record, Run, RuntimeFacts, Side
from isoaudit.audit.records.canary import Canary, CanaryOutput, held_digest
from isoaudit.collectors import heap
from isoaudit.collectors.canary import arithmetic_of, run_canary
from isoaudit.collectors.control import MODES, ControlChannel
from isoaudit.collectors.counting import Counters, LogOnce
from isoaudit.collectors.environment import process_environment, with_runtime
from isoaudit.collectors.manifest import ContractArg, ContractSource, ManifestTracker
from isoaudit.collectors.sinks.base import Sink
from pydantic import BaseModel

log = logging.getLogger("isoaudit.collectors")

T = TypeVar("T")
P = ParamSpec("P")


class CollectorCounters(Counters):
    """What every side counts; a side adds its own names."""

    NAMES: ClassVar[tuple[str, ...]] = (
        "steps",
        "samples",
        "fingerprint_records",
        "manifests",
        "errors",
        "mode_switches",
    )


@dataclass(frozen=True)
class ModeReport:
    """What a side did with a remediation mode: asked ``requested``, runs ``applied``; ``reason``
    says what stayed native and why (``None`` when ``applied == requested``); ``version``: the
    control version it answers (``None``: set directly, not through control)."""

    requested: str
    applied: str
    reason: str | None = None
    version: int | None = None

    def facts(self) -> dict[str, Any]:
        """The manifest's runtime fields for this report (``remediation`` is the applied mode)."""
        return {
            "remediation": self.applied,
            "remediation_requested": self.requested,
            "remediation_native": self.reason,
            "control_version": self.version,
        }


@dataclass(frozen=True)
class RolloutStep:
    """What one rollout ``record_step`` produced: the samples' keys, how many fingerprint records,
    and (only with ``keep_records=True``) the records themselves."""

    step: int
    sample_keys: list[str]
    n_fingerprint_records: int
    records: list[Record] = field(default_factory=list)


def run_record(run: str | Run) -> Run:
    """``run`` as a :class:`Run` record (a bare id names the run after itself)."""
    return run if isinstance(run, Run) else Run(run_id=run, name=run)


class Collector(ABC):
    """Base of every collector. Subclasses set ``side`` and ``COUNTERS``, implement
    :meth:`_runtime`, :meth:`_apply_mode` and :meth:`_remove_hooks`, and call :meth:`_begin`
    once their hooks are in place."""

    side: ClassVar[Side]
    COUNTERS: ClassVar[type[CollectorCounters]] = CollectorCounters

    def __init__(
        self,
        *,
        run: str | Run,
        sink: Sink,
        cases: Sequence[Case],
        contract: ContractSource = None,
        control: ControlChannel | None = None,
        strict: bool = False,
        weight_version: str | int | None = None,
        weight_digest: str | None = None,
        mode: str = "native",
    ) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink: expected an isoaudit.collectors.sinks.Sink, got {type(sink).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if control is not None and not isinstance(control, ControlChannel):
            raise TypeError(
                "control: expected an isoaudit.collectors.control.ControlChannel, "
                f"got {type(control).__name__}"
            )
        self.run = run_record(run)
        self.sink = sink
        self.control = control
        self.strict = strict
        self.counters = self.COUNTERS()
        self.weight_version: str | None = str(weight_version) if weight_version is not None else None
        self.weight_digest = weight_digest
        #: tensor name -> digest of the weights this side holds now (``isoaudit.collectors.held_weights``)
        self.weight_tensor_digests: dict[str, str] = {}
        #: the canary this side ran after its latest weight version change (``isoaudit.collectors.canary``)
        self.canary: Canary | None = None
        #: run the canary at each weight version change (``ISOAUDIT_CANARY=0`` turns it off)
        self.canary_enabled = os.environ.get("ISOAUDIT_CANARY", "1") != "0"
        self.effective_weight_tensor_digests: dict[str, str] = {}
        self.mode_report = ModeReport(mode, mode)
        self._warn = LogOnce(log)
        self._contract = contract
        self._cases = tuple(cases)
        self._trackers: dict[Case, ManifestTracker] = {}
        self._manifest_key: tuple[Any, ...] | None = None
        self._control_version: int | None = None
        self._detached = False
        self._heap_held = False
        self._detach_hooks: list[Callable[[], None]] = []
        self._fact_providers: list[Callable[[], Mapping[str, Any]]] = []
        self._environment_json = _JsonOfLast()
        self._canary_json = _JsonOfLast()

    def _begin(self, regions: list[str], unobserved: dict[str, str]) -> None:
        """Hooks are in place: freeze the heap the job holds now (:mod:`~isoaudit.collectors.heap`:
        a full garbage collection in a later call walks only what came after), then send the run
        and the first manifests."""
        if not self._heap_held:
            self._heap_held = bool(self.guarded("freezing the heap", heap.hold))
        self._trackers = {
            case: ManifestTracker(
                run_id=self.run.run_id,
                side=self.side,
                case=case,
                regions=regions,
                unobserved=unobserved,
                contract=self._contract_now(),
            )
            for case in self._cases
        }
        out: list[Record] = [self.run]
        self._manifests(out)
        self.sink.send(out)

    # ------------------------------------------------------------------ public

    @property
    def mode(self) -> str:
        """The remediation mode this side runs in now (as applied, not as asked)."""
        return self.mode_report.applied

    @property
    def manifest(self) -> Manifest | None:
        """The latest manifest sent (of the first case)."""
        return self._trackers[self._cases[0]].current if self._trackers else None

    @property
    def attached(self) -> bool:
        return not self._detached

    def guarded(self, where: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """``fn(*args, **kwargs)``, or ``None`` if it raised: counted, logged once per ``where``,
        re-raised only with ``strict=True``."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.counters.errors += 1
            if self.strict:
                raise
            self._warn.warn(
                where,
                f"isoaudit {self.side} collector: {where} failed ({type(exc).__name__}: {exc}); counted",
            )
            return None

    def weights_changed(self, version: str | int, digest: str | None = None) -> None:
        """Say the weights this side computes with are now ``version`` (with their digest, when
        known: :func:`isoaudit.collectors.vllm.weight_digest` over the trainer's named tensors). Later
        records and a new manifest carry it. For jobs that sync weights their own way."""
        if version is None or (isinstance(version, str) and not version):
            raise ValueError("version: give the new weights a version (e.g. the trainer step they come from)")
        self._weights_moved(str(version), digest)
        self._weights_now(str(version), digest)

    def _take_canary(
        self,
        version: str | None,
        tokens: list[int],
        compute: Callable[[], tuple[CanaryOutput, CanaryOutput | None]],
    ) -> None:
        """Run this side's canary for weight ``version`` (after the held digests were taken) and
        keep it for the next manifest; a failure is kept as the canary's error and counted."""
        if not self.canary_enabled:
            return
        held = held_digest(self.weight_tensor_digests)
        have = self.canary
        if have is not None and have.error is None and have.held_digest is not None:
            if (have.weight_version, have.held_digest) == (version, held):
                return  # told twice of one sync (a loader's own call and the job's weights_changed)
        canary = run_canary(
            compute,
            tokens=tokens,
            weight_version=version,
            held=self.weight_tensor_digests,
            arithmetic=arithmetic_of(self._contract_now()),
        )
        if canary.error is not None:
            self.counters.errors += 1
            self._warn.warn(
                "canary", f"isoaudit {self.side} collector: canary failed ({canary.error}); counted"
            )
        self.canary = canary

    def _weights_now(self, version: str, digest: str | None) -> None:
        """Record the weights this side computes with now and publish the manifest."""
        self.weight_version, self.weight_digest = version, digest
        self.guarded("weights manifest", self.publish)

    def set_mode(self, mode: str, version: int | None = None) -> ModeReport:
        """Apply remediation ``mode`` (what the control channel does at a step boundary) and return
        what this side runs now; raises if the mode is unknown or the switch failed. A side whose
        switch happens elsewhere (inside vLLM's workers, at their next step) reports it later."""
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        report = self._apply_mode(mode, version)
        if report is not None:
            self._mode_reported(report if report.version is not None else replace(report, version=version))
        return self.mode_report

    def _mode_reported(self, report: ModeReport) -> None:
        """This side now runs ``report`` (counted when the applied mode changed; what stays native
        is logged once)."""
        if report == self.mode_report:
            return
        if report.applied != self.mode_report.applied:
            self.counters.mode_switches += 1
        self.mode_report = report
        if report.reason:
            self._warn.warn(
                f"mode:{report.requested}:{report.applied}",
                f"isoaudit {self.side} collector: asked for mode {report.requested!r}, runs "
                f"{report.applied!r}: {report.reason}",
            )

    def publish(self) -> None:
        """Send the manifests if anything in them changed."""
        out: list[Record] = []
        self._manifests(out)
        if out:
            self.sink.send(out)

    def stats(self) -> dict[str, Any]:
        """Collector counters, the applied mode, and the sink's counters."""
        return {**self.counters.as_dict(), "mode": self.mode, "sink": self.sink.stats()}

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Finish what is in flight, then wait for the sink to deliver everything."""
        self.guarded("flush", self._finish_pending)
        return self.sink.flush(timeout)

    def detach(self) -> None:
        """Finish what is in flight and remove every hook: the model or engine then runs exactly as
        before. Idempotent; never raises (unless ``strict``)."""
        if self._detached:
            return
        self._detached = True
        try:
            self.guarded("finish", self._finish_pending)
        finally:
            for hook in reversed(self._detach_hooks):  # companions first, while the engine is reachable
                self.guarded("detach", hook)
            self._detach_hooks.clear()
            self.guarded("detach", self._remove_hooks)
            if self._heap_held:
                self._heap_held = False
                self.guarded("unfreezing the heap", heap.release)

    # ------------------------------------------------------------------ hooks for companions

    def before_send(self, fn: Callable[[Sequence[Record]], None]) -> Callable[[], None]:
        """Run ``fn(records)`` on every batch this collector's sink is given, just before it is
        queued (``fn`` may fill fields in place; it must filter what it is not about: a sink shared
        by several collectors gives it their batches too). Returns what removes it; detach does."""
        remove = _SendHooks.add(self.sink, fn)
        self._detach_hooks.append(remove)
        return remove

    def on_detach(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` when this collector detaches: after what was in flight is sent, before the
        collector's own hooks go (last registered, first run; an error is counted)."""
        self._detach_hooks.append(fn)

    def add_runtime_facts(self, provider: Callable[[], Mapping[str, Any]]) -> Callable[[], None]:
        """Add ``provider()``'s fields to this side's runtime facts in every manifest (read at each
        step boundary: a change sends a new manifest). Returns what removes it."""
        self._fact_providers.append(provider)
        self._manifest_key = None

        def remove() -> None:
            if provider in self._fact_providers:
                self._fact_providers.remove(provider)
                self._manifest_key = None

        return remove

    def _added_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        for provider in self._fact_providers:
            facts.update(provider())
        return facts

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ------------------------------------------------------------------ for subclasses

    @abstractmethod
    def _runtime(self) -> RuntimeFacts:
        """This side's runtime facts (the remediation fields are filled in here)."""

    @abstractmethod
    def _apply_mode(self, mode: str, version: int | None) -> ModeReport | None:
        """Switch this side to ``mode``; return what it runs, or ``None`` when the switch completes
        later (then :meth:`_mode_reported` says so). Raise if it cannot switch at all."""

    @abstractmethod
    def _remove_hooks(self) -> None:
        """Remove every hook this collector installed."""

    def _finish_pending(self) -> None:
        """Turn whatever is still in flight into records (nothing by default)."""
        return None

    def _weights_moved(self, version: str, digest: str | None) -> None:
        """The job changed the weights itself: pass the new version on to engine state (nothing
        by default)."""
        return None

    def _signature(self) -> tuple[Any, ...] | None:
        """A cheap key of what :meth:`_runtime` reads, checked every step; ``None``: rebuild always
        (the manifest's content hash still keeps unchanged ones from being sent)."""
        return None

    def _environment(self) -> Environment:
        """The libraries, backends, flags and pins this side computes under (this process's by
        default; a side whose forward runs in other processes reads theirs)."""
        return process_environment()

    def _log_once(self, key: str, message: str) -> None:
        self._warn.warn(key, message)

    def _contract_now(self) -> ContractArg:
        """The contract this side runs under now: the one given, or, for a callable
        (``contract(mode)``, e.g. :func:`isoaudit.collectors.policy.hf_contracts`), the applied mode's."""
        contract = self._contract
        return contract(self.mode_report.applied) if callable(contract) else contract

    def _set_observed(
        self, regions: list[str] | None = None, unobserved: dict[str, str] | None = None
    ) -> None:
        for tracker in self._trackers.values():
            if regions is not None:
                tracker.regions = regions
            if unobserved is not None:
                tracker.unobserved = unobserved
        self._manifest_key = None

    def _manifests(self, out: list[Record]) -> None:
        """Append the manifests whose content changed since the last ones sent."""
        signature = self._signature()
        added = self._added_facts()
        environment = self.guarded("environment", self._environment)
        key = (
            signature,
            tuple(sorted(added.items())),
            self.mode_report,
            self.weight_version,
            self.weight_digest,
            dict(self.weight_tensor_digests),
            self._environment_json(environment),
            self._canary_json(self.canary),
            dict(self.effective_weight_tensor_digests),
        )
        if signature is not None and key == self._manifest_key:
            return
        self._manifest_key = key
        runtime = self._runtime().model_copy(update={**added, **self.mode_report.facts()})
        if environment is not None:
            environment = with_runtime(environment, runtime)
        contract = self._contract_now()
        for tracker in self._trackers.values():
            tracker.set_contract(contract)
            built = tracker.build(runtime, self.weight_version).model_copy(
                update={
                    "weight_digest": self.weight_digest,
                    "weight_tensor_digests": self.weight_tensor_digests,
                    "environment": environment,
                    "canary": self.canary,
                    "effective_weight_tensor_digests": self.effective_weight_tensor_digests,
                }
            )
            manifest = tracker.changed(built)
            if manifest is not None:
                out.append(manifest)
                self.counters.manifests += 1

    def _step_boundary(self, *, publish: bool = True) -> None:
        """Where a new mode may take effect: apply the control channel's desired mode if it is new,
        then publish the manifests if anything changed. ``publish=False``: only if the mode
        changed here (for a side whose every step checks its manifests before its records anyway).
        Never raises (unless ``strict``)."""
        before = self.mode_report
        control = self.guarded("control", self.control.desired) if self.control is not None else None
        if control is not None and control.version != self._control_version:
            self._control_version = control.version
            if control.mode != self.mode_report.requested:
                report = self.guarded("mode switch", self.set_mode, control.mode, control.version)
                if report is not None:
                    log.info(
                        "isoaudit %s collector: mode %s requested (control version %d); runs %s",
                        self.side,
                        control.mode,
                        control.version,
                        report.applied,
                    )
        if publish or self.mode_report != before:
            self.guarded("manifest", self.publish)


class _JsonOfLast:
    """A record's JSON, remembered for the last record asked: a manifest check every step compares
    the environment and the canary, which change rarely, and then as new objects."""

    def __init__(self) -> None:
        self._last: tuple[BaseModel | None, str | None] = (None, None)

    def __call__(self, record: BaseModel | None) -> str | None:
        if record is None:
            return None
        last, dumped = self._last
        if record is not last:
            dumped = record.model_dump_json()
            self._last = (record, dumped)
        return dumped


class _SendHooks:
    """The ``send`` of a sink with companions' hooks in front (an instance attribute of the sink:
    the class's method again once the last hook goes). One per sink, however many collectors share
    it, so hooks come and go in any order."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.original = sink.send
        self.hooks: list[Callable[[Sequence[Record]], None]] = []

    def __call__(self, records: Sequence[Record]) -> None:
        for hook in list(self.hooks):
            try:
                hook(records)
            except Exception as exc:  # a companion never stops the records
                log.warning("isoaudit collector: a send hook failed (%s: %s)", type(exc).__name__, exc)
        self.original(records)

    @classmethod
    def add(cls, sink: Sink, fn: Callable[[Sequence[Record]], None]) -> Callable[[], None]:
        hooked = vars(sink).get("send")
        if not isinstance(hooked, cls):
            hooked = cls(sink)
            sink.send = hooked  # type: ignore[method-assign]  # wraps this one sink's bound method, as the sink's own tests do
        hooked.hooks.append(fn)

        def remove() -> None:
            if fn in hooked.hooks:
                hooked.hooks.remove(fn)
            if not hooked.hooks and vars(sink).get("send") is hooked:
                del sink.send

        return remove
