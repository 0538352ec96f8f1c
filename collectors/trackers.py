"""The job's side of W&B and MLflow: a session follows its run's compared steps into the job's trackers.

``isoaudit.session(run=..., trackers=("wandb", "mlflow"), tracker_names="verl")`` (or
``ISOAUDIT_TRACKERS=wandb,mlflow``, ``ISOAUDIT_TRACKER_NAMES=verl``) starts a
:class:`SessionTrackers` thread that polls where the session's records go for its run's compared
steps (the store, or the service's ``GET /v1/runs/{run}/metrics``) and logs each step's figures,
under the framework's names, into:

* W&B: the job's own run when ``wandb.run`` is active at the first compared step (isoaudit's
  figures on their own x-axis ``isoaudit/step``, never advancing the job's step while it runs:
  :mod:`isoaudit.audit.trackers.wandb_writer`), else a run of isoaudit's own
  (``ISOAUDIT_WANDB_PROJECT``/``_ENTITY``/``_MODE``);
* MLflow: the run active in the job's thread when the session started (or when it last recorded
  step stats), else a run of isoaudit's own (``ISOAUDIT_MLFLOW_TRACKING_URI``, experiment
  ``ISOAUDIT_MLFLOW_EXPERIMENT``).

Each alert of the run seen firing becomes a W&B alert. A step compared again (records of it
arrived late) is logged again at the same isoaudit step. The thread never touches the job's own
thread: reads, opens and logs happen on it, every failure is counted and logged once, and closing
waits a bounded time (``settle_s``) for the steps stored but not yet compared.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from isoaudit.audit.trackers.base import TRACKERS, Tracker, TrackerWriter, check_installed
from isoaudit.audit.trackers.figures import (
    alert_level,
    alert_title,
    check_framework,
    source_keys,
    tracked_figures,
)
from isoaudit.audit.trackers.settings import TrackerSettings

if TYPE_CHECKING:
    from isoaudit.collectors.sessions import Destination

log = logging.getLogger(__name__)

#: Where the session's trackers come from when the session is given none.
TRACKERS_ENV = "ISOAUDIT_TRACKERS"
#: Seconds between a session's reads of its run's results.
INTERVAL_S = 2.0

TrackersArg = str | Sequence[str] | None


def trackers_from(value: TrackersArg, environ: Mapping[str, str] | None = None) -> tuple[Tracker, ...]:
    """The trackers ``value`` names (``"wandb"``, ``"wandb,mlflow"``, a sequence); None: those of
    ``ISOAUDIT_TRACKERS``. Each must be installed (else :class:`TrackerUnavailable` naming the extra)."""
    if value is None:
        value = (os.environ if environ is None else environ).get(TRACKERS_ENV, "")
    names = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    chosen: list[Tracker] = []
    for name in names:
        tracker = name.strip().lower()
        check_installed(tracker)  # ValueError for an unknown one
        chosen.extend(t for t in TRACKERS if t == tracker and t not in chosen)
    return tuple(chosen)


# ---------------------------------------------------------------- where results are read


@dataclass(frozen=True)
class ComparedStep:
    """One compared step of the run as stored: its metrics (stored keys) and when it was compared."""

    step: int
    metrics: Mapping[str, Any]
    computed_at: str


@dataclass(frozen=True)
class FiringAlert:
    id: int
    rule: str
    severity: str
    step: int | None
    value: float | None


class Results(ABC):
    """Where a session reads its run's comparison results."""

    @abstractmethod
    def compared(self, from_step: int, keys: Sequence[str]) -> list[ComparedStep]:
        """Compared steps from ``from_step`` on, in step order, with only the metrics ``keys``."""

    @abstractmethod
    def awaiting(self, from_step: int) -> int:
        """Steps from ``from_step`` on stored on both sides of which nothing is compared yet."""

    @abstractmethod
    def firing(self) -> list[FiringAlert]:
        """The run's alerts firing now."""

    def close(self) -> None:
        return None


