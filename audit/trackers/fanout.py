"""The worker's side: every compared step of every isoaudit run into a W&B and/or MLflow run of its own.

:class:`TrackerFanout` is a per-step callback of the comparison worker (``on_step``) and, through
:class:`~isoaudit.audit.trackers.channel.WandbAlertChannel`, an alert channel. It never holds up
comparison: ``on_step`` puts the step's figures on a bounded queue (full: the step is dropped and
counted) and returns; one thread of its own opens the tracker runs (one per isoaudit run and
tracker, resumed by a stable id, so a restarted worker writes into the same runs) and logs into
them. Runs idle for ``idle_s`` are finished (a later step resumes them), at most ``max_open`` stay
open, and a tracker that fails to open a run is tried again for that run after ``retry_s``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from isoaudit.audit.trackers.base import Tracker, TrackerWriter
from isoaudit.audit.trackers.figures import tracked_figures
from isoaudit.audit.trackers.settings import TrackerSettings

if TYPE_CHECKING:
    from isoaudit.audit.db import Store

log = logging.getLogger(__name__)

#: Opens isoaudit run ``run_id``'s own run in ``tracker``: (tracker, run_id, facts of the run) -> writer.
WriterFactory = Callable[[Tracker, str, Mapping[str, str]], TrackerWriter]


def own_run_writer(settings: TrackerSettings) -> WriterFactory:
    """Writers into runs of isoaudit's own, configured by ``settings``."""

    def open_writer(tracker: Tracker, run_id: str, facts: Mapping[str, str]) -> TrackerWriter:
        if tracker == "wandb":
            from isoaudit.audit.trackers.wandb_writer import WandbWriter

            return WandbWriter.own(
                run_id,
                name=facts.get("name"),
                project=settings.wandb_project,
                entity=settings.wandb_entity,
                mode=settings.wandb_mode,
                group=facts.get("project"),
                config={f"isoaudit.{k}": v for k, v in facts.items()},
            )
        from isoaudit.audit.trackers.mlflow_writer import MlflowWriter

        return MlflowWriter.own(
            run_id,
            tracking_uri=settings.mlflow_tracking_uri,
            experiment=settings.mlflow_experiment,
            tags={f"isoaudit.{k}": v for k, v in facts.items()},
        )

    return open_writer


@dataclass
class _Alert:
    run_id: str
    title: str
    text: str
    level: str
    done: Future[str | None] = field(default_factory=Future)


@dataclass
class _Open:
    writers: dict[Tracker, TrackerWriter]
    used: float


