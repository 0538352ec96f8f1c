"""The one call a job makes: ``with isoaudit.session(run="grpo-7") as audit:``.

A :class:`Session` owns where records go (a :class:`Destination`), the run's control channel, one
sink per side and every collector it attached. Where records go comes from the arguments or the
environment, so a job moves from a laptop to a shared service without a code change:

* ``url``/``token`` or ``ISOAUDIT_URL`` + ``ISOAUDIT_TOKEN``: the isoaudit service over HTTP
  (records spool to disk while it is down; control comes with every ingest reply);
* ``database_url`` or ``ISOAUDIT_DATABASE_URL``: straight into that database (control read from it);
* otherwise the embedded SQLite store ``./isoaudit.db``.

With a database destination the session also compares its run's steps and evaluates the alert rules
(``compare=``, :mod:`isoaudit.collectors.comparer`): a child process by default, so nothing else need
run; the service destination leaves that to the service.

Used as a context manager it starts on entry and closes on exit; without ``with`` (a framework
callback: ``on_train_begin`` / ``on_train_end``) call :meth:`Session.start` and
:meth:`Session.close`. Closing flushes, detaches every hook (idempotent, like a
``RemovableHandle``), closes the sinks, waits for the session's comparer to compare what they
delivered, and returns (and prints) what each side sent, spooled, dropped and had rejected, and how
many steps are compared.

With ``trackers=("wandb", "mlflow")`` (or ``ISOAUDIT_TRACKERS``) the session also logs its run's
compared steps into the job's W&B and MLflow runs (:mod:`isoaudit.collectors.trackers`).

With ``fail_closed=True`` the job stops (:class:`NotIdentical`) at its first step boundary after a
compared step of its run is known to hold a non-identical token, and closing raises unless every
step stored on both sides was compared identical (:mod:`isoaudit.collectors.fail_closed`).
"""

from __future__ import annotations

import logging
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from isoaudit.audit.config import database_url as resolve_database_url
from isoaudit.audit.metrics.exact import ExactnessError as ExactnessError  # raised by fail_closed
from isoaudit.audit.metrics.exact import NotIdentical as NotIdentical
from isoaudit.audit.metrics.exact import ParityUnverified as ParityUnverified
from isoaudit.audit.records import Case, Run, StepStats
from isoaudit.collectors.base import Collector, run_record
from isoaudit.collectors.comparer import (
    DEFAULT_COMPARE_TIMEOUT_S,
    CompareMode,
    ComparisonReport,
    SessionComparer,
    compare_mode,
)
from isoaudit.collectors.control import ControlChannel, FixedControl, ServiceControl, StoreControl
from isoaudit.collectors.manifest import ContractArg
from isoaudit.collectors.regions import RegionsArg
from isoaudit.collectors.remediation import RemediationHook, apply_kernels_mode
from isoaudit.collectors.sinks.base import Sink
from isoaudit.collectors.sinks.spool import DEFAULT_SPOOL_DIR

if TYPE_CHECKING:
    from isoaudit.audit.trackers import Tracker
    from isoaudit.collectors.batch_probe import ProbeArg
    from isoaudit.collectors.engine_capture import EngineCollector
    from isoaudit.collectors.fail_closed import FailClosed
    from isoaudit.collectors.sinks.direct import SharedStore
    from isoaudit.collectors.trackers import SessionTrackers
    from isoaudit.collectors.trainer import TrainerCollector
    from isoaudit.collectors.vllm.collector import VllmCollector
    from isoaudit.collectors.vllm.selection import SelectionArg
    from isoaudit.kernels.engine import RolloutEngine
    from torch import nn
    from vllm import LLM

log = logging.getLogger(__name__)

C = TypeVar("C", bound=Collector)

#: The sides a session keeps one sink for.
SIDES: tuple[str, ...] = ("trainer", "rollout")


# ---------------------------------------------------------------- destinations


class Destination(ABC):
    """Where a session's records go and where its control comes from."""

    @abstractmethod
    def sink(self, side: str) -> Sink:
        """A new sink for ``side``'s records."""

    @abstractmethod
    def control(self, run_id: str) -> ControlChannel:
        """The run's control channel (one per session)."""

    def begin(self, run_id: str, rank: int | None, *, report: bool = True) -> None:
        """Called when the session opens its first sink, once its run and rank are known."""
        return None

    def close(self) -> None:
        """Release what the destination holds once its sinks are closed."""
        return None

    def comparison(self) -> ComparisonReport | None:
        """How the run's comparison stood at close, where this destination compares."""
        return None