class StoreResults(Results):
    """Read from the database at ``url`` (an engine of its own, opened on first use)."""

    def __init__(self, url: str, run_id: str) -> None:
        self.url = url
        self.run_id = run_id
        self._store: Any = None

    def _get(self) -> Any:
        if self._store is None:
            from isoaudit.audit.db import Store

            self._store = Store(self.url)
        return self._store

    def compared(self, from_step: int, keys: Sequence[str]) -> list[ComparedStep]:
        rows = self._get().step_results(self.run_id, from_step)
        return [
            ComparedStep(r.step, {k: r.metrics[k] for k in keys if k in r.metrics}, r.computed_at.isoformat())
            for r in rows
        ]

    def awaiting(self, from_step: int) -> int:
        steps = self._get().steps(self.run_id, from_step)
        return sum(1 for s in steps if s.trainer_samples and s.rollout_samples and not s.compared_samples)

    def firing(self) -> list[FiringAlert]:
        from isoaudit.audit.alerts.history import list_alerts

        return [
            FiringAlert(a.id, a.rule, a.severity, a.fired_step, a.value)
            for a in list_alerts(self._get(), run_id=self.run_id, states=["firing"])
        ]

    def close(self) -> None:
        if self._store is not None:
            self._store.dispose()
            self._store = None


class ServiceResults(Results):
    """Read from the service at ``url`` with the session's bearer ``token``."""

    def __init__(self, url: str, token: str, run_id: str, *, timeout: float = 10.0) -> None:
        import httpx
        from isoaudit.collectors.control import service_base

        self.base = f"{service_base(url)}/v1/runs/{run_id}"
        self._client = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {token}"})

    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        """The JSON list at ``path``; empty while the service does not know the run (its first
        records are not ingested yet)."""
        response = self._client.get(self.base + path, params=params)
        if response.status_code == 404:
            return []
        response.raise_for_status()
        return response.json()

    def compared(self, from_step: int, keys: Sequence[str]) -> list[ComparedStep]:
        rows = self._get("/metrics", {"from_step": from_step, "names": list(keys)})
        return [ComparedStep(int(r["step"]), r["metrics"], str(r["computed_at"])) for r in rows]

    def awaiting(self, from_step: int) -> int:
        return sum(
            1
            for s in self._get("/steps")
            if s["step"] >= from_step
            and s["trainer_samples"]
            and s["rollout_samples"]
            and not s["compared_samples"]
        )

    def firing(self) -> list[FiringAlert]:
        return [
            FiringAlert(int(a["id"]), a["rule"], a["severity"], a.get("fired_step"), a.get("value"))
            for a in self._get("/alerts", {"state": "firing"})
        ]

    def close(self) -> None:
        self._client.close()


def results_of(destination: Destination, run_id: str) -> Results | None:
    """Where ``destination``'s results of ``run_id`` are read; None for one that keeps none."""
    from isoaudit.collectors.sessions import DatabaseDestination, ServiceDestination

    if isinstance(destination, ServiceDestination):
        return ServiceResults(destination.url, destination.token, run_id, timeout=destination.timeout)
    if isinstance(destination, DatabaseDestination):
        return StoreResults(destination.url, run_id)
    return None


# ---------------------------------------------------------------- the follower


@dataclass
class TrackerReport:
    """What one tracker got: compared steps logged, alerts raised, failures, and into which run."""

    tracker: Tracker
    target: str = ""
    shared: bool = False
    steps: int = 0
    alerts: int = 0
    errors: int = 0
    dropped: int = 0

    def __str__(self) -> str:
        into = (
            f"the job's run {self.target}"
            if self.shared
            else f"isoaudit's run {self.target or '(none opened)'}"
        )
        text = f"{self.tracker}: {self.steps} compared steps into {into}"
        text += f", {self.alerts} alerts" if self.alerts else ""
        text += f", {self.dropped} dropped" if self.dropped else ""
        return text + (f", {self.errors} errors" if self.errors else "")


@dataclass
class TrackersReport:
    run_id: str
    trackers: list[TrackerReport] = field(default_factory=list)
    not_compared: int = 0  # steps still waiting for comparison when the session closed

    def __str__(self) -> str:
        text = f"isoaudit run {self.run_id} in trackers: " + "; ".join(str(t) for t in self.trackers)
        if self.not_compared:
            text += (
                f"; {self.not_compared} steps not compared yet, not logged (`isoaudit compare {self.run_id}`)"
            )
        return text