class TrackerFanout:
    """Per-step figures and alerts of every run into its own tracker runs, from a thread of its own.

    ``trackers``: which (``wandb``, ``mlflow``); ``settings``: where, and under which names;
    ``store``: where each run's name and project are read (its W&B group and display name, its
    MLflow tags); ``open_writer``: how a run is opened (default :func:`own_run_writer`)."""

    def __init__(
        self,
        trackers: Sequence[Tracker],
        settings: TrackerSettings,
        *,
        store: Store | None = None,
        open_writer: WriterFactory | None = None,
        queue_size: int = 1024,
        idle_s: float = 600.0,
        max_open: int = 64,
        retry_s: float = 60.0,
    ) -> None:
        self.trackers: tuple[Tracker, ...] = tuple(trackers)
        self.settings = settings
        self.store = store
        self.open_writer = open_writer or own_run_writer(settings)
        self.idle_s = idle_s
        self.max_open = max_open
        self.retry_s = retry_s
        self.logged = 0  # (step, tracker) pairs handed to a tracker
        self.dropped = 0  # steps not logged: the queue was full
        self.errors = 0  # failed opens, logs, alerts and closes
        self._queue: queue.Queue[tuple[str, int, dict[str, float]] | _Alert] = queue.Queue(queue_size)
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._failed: dict[tuple[str, Tracker], float] = {}  # when opening last failed
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the worker's side

    def on_step(self, run_id: str, step: int, metrics: Mapping[str, Any]) -> None:
        """The comparison worker's per-step callback: queue the step's figures, never wait."""
        figures = tracked_figures(metrics, self.settings.names)
        try:
            self._queue.put_nowait((run_id, step, figures))
        except queue.Full:
            self.dropped += 1
            self._warn_once("full", "tracker queue full: compared steps are not logged to %s", self.trackers)
        self.start()

    def alert(self, run_id: str, title: str, text: str, level: str, timeout: float = 30.0) -> str | None:
        """Raise an alert in run ``run_id``'s W&B run (opened if need be); None once done, else why not."""
        if "wandb" not in self.trackers:
            return "W&B is not configured (ISOAUDIT_WANDB_PROJECT)"
        item = _Alert(run_id, title, text, level)
        try:
            self._queue.put(item, timeout=timeout)
        except queue.Full:
            return "tracker queue full"
        self.start()
        try:
            return item.done.result(timeout)
        except TimeoutError:
            return f"not handed to W&B within {timeout:.0f} s"

    def start(self) -> TrackerFanout:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._loop, name="isoaudit-trackers", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Log what is queued, finish every open run (within ``timeout`` seconds, then give up)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("trackers: still busy after %.0f s; left behind", timeout)

    # ------------------------------------------------------------------ the tracker thread

    def _loop(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                item = None
            if isinstance(item, _Alert):
                item.done.set_result(self._alert(item))
            elif item is not None:
                self._log(*item)
            self._close_idle()
        for run_id in list(self._open):
            self._close_run(run_id)

    def _log(self, run_id: str, step: int, figures: dict[str, float]) -> None:
        for tracker, writer in self._writers(run_id).items():
            try:
                writer.log(step, figures)
                self.logged += 1
            except Exception as exc:
                self._error(
                    f"log-{tracker}", "%s: logging run %s step %s failed: %s", tracker, run_id, step, exc
                )

    def _alert(self, item: _Alert) -> str | None:
        writer = self._writers(item.run_id).get("wandb")
        if writer is None:
            return "the run's W&B run could not be opened"
        try:
            writer.alert(item.title, item.text, item.level)
        except Exception as exc:
            self._error("alert", "wandb: alert on run %s failed: %s", item.run_id, exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def _writers(self, run_id: str) -> dict[Tracker, TrackerWriter]:
        """The run's open writers, opening those not open (unless one failed within ``retry_s``)."""
        now = time.monotonic()
        entry = self._open.get(run_id)
        if entry is None:
            entry = self._open[run_id] = _Open({}, now)
            while len(self._open) > self.max_open:
                self._close_run(next(iter(self._open)))
        entry.used = now
        self._open.move_to_end(run_id)
        missing = [t for t in self.trackers if t not in entry.writers]
        if missing:
            facts = self._facts(run_id)
            for tracker in missing:
                if now - self._failed.get((run_id, tracker), -self.retry_s) < self.retry_s:
                    continue
                try:
                    entry.writers[tracker] = self.open_writer(tracker, run_id, facts)
                    self._failed.pop((run_id, tracker), None)
                except Exception as exc:
                    self._failed[(run_id, tracker)] = now
                    self._error(f"open-{tracker}", "%s: cannot open a run for %s: %s", tracker, run_id, exc)
        return entry.writers

    def _facts(self, run_id: str) -> dict[str, str]:
        if self.store is None:
            return {}
        try:
            run = self.store.get_run(run_id)
        except Exception:
            return {}
        return {} if run is None else {"project": run.project, "name": run.name}

    def _close_idle(self) -> None:
        cutoff = time.monotonic() - self.idle_s
        for run_id in [r for r, e in self._open.items() if e.used < cutoff]:
            self._close_run(run_id)

    def _close_run(self, run_id: str) -> None:
        entry = self._open.pop(run_id, None)
        for tracker, writer in (entry.writers if entry else {}).items():
            try:
                writer.close()
            except Exception as exc:
                self._error(
                    f"close-{tracker}", "%s: finishing the run of %s failed: %s", tracker, run_id, exc
                )

    def _error(self, kind: str, message: str, *args: object) -> None:
        self.errors += 1
        self._warn_once(kind, message, *args)

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        """Each kind of trouble is logged as a warning the first time, at debug level afterwards."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, message, *args)