class ServiceDestination(Destination):
    """The isoaudit service at ``url`` with a bearer ``token``. ``spool_dir``: where each side's
    batches wait while the service is down (``None``: no spool); ``timeout``: seconds per request;
    ``control_interval``: seconds between control polls when no ingest reply brought it."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        spool_dir: str | Path | None = DEFAULT_SPOOL_DIR,
        timeout: float = 10.0,
        control_interval: float = 2.0,
    ) -> None:
        if not token:
            raise ValueError(
                "token: the service needs a bearer token (ISOAUDIT_TOKEN); create one with "
                "`isoaudit tokens create --project NAME`"
            )
        self.url, self.token = url, token
        self.spool_dir = Path(spool_dir) if spool_dir is not None else None
        self.timeout = timeout
        self.control_interval = control_interval
        self._control: ServiceControl | None = None

    def sink(self, side: str) -> Sink:
        from isoaudit.collectors.sinks.http import HttpSink

        return HttpSink(
            self.url,
            self.token,
            spool_dir=self.spool_dir / side if self.spool_dir is not None else None,
            timeout=self.timeout,
            name=f"{side}-http-sink",
            on_control=self._control.offer if self._control is not None else None,
        )

    def control(self, run_id: str) -> ControlChannel:
        self._control = ServiceControl(run_id, self.url, self.token, interval=self.control_interval)
        return self._control

    def close(self) -> None:
        if self._control is not None:
            self._control.close()


class DatabaseDestination(Destination):
    """Direct writes to the store at ``url`` (any SQLAlchemy URL; ``postgresql://`` works as is).
    ``project``: the project runs belong to; ``spool_dir``: where batches wait while the database
    is down (``None``: no spool); ``control_interval``: seconds between reads of the control record.

    ``compare``: who compares the run's steps and evaluates its alerts: ``"process"`` (a child
    process of the job), ``"thread"`` (a thread of it) or ``"none"`` (your own ``isoaudit worker``
    or ``isoaudit serve``); default ``ISOAUDIT_COMPARE``, else ``"process"``. Only rank 0 (or a job
    without ranks) starts a comparer. ``compare_timeout``: the most seconds closing waits for the
    run's steps to be compared (:mod:`isoaudit.collectors.comparer`)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        project: str = "default",
        spool_dir: str | Path | None = None,
        control_interval: float = 1.0,
        compare: CompareMode | None = None,
        compare_timeout: float = DEFAULT_COMPARE_TIMEOUT_S,
    ) -> None:
        from isoaudit.collectors.sinks.direct import SharedStore

        self.url = resolve_database_url(url)
        self.project = project
        self.spool_dir = Path(spool_dir) if spool_dir is not None else None
        self.control_interval = control_interval
        self.compare = compare_mode(compare)
        if compare_timeout < 0:
            raise ValueError(f"compare_timeout: must be >= 0 seconds, got {compare_timeout}")
        self.compare_timeout = compare_timeout
        self.shared: SharedStore = SharedStore(self.url)
        self._comparer: SessionComparer | None = None
        self._comparison: ComparisonReport | None = None

    def sink(self, side: str) -> Sink:
        from isoaudit.collectors.sinks.direct import DirectSink

        return DirectSink(
            self.shared,
            project=self.project,
            spool_dir=self.spool_dir / side if self.spool_dir is not None else None,
            name=f"{side}-direct-sink",
        )

    def control(self, run_id: str) -> ControlChannel:
        return StoreControl(run_id, self.shared, interval=self.control_interval)

    def begin(self, run_id: str, rank: int | None, *, report: bool = True) -> None:
        """Start the run's comparer, unless ``compare="none"``, another rank's session compares, or
        one runs already."""
        if self.compare == "none" or rank not in (None, 0) or self._comparer is not None:
            return
        self._comparer = SessionComparer(
            self.shared, run_id, self.compare, timeout=self.compare_timeout, report=report
        ).start()

    def close(self) -> None:
        """Drain and stop the comparer (bounded by ``compare_timeout``), then close the store."""
        if self._comparer is not None:
            self._comparison = self._comparer.close()
            self._comparer = None
        self.shared.reset()

    def comparison(self) -> ComparisonReport | None:
        return self._comparison