class SessionTrackers:
    """Follows run ``run_id``'s compared steps in ``results`` into ``trackers`` from a thread of its own.

    ``names``: the framework whose names figures get (None: isoaudit's); ``settings``: where runs of
    isoaudit's own go; ``interval``: seconds between reads; ``lookback``: how many steps below the
    newest compared one are read again (a step compared late, or compared again); ``settle_s``: the
    most seconds closing waits for steps stored on both sides but not compared yet."""

    def __init__(
        self,
        run_id: str,
        results: Results,
        trackers: Sequence[Tracker],
        *,
        names: str | None = None,
        settings: TrackerSettings | None = None,
        interval: float = INTERVAL_S,
        lookback: int = 32,
        settle_s: float = 10.0,
        retry_s: float = 60.0,
    ) -> None:
        self.run_id = run_id
        self.results = results
        self.trackers: tuple[Tracker, ...] = tuple(trackers)
        self.names = check_framework(names, "tracker_names")
        self.settings = settings or TrackerSettings()
        self.interval = interval
        self.lookback = lookback
        self.settle_s = settle_s
        self.retry_s = retry_s
        self.report = TrackersReport(run_id, [TrackerReport(t) for t in self.trackers])
        self._by_tracker = {r.tracker: r for r in self.report.trackers}
        self._keys = source_keys(self.names)
        self._writers: dict[Tracker, TrackerWriter] = {}
        self._failed: dict[Tracker, float] = {}
        self._seen: dict[int, str] = {}  # step -> computed_at as logged
        self._top: int | None = None  # the newest compared step seen
        self._announced: set[int] = set()  # alert ids raised already
        self._mlflow: tuple[str, str | None] | None = None  # the job's active run and tracking URI
        self._warned: set[str] = set()
        self._closing = threading.Event()
        self._settle_until = 0.0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the job's thread

    def capture(self) -> None:
        """Called from the job's thread (session start, ``record_stats``): note the MLflow run active
        there (MLflow's active run is thread-local). Never imports MLflow: a job that did not import
        it has no active run."""
        mlflow = sys.modules.get("mlflow")
        if "mlflow" not in self.trackers or mlflow is None:
            return
        try:
            active = mlflow.active_run()
            if active is not None:
                self._mlflow = (active.info.run_id, mlflow.get_tracking_uri())
        except Exception as exc:  # never into the job
            self._warn("capture", "mlflow: cannot read the job's active run: %s", exc)

    def start(self) -> SessionTrackers:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="isoaudit-trackers", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> TrackersReport:
        """Read once more, waiting up to ``settle_s`` (at most half of ``timeout``) for steps not
        compared yet, then hand over what waits and finish isoaudit's own runs; returns the report.
        A tracker still busy after ``timeout`` seconds is left behind (its thread is a daemon)."""
        self._settle_until = time.monotonic() + max(0.0, min(self.settle_s, timeout / 2))
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("isoaudit: trackers still busy after %.0f s; left behind", timeout)
        return self.report

    # ------------------------------------------------------------------ the follower's thread

    def _loop(self) -> None:
        try:
            while not self._closing.wait(self.interval):  # the first read once records may be stored
                self._tick()
            self._settle()
            for tracker, writer in self._writers.items():
                try:
                    writer.close()
                except Exception as exc:
                    self._error(tracker, "close", "%s: closing failed: %s", tracker, exc)
                self._count(tracker, writer)
        finally:
            self.results.close()

    def _from_step(self) -> int:
        return 0 if self._top is None else max(0, self._top - self.lookback)

    def _tick(self) -> None:
        from_step = self._from_step()
        try:
            steps = self.results.compared(from_step, self._keys)
        except Exception as exc:
            self._warn("read", "isoaudit: reading run %s's results failed: %s", self.run_id, exc)
            steps = []
        for compared in steps:
            if self._seen.get(compared.step) == compared.computed_at:
                continue
            self._seen[compared.step] = compared.computed_at
            self._top = compared.step if self._top is None else max(self._top, compared.step)
            self._log(compared.step, tracked_figures(compared.metrics, self.names))
        for step in [s for s in self._seen if s < from_step]:
            del self._seen[step]
        for tracker, writer in self._writers.items():
            try:
                writer.poll()
            except Exception as exc:
                self._error(tracker, "poll", "%s: logging failed: %s", tracker, exc)
            self._count(tracker, writer)
        if "wandb" in self.trackers and self._top is not None:
            self._alerts()

    def _settle(self) -> None:
        """Read until no step waits for comparison (each read after the check, so a step compared
        just before it is read), or until the settle time is up."""
        while True:
            try:
                waiting = self.results.awaiting(self._from_step())
            except Exception:
                waiting = 0
            self._tick()
            if not waiting or time.monotonic() >= self._settle_until:
                break
            time.sleep(min(0.25, self.interval))
        self.report.not_compared = waiting

    def _log(self, step: int, figures: dict[str, float]) -> None:
        for tracker, writer in self._open().items():
            try:
                writer.log(step, figures)
            except Exception as exc:
                self._error(tracker, "log", "%s: logging step %s failed: %s", tracker, step, exc)

    def _alerts(self) -> None:
        try:
            firing = self.results.firing()
        except Exception as exc:
            self._warn("alerts", "isoaudit: reading run %s's alerts failed: %s", self.run_id, exc)
            return
        writer = self._open().get("wandb")
        for alert in firing:
            if alert.id in self._announced or writer is None:
                continue
            value = "no data" if alert.value is None else f"{alert.value:.6g}"
            text = f"{alert.rule} ({alert.severity}) fired on run {self.run_id} at step {alert.step}: value {value}"
            try:
                writer.alert(alert_title(alert.rule, self.run_id), text, alert_level(alert.severity))
            except Exception as exc:
                self._error("wandb", "alert", "wandb: alert failed: %s", exc)
                continue
            self._announced.add(alert.id)
            self._by_tracker["wandb"].alerts += 1

    def _open(self) -> dict[Tracker, TrackerWriter]:
        """The writers, opening those not open yet (a failed one again after ``retry_s``)."""
        now = time.monotonic()
        for tracker in self.trackers:
            if tracker in self._writers or now - self._failed.get(tracker, -self.retry_s) < self.retry_s:
                continue
            try:
                self._writers[tracker] = self._open_writer(tracker)
            except Exception as exc:
                self._failed[tracker] = now
                self._error(
                    tracker,
                    "open",
                    "%s: cannot open a run for isoaudit run %s: %s",
                    tracker,
                    self.run_id,
                    exc,
                )
                continue
            report = self._by_tracker[tracker]
            report.target, report.shared = self._writers[tracker].target, self._writers[tracker].shared
        return self._writers

    def _open_writer(self, tracker: Tracker) -> TrackerWriter:
        if tracker == "wandb":
            from isoaudit.audit.trackers.wandb_writer import WandbWriter

            wandb = sys.modules.get("wandb")
            job_run = getattr(wandb, "run", None) if wandb is not None else None
            if job_run is not None:
                return WandbWriter.attach(job_run, self.run_id)
            return WandbWriter.own(
                self.run_id,
                project=self.settings.wandb_project,
                entity=self.settings.wandb_entity,
                mode=self.settings.wandb_mode,
            )
        from isoaudit.audit.trackers.mlflow_writer import MlflowWriter

        if self._mlflow is not None:
            active, uri = self._mlflow
            return MlflowWriter.attach(active, self.run_id, tracking_uri=uri)
        return MlflowWriter.own(
            self.run_id,
            tracking_uri=self.settings.mlflow_tracking_uri,
            experiment=self.settings.mlflow_experiment,
        )

    def _count(self, tracker: Tracker, writer: TrackerWriter) -> None:
        report = self._by_tracker[tracker]
        report.steps = writer.logged
        report.dropped = int(getattr(writer, "dropped", 0))

    def _error(self, tracker: Tracker, kind: str, message: str, *args: object) -> None:
        self._by_tracker[tracker].errors += 1
        self._warn(f"{tracker}-{kind}", message, *args)

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Each kind of trouble is a warning the first time, debug afterwards: never once per step."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, message, *args)


def follow(
    run_id: str,
    destination: Destination,
    trackers: Sequence[Tracker],
    *,
    names: str | None = None,
    rank: int | None = None,
) -> SessionTrackers | None:
    """A started follower of ``run_id``'s results at ``destination`` into ``trackers``, or None: no
    trackers, a rank other than 0 (rank 0 logs for the whole run), or a destination that keeps no
    results (a memory destination: said once in the log)."""
    if not trackers:
        return None
    if rank is None:
        from isoaudit.collectors.integrations.ranks import detect_rank

        rank = detect_rank()
    if rank not in (None, 0):
        return None
    results = results_of(destination, run_id)
    if results is None:
        log.warning(
            "isoaudit: trackers %s: %s keeps no comparison results; nothing is logged", trackers, destination
        )
        return None
    settings = TrackerSettings.from_env()
    return SessionTrackers(
        run_id, results, trackers, names=names or settings.names, settings=settings, interval=INTERVAL_S
    ).start()