class MemoryDestination(Destination):
    """Records kept in memory (notebooks, tests): ``sinks[side].records``; control set by hand
    through ``session.control.set(mode)``."""

    def __init__(self) -> None:
        from isoaudit.collectors.sinks.memory import MemorySink

        self._make = MemorySink
        self.sinks: dict[str, Any] = {}

    def sink(self, side: str) -> Sink:
        self.sinks[side] = self._make(name=f"{side}-memory-sink")
        return self.sinks[side]

    def control(self, run_id: str) -> ControlChannel:
        return FixedControl(run_id)


def destination_from(
    *,
    url: str | None = None,
    token: str | None = None,
    database_url: str | None = None,
    project: str = "default",
    spool_dir: str | Path | None = None,
    control_interval: float | None = None,
    compare: CompareMode | None = None,
    compare_timeout: float = DEFAULT_COMPARE_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> Destination:
    """The destination the arguments name, else the environment's, else the SQLite default (see
    the module docstring). An explicit ``database_url`` wins over ``ISOAUDIT_URL``. ``compare`` and
    ``compare_timeout`` apply to a database destination (the service compares for its clients)."""
    env = os.environ if environ is None else environ
    if database_url is None:
        url = url or env.get("ISOAUDIT_URL") or None
    if url:
        return ServiceDestination(
            url,
            token or env.get("ISOAUDIT_TOKEN", ""),
            spool_dir=spool_dir if spool_dir is not None else DEFAULT_SPOOL_DIR,
            control_interval=2.0 if control_interval is None else control_interval,
        )
    return DatabaseDestination(
        database_url or env.get("ISOAUDIT_DATABASE_URL") or None,
        project=project,
        spool_dir=spool_dir,
        control_interval=1.0 if control_interval is None else control_interval,
        compare=compare_mode(compare, env),
        compare_timeout=compare_timeout,
    )


# ---------------------------------------------------------------- summary


@dataclass(frozen=True)
class SideSummary:
    """Records of one side: ``sent`` (stored or accepted), ``spooled`` (waiting on disk at some
    point), ``dropped`` (lost: queue full, spool full, refused batch), ``rejected`` (invalid, refused
    one by one), and the collectors' own ``errors``."""

    sent: int = 0
    spooled: int = 0
    dropped: int = 0
    rejected: int = 0
    errors: int = 0


@dataclass(frozen=True)
class Summary:
    """What a session delivered, per side, and (where the session compared) how many steps of its
    run are compared."""

    run_id: str
    sides: dict[str, SideSummary]
    comparison: ComparisonReport | None = None

    def __str__(self) -> str:
        parts = [
            f"{side} sent {s.sent}, spooled {s.spooled}, dropped {s.dropped}, rejected {s.rejected}"
            + (f", errors {s.errors}" if s.errors else "")
            for side, s in self.sides.items()
        ]
        text = f"isoaudit run {self.run_id}: " + ("; ".join(parts) or "nothing recorded")
        return text + (f"; {self.comparison}" if self.comparison is not None else "")


# ---------------------------------------------------------------- session


class Session:
    """One job's connection to isoaudit: collectors per side, their sinks and the control channel.
    Build it with :func:`session`."""

    def __init__(
        self,
        run: str | Run,
        destination: Destination,
        *,
        strict: bool = False,
        report: bool = True,
        contracts: bool = False,
        rank: int | None = None,
        trackers: Sequence[Tracker] = (),
        tracker_names: str | None = None,
        fail_closed: bool = False,
    ) -> None:
        if fail_closed and isinstance(destination, MemoryDestination):
            raise ValueError(
                "fail_closed: a memory destination compares nothing; write to a database or the service"
            )
        self.run = run_record(run)
        self.rank = rank  # None: detected when the first sink opens (isoaudit.collectors.integrations.ranks)
        self.contracts = contracts
        self.destination = destination
        self.strict = strict
        self.report = report
        self.collectors: list[Collector] = []
        self._sinks: dict[str, Sink] = {}
        self._control: ControlChannel | None = None
        self._closed: Summary | None = None
        self._stats_refused = 0  # StepStats the session could not build (bad figures), counted
        self.trackers = tuple(trackers)
        self.tracker_names = tracker_names
        self._trackers: SessionTrackers | None = None
        self.fail_closed = fail_closed
        self._fail_closed: FailClosed | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Session:
        """Open the control channel (idempotent; ``watch_*`` start the session too)."""
        if self._closed is not None:
            raise RuntimeError("session: closed; start a new one")
        if self._control is None:
            self._control = self.destination.control(self.run.run_id)
            if self.trackers:
                from isoaudit.collectors.trackers import follow

                self._trackers = follow(
                    self.run.run_id, self.destination, self.trackers, names=self.tracker_names, rank=self.rank
                )
            if self.fail_closed:
                from isoaudit.collectors.fail_closed import FailClosed
                from isoaudit.collectors.trackers import results_of

                results = results_of(self.destination, self.run.run_id)
                if results is None:
                    raise ValueError(f"fail_closed: {type(self.destination).__name__} keeps no results")
                self._fail_closed = FailClosed(self.run.run_id, results).start()
        if self._trackers is not None:
            self._trackers.capture()
        return self

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self._fail_closed is not None:
            self._fail_closed.quiet()  # the job is failing already: close raises nothing more
        self.close()

    def check(self) -> None:
        """With ``fail_closed``: raise :class:`NotIdentical` (the step, its count of differing tokens
        and max |Δ|) if a compared step of the run is known to hold a non-identical token. The
        session's collectors call it at each step boundary; a job without collectors calls it
        itself. Without ``fail_closed``: nothing."""
        if self._fail_closed is not None:
            self._fail_closed.check()

    @property
    def control(self) -> ControlChannel:
        """The run's control channel (what every collector of this session asks)."""
        return self.start()._control  # type: ignore[return-value]  # start() gives every destination a control channel; the attribute is typed for the service one

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Finish what the collectors have in flight and wait until every sink delivered it."""
        done = True
        for collector in self.collectors:
            done = collector.flush(timeout) and done
        for sink in self._sinks.values():
            done = sink.flush(timeout) and done
        return done

    def close(self, timeout: float | None = 30.0) -> Summary:
        """Detach every collector, flush and close the sinks (up to ``timeout`` seconds each),
        release the destination; returns (and with ``report=True`` prints) the summary. Idempotent."""
        if self._closed is not None:
            return self._closed
        for collector in self.collectors:
            collector.detach()
        for sink in self._sinks.values():
            sink.close(timeout)
        if self._control is not None:
            self._control.close()
        self.destination.close()
        self._closed = self.summary()
        if self.report:
            print(self._closed, file=sys.stderr)
        if self._trackers is not None:  # after the destination: its comparer has compared what it could
            tracked = self._trackers.close(30.0 if timeout is None else timeout)
            if self.report:
                print(tracked, file=sys.stderr)
        if self._fail_closed is not None:  # last: raises unless every stored step compared identical
            drained = self.destination.comparison() is not None
            wait = getattr(self.destination, "compare_timeout", DEFAULT_COMPARE_TIMEOUT_S)
            self._fail_closed.close(0.0 if drained else wait)
        return self._closed

    def summary(self) -> Summary:
        """What each side has sent, spooled, dropped and had rejected so far."""
        sides = {}
        for side, sink in self._sinks.items():
            c = sink.counters
            errors = sum(x.counters.errors for x in self.collectors if x.sink is sink)
            sides[side] = SideSummary(c.sent, c.spooled, c.dropped, c.rejected, errors)
        return Summary(self.run.run_id, sides, self.destination.comparison())

    # ---------------------------------------------------------------- sides

    def watch_trainer(
        self,
        model: nn.Module,
        *,
        regions: RegionsArg = "auto",
        sample_every: int = 1,
        case: Case = "trainer_fwd",
        contract: ContractArg = None,
        remediation_hook: RemediationHook | None = apply_kernels_mode,
        async_transfer: bool = True,
        max_inflight: int = 2,
        keep_records: bool = False,
        weight_digests: bool = True,
        distribution_k: int = 8,
        batch_probe: ProbeArg = "auto",
    ) -> TrainerCollector:
        """Hook the policy ``model``; call ``record_step(step, batch, logprobs=...)`` on the handle
        per training forward. ``regions``: ``"auto"`` (HF Llama/Qwen2/Qwen3/Mistral), canonical
        names, a canonical → module map, or ``None`` (logprobs only); ``sample_every``: fingerprint
        every N-th step; ``weight_digests``: digest the parameters held at each weight version
        change (off for a model too large to read once per sync); ``distribution_k``: the top-k kept
        per position on fingerprinted steps, with the full-vocabulary sketch (0: none); ``batch_probe``:
        when to recompute a few samples alone (:mod:`isoaudit.collectors.batch_probe`); the rest:
        :class:`isoaudit.collectors.trainer.TrainerCollector`."""
        from isoaudit.collectors.trainer import TrainerCollector

        return self._add(
            TrainerCollector(
                model,
                **self._common("trainer"),
                regions=regions,
                sample_every=sample_every,
                case=case,
                contract=self._auto_trainer_contract(model)
                if contract is None and self.contracts
                else contract,
                remediation_hook=remediation_hook,
                keep_records=keep_records,
                async_transfer=async_transfer,
                max_inflight=max_inflight,
                weight_digests=weight_digests,
                distribution_k=distribution_k,
                batch_probe=batch_probe,
            )
        )

    def watch_vllm(
        self,
        llm: LLM,
        *,
        regions: str | Sequence[str] | Mapping[str, str] | None = "auto",
        fingerprint: SelectionArg = "all",
        contract: ContractArg = None,
        weight_version: str | int | None = None,
        max_requests: int = 65536,
        max_rows: int = 1 << 20,
        flush_bytes: int = 64 << 20,
        keep_records: bool = False,
        distribution_k: int = 8,
        batch_probe: ProbeArg = "auto",
    ) -> VllmCollector:
        """Hook the engine of ``llm`` (a ``vllm.LLM`` in this process, or started with
        ``worker_extension_cls=isoaudit.collectors.vllm.EXTENSION``); call ``record_step(step, outputs)``
        on the handle after each ``generate``. ``fingerprint``: ``"all"``, one in N, a list of
        request ids, or ``None``; ``distribution_k``: the most top-k entries kept per position from
        ``SamplingParams(logprobs=k)`` (0: none); ``batch_probe``: when to score a few samples again
        alone and beside their batch-mates (:mod:`isoaudit.collectors.vllm.batch_probe`); the rest: :class:`isoaudit.collectors.vllm.VllmCollector`."""
        from isoaudit.collectors.vllm.collector import VllmCollector

        return self._add(
            VllmCollector(
                llm,
                **self._common("rollout"),
                regions=regions,
                fingerprint=fingerprint,
                contract="auto" if contract is None and self.contracts else contract,
                weight_version=weight_version,
                max_requests=max_requests,
                max_rows=max_rows,
                flush_bytes=flush_bytes,
                keep_records=keep_records,
                distribution_k=distribution_k,
                batch_probe=batch_probe,
            )
        )

    def watch_engine(
        self,
        engine: RolloutEngine,
        *,
        regions: RegionsArg = "auto",
        contract: ContractArg = None,
        remediation_hook: RemediationHook | None = apply_kernels_mode,
        weight_version: str | int | None = None,
        keep_records: bool = False,
    ) -> EngineCollector:
        """Hook isoaudit's reference engine (``isoaudit.kernels.engine.RolloutEngine`` over an
        ``HFCausalLM``); call ``record_step(step, completions)`` on the handle after each
        ``generate``. Arguments: :class:`isoaudit.collectors.engine_capture.EngineCollector`."""
        from isoaudit.collectors.engine_capture import EngineCollector

        return self._add(
            EngineCollector(
                engine,
                **self._common("rollout"),
                regions=regions,
                contract="auto" if contract is None and self.contracts else contract,
                remediation_hook=remediation_hook,
                weight_version=weight_version,
                keep_records=keep_records,
            )
        )

    def weights_changed(self, version: str | int, digest: str | None = None) -> None:
        """Every side now computes with weights ``version`` (and ``digest``, when known): for jobs
        that sync weights their own way (verl, OpenRLHF broadcast over NCCL)."""
        for collector in self.collectors:
            collector.weights_changed(version, digest)

    def watch_routing(self, handle: Collector) -> Any:
        """MoE models: also record, per token and MoE layer, the experts ``handle`` (a trainer,
        reference-engine or in-process vLLM collector of this session) saw chosen, on its sample
        records (:func:`isoaudit.collectors.routing.watch_routing`); ``None`` for a dense model."""
        from isoaudit.collectors.routing import watch_routing

        return watch_routing(handle)

    def record_stats(
        self,
        step: int,
        *,
        reward_mean: float | None = None,
        reward_std: float | None = None,
        entropy: float | None = None,
        clip_fraction: float | None = None,
        generation_s: float | None = None,
        training_s: float | None = None,
        extras: Mapping[str, float] | None = None,
    ) -> None:
        """The RL loop's own figures for ``step`` (reward, entropy, clip fraction, phase times, any
        ``extras`` by name), stored beside the mismatch so the dashboard draws one against the other.
        Sent with the trainer's records; never raises into the job (a bad figure is refused by the
        store and counted as rejected), unless the session is ``strict``."""
        try:
            record = StepStats(
                run_id=self.run.run_id,
                step=step,
                reward_mean=reward_mean,
                reward_std=reward_std,
                entropy=entropy,
                clip_fraction=clip_fraction,
                generation_s=generation_s,
                training_s=training_s,
                extras=dict(extras or {}),
            )
        except ValueError as exc:
            if self.strict:
                raise
            if not self._stats_refused:
                log.warning("isoaudit: step %s's loop figures were not recorded (said once): %s", step, exc)
            self._stats_refused += 1
            return
        self._sink("trainer").send([record])

    # ---------------------------------------------------------------- internals

    def _common(self, side: str) -> dict[str, Any]:
        """What every collector of this session shares: the run, its side's sink, the control
        channel and strictness."""
        return {"run": self.run, "sink": self._sink(side), "control": self.control, "strict": self.strict}

    @staticmethod
    def _auto_trainer_contract(model: Any) -> Any:
        """The trainer's contract per mode, built from what the model runs
        (:mod:`isoaudit.collectors.policy`)."""
        from isoaudit.collectors.policy import hf_contracts

        return hf_contracts(model)

    def _sink(self, side: str) -> Sink:
        self.start()
        if side not in self._sinks:
            from isoaudit.collectors.integrations.ranks import detect_rank, stamp_rank

            sink = self.destination.sink(side)
            if self.rank is None:
                self.rank = detect_rank()
            first = not self._sinks
            self._sinks[side] = stamp_rank(sink, self.rank) if self.rank is not None else sink
            if first:
                self.destination.begin(self.run.run_id, self.rank, report=self.report)
        return self._sinks[side]

    def _add(self, collector: C) -> C:
        self.collectors.append(collector)
        if self._fail_closed is not None:
            self._fail_closed.guard(collector, self.check)
        return collector


class SessionOptions(TypedDict, total=False):
    """:func:`session`'s keyword arguments, for callers that pass them on (framework adapters)."""

    url: str | None
    token: str | None
    database_url: str | None
    project: str
    spool_dir: str | Path | None
    control_interval: float | None
    compare: CompareMode | None
    compare_timeout: float
    destination: Destination | None
    strict: bool
    report: bool
    contracts: bool
    rank: int | None
    trackers: str | Sequence[str] | None
    tracker_names: str | None
    framework: str | None
    framework_config: Mapping[str, Any] | None
    fail_closed: bool


def declared_run(run: str | Run, framework: str | None, settings: Mapping[str, Any] | None) -> Run:
    """``run`` with ``framework`` (``"verl==0.7.1"``) and its ``settings`` in its config, checked: an
    unknown framework, release or setting raises ValueError naming it."""
    from isoaudit.audit.frameworks import parse_declaration

    record = run_record(run)
    config = dict(record.config)
    if framework is not None:
        config["framework"] = framework
    if settings is not None:
        config["framework_config"] = dict(settings)
    if "framework" not in config:
        raise ValueError(
            "framework_config: given without framework (say which, like framework='verl==0.7.1')"
        )
    parse_declaration(config["framework"], config.get("framework_config"))
    return record.model_copy(update={"config": config})


def session(
    run: str | Run,
    *,
    url: str | None = None,
    token: str | None = None,
    database_url: str | None = None,
    project: str = "default",
    spool_dir: str | Path | None = None,
    control_interval: float | None = None,
    compare: CompareMode | None = None,
    compare_timeout: float = DEFAULT_COMPARE_TIMEOUT_S,
    destination: Destination | None = None,
    strict: bool = False,
    report: bool = True,
    contracts: bool = False,
    rank: int | None = None,
    trackers: str | Sequence[str] | None = None,
    tracker_names: str | None = None,
    framework: str | None = None,
    framework_config: Mapping[str, Any] | None = None,
    fail_closed: bool = False,
) -> Session:
    """A session for run ``run`` (an id, or a :class:`isoaudit.audit.records.Run` with a name and config).

    ``url``/``token``: the service (default ``ISOAUDIT_URL``/``ISOAUDIT_TOKEN``);
    ``database_url``: direct writes (default ``ISOAUDIT_DATABASE_URL``, else ``./isoaudit.db``);
    ``project``: the project of direct writes; ``spool_dir``: where records wait while the
    destination is down (service default :data:`~isoaudit.collectors.sinks.spool.DEFAULT_SPOOL_DIR`); ``control_interval``: seconds
    between control reads (service 2, database 1); ``compare``: who compares the steps of a
    database destination and evaluates its alerts: ``"process"`` (the default, or
    ``ISOAUDIT_COMPARE``: a child process of the job), ``"thread"`` (a thread of the job) or
    ``"none"`` (your own ``isoaudit worker`` fleet); ``compare_timeout``: the most seconds closing
    waits for the run's steps to be compared (it prints what is left and the command that compares
    it); ``destination``: any :class:`Destination`
    instead (e.g. :class:`MemoryDestination`); ``strict``: collectors raise instead of counting
    errors (tests); ``report``: print the summary on close; ``contracts``: every side a ``watch_*``
    call gives no contract gets one built per remediation mode from what it runs
    (:mod:`isoaudit.collectors.policy`), so the manifests' ``numerical_policy`` says which kernels compute
    each region and the handshake names the regions where the sides differ; ``rank``: the rank
    stamped on this session's samples (default: ``torch.distributed``'s, else the launcher's
    ``RANK``, else none); ``trackers``: ``"wandb"``, ``"mlflow"`` or both (default
    ``ISOAUDIT_TRACKERS``): the run's compared steps go into the job's W&B run and MLflow run, or
    runs of isoaudit's own (:mod:`isoaudit.collectors.trackers`; rank 0 only), under
    ``tracker_names``' framework names (``verl``, ``trl``, ...; default ``ISOAUDIT_TRACKER_NAMES``);
    ``framework``: what the job runs under (``"verl==0.7.1"``; integrations fill it in), so the
    figures shown under that framework's names follow its code at that release, with
    ``framework_config``'s settings (its rollout-correction thresholds, modes; the framework's
    defaults otherwise): both go into the run's config;
    ``fail_closed``: the job stops with :class:`NotIdentical` at its first step boundary (a
    collector's ``begin_step``/``record_step``, or :meth:`Session.check`) after a compared step is
    known to hold a non-identical token, and closing waits for the comparison and raises
    :class:`NotIdentical` or :class:`ParityUnverified` unless every step stored on both sides was
    compared identical (:mod:`isoaudit.collectors.fail_closed`).
    """
    if framework is not None or framework_config is not None:
        run = declared_run(run, framework, framework_config)
    chosen: tuple[Tracker, ...] = ()
    if trackers is not None or os.environ.get("ISOAUDIT_TRACKERS"):
        from isoaudit.collectors.trackers import trackers_from

        chosen = trackers_from(trackers)
    if chosen and tracker_names is not None:
        from isoaudit.audit.trackers.figures import check_framework

        check_framework(tracker_names, "tracker_names")
    if destination is None:
        destination = destination_from(
            url=url,
            token=token,
            database_url=database_url,
            project=project,
            spool_dir=spool_dir,
            control_interval=control_interval,
            compare=compare,
            compare_timeout=compare_timeout,
        )
    return Session(
        run,
        destination,
        strict=strict,
        report=report,
        contracts=contracts,
        rank=rank,
        trackers=chosen,
        tracker_names=tracker_names,
        fail_closed=fail_closed,
    )
