"""A session's own comparer: a job writing straight to a database gets its steps compared and its
alerts evaluated with nothing else started.

Steps written to a database are compared by a comparison worker (``isoaudit.audit.worker``). With a
database destination the session starts one for its run, in one of three ways (``compare=``):

* ``"process"`` (the default): ``isoaudit worker --run RUN`` as a child process of the job, supervised
  (restarted if it exits) and killed by the kernel if the job dies. Comparison is CPU-bound Python;
  in a child it never competes with the training loop for the job's GIL, and a crash of it is not a
  crash of the job. It costs one interpreter start (about a second, in the background).
* ``"thread"``: the same worker as a thread of the job (where a job may not start processes).
* ``"none"``: nothing here; the team's own ``isoaudit worker`` fleet or ``isoaudit serve`` compares.

Only the session of rank 0 (or of a job without ranks) starts one: the ranks of a job share the
run, and the queue hands each step to one worker under a lease anyway. Closing drains: the session
waits (at most ``timeout`` seconds, printing progress on long waits) until every step of its run
whose two sides are stored is compared, then stops the comparer, and says how many steps are left
and the command that compares them when some are. Nothing here raises into the job: a failure is
logged, counted in the report, and the job goes on.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TextIO, cast, get_args

if TYPE_CHECKING:
    from isoaudit.audit.alerts.engine import AlertEngine
    from isoaudit.audit.db import Store
    from isoaudit.audit.worker import ComparisonWorker, WorkerProcess
    from isoaudit.collectors.sinks.direct import SharedStore

log = logging.getLogger(__name__)

#: How a database destination's steps get compared (see the module docstring).
CompareMode = Literal["process", "thread", "none"]
COMPARE_MODES: tuple[str, ...] = get_args(CompareMode)
#: The environment variable giving the mode when the session's ``compare`` argument does not.
COMPARE_ENV = "ISOAUDIT_COMPARE"
#: Seconds a closing session waits for its run's steps to be compared, by default.
DEFAULT_COMPARE_TIMEOUT_S = 120.0
#: The comparer process yields the CPU to the job (it catches up at close, when the job is done)...
COMPARER_NICE = 10
#: ... and runs one BLAS/OpenMP thread: pools of spinning threads in two processes on the same cores
#: (the job's torch, the comparer's numpy) slow both; comparison needs no parallel BLAS.
#: Its figures reach W&B and MLflow through the session's own follower (``trackers=``), never
#: through the worker's trackers, which the job's ``ISOAUDIT_WANDB_PROJECT`` /
#: ``ISOAUDIT_MLFLOW_TRACKING_URI`` would otherwise turn on in the child as well (empty is unset).
COMPARER_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ISOAUDIT_WANDB_PROJECT": "",
    "ISOAUDIT_MLFLOW_TRACKING_URI": "",
}


def compare_mode(value: str | None = None, environ: Mapping[str, str] | None = None) -> CompareMode:
    """``value``, else ``ISOAUDIT_COMPARE``, else ``"process"``; anything else is refused, naming the
    option."""
    env = os.environ if environ is None else environ
    chosen = value if value is not None else (env.get(COMPARE_ENV) or "process")
    if chosen not in COMPARE_MODES:
        source = "compare" if value is not None else COMPARE_ENV
        raise ValueError(f"{source}: expected one of {', '.join(COMPARE_MODES)}, got {chosen!r}")
    return cast(CompareMode, chosen)


def worker_command(database_url: str) -> str:
    """The command that compares what a store holds and exits (the password left out)."""
    from isoaudit.audit.db import redacted_url

    return f"isoaudit worker --once --database-url '{redacted_url(database_url)}'"


@dataclass(frozen=True)
class ComparisonReport:
    """How a session's run stood when its comparer stopped: ``compared`` steps with results, ``left``
    steps whose two sides are stored but which are not compared (``None``: the store could not be
    read), ``command`` that compares them, and the comparer's ``errors`` (failed starts and passes,
    restarts, failed reads), none of which reached the job."""

    mode: CompareMode
    compared: int | None
    left: int | None
    command: str
    errors: int = 0

    def __str__(self) -> str:
        if self.compared is None or self.left is None:
            return f"comparison state unknown (the store did not answer); compare with: {self.command}"
        text = f"{self.compared} step{'' if self.compared == 1 else 's'} compared"
        if self.left:
            text += (
                f", {self.left} not yet: compare {'it' if self.left == 1 else 'them'} with: {self.command}"
            )
        if self.errors:
            text += f" (comparer errors {self.errors}, logged)"
        return text


class SessionComparer:
    """The comparer of one run of a job writing to ``shared``'s database (see the module docstring).

    ``timeout``: the most :meth:`close` waits for the run's steps; ``report``: print progress of a
    long wait to ``out``; ``interval``: seconds between passes (``ISOAUDIT_WORKER_INTERVAL_S`` if
    None)."""

    #: A wait longer than this prints progress, then every ``progress_every`` seconds.
    progress_after = 2.0
    progress_every = 5.0

    def __init__(
        self,
        shared: SharedStore,
        run_id: str,
        mode: CompareMode,
        *,
        timeout: float = DEFAULT_COMPARE_TIMEOUT_S,
        report: bool = True,
        out: TextIO | None = None,
        stop_timeout_s: float = 10.0,
    ) -> None:
        if timeout < 0:
            raise ValueError(f"compare_timeout: must be >= 0 seconds, got {timeout}")
        self.shared = shared
        self.run_id = run_id
        self.mode = mode
        self.timeout = timeout
        self.report = report
        self.out = out
        self.stop_timeout_s = stop_timeout_s
        self.errors = 0
        self._process: WorkerProcess | None = None
        self._thread: threading.Thread | None = None
        self._worker: ComparisonWorker | None = None
        self._engine: AlertEngine | None = None
        self._store: Store | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ start

    def start(self) -> SessionComparer:
        """Start comparing in the background (never raises, never waits for the comparer)."""
        try:
            if self.mode == "process":
                from isoaudit.audit.worker import WorkerProcess

                self._process = WorkerProcess(
                    self.shared.url,
                    run_id=self.run_id,
                    configure_alerts=True,
                    quiet=True,
                    nice=COMPARER_NICE,
                    env=COMPARER_ENV,
                    stop_timeout_s=self.stop_timeout_s,
                ).start(timeout=0)
            elif self.mode == "thread":
                self._thread = threading.Thread(
                    target=self._run_thread, name="isoaudit-comparer", daemon=True
                )
                self._thread.start()
        except Exception:
            self.errors += 1
            log.exception("isoaudit: the comparer of run %s did not start; its steps wait", self.run_id)
        return self

    def _run_thread(self) -> None:
        """Open the store, install the configured rules and start the worker; while the database is
        down, try again now and then (the job's sinks spool meanwhile)."""
        from isoaudit.audit.alerts.setup import default_alert_engine, install_configured_rules
        from isoaudit.audit.db import Store
        from isoaudit.audit.settings import Settings
        from isoaudit.audit.worker import ComparisonWorker

        delay = 1.0
        while not self._stop.is_set():
            try:
                settings = Settings.from_env(database_url=self.shared.url)
                self._store = Store(self.shared.url)
                install_configured_rules(self._store, settings)
                self._engine = default_alert_engine(self._store, settings).start()
                self._worker = ComparisonWorker(
                    self._store,
                    on_step=self._engine.evaluate,
                    interval=settings.worker_interval_s,
                    lease_s=settings.worker_lease_s,
                    run_id=self.run_id,
                    processes=0,  # in the job's own process: it starts none
                ).start()
                return
            except Exception:
                self.errors += 1
                log.warning(
                    "isoaudit: the comparer of run %s cannot start yet; retrying in %.0f s",
                    self.run_id,
                    delay,
                    exc_info=True,
                )
                self._release_thread_parts()
                self._stop.wait(delay)
                delay = min(30.0, delay * 2)

    # ------------------------------------------------------------------ close

    def close(self) -> ComparisonReport:
        """Wait (at most ``timeout`` seconds) until every ready step of the run is compared, stop
        the comparer, and say how the run stands. Never raises."""
        self._drain()
        self._halt()
        compared: int | None = None
        left: int | None = None
        try:
            store = self.shared.get()
            compared = store.compared_steps(self.run_id)
            left = store.backlog(self.run_id).steps
        except Exception:
            self.errors += 1
            log.warning("isoaudit: run %s: cannot read how many steps are compared", self.run_id)
        if self._process is not None:
            self.errors += self._process.restarts + self._process.start_failures
        return ComparisonReport(self.mode, compared, left, worker_command(self.shared.url), self.errors)

    def _drain(self) -> int | None:
        """Steps of the run left uncompared once they all are, the time is up or Ctrl-C stopped the
        wait; None if the store cannot be read."""
        started = time.monotonic()
        deadline = started + self.timeout
        next_note = started + self.progress_after
        left: int | None = None
        try:
            while True:
                try:
                    left = self.shared.get().backlog(self.run_id).steps
                except Exception:
                    self.errors += 1
                    log.warning("isoaudit: run %s: cannot read what is left to compare", self.run_id)
                    return None
                now = time.monotonic()
                if left == 0 or now >= deadline:
                    return left
                if now >= next_note:
                    self._note(
                        f"isoaudit run {self.run_id}: comparing, {left} step{'' if left == 1 else 's'} "
                        f"left (waiting up to {deadline - now:.0f} s more, compare_timeout; Ctrl-C stops "
                        "the wait)"
                    )
                    next_note = now + self.progress_every
                time.sleep(min(0.1, max(0.0, deadline - now)))
        except KeyboardInterrupt:  # the job is over; its user chose not to wait: say what is left
            self._note(f"isoaudit run {self.run_id}: stopped waiting for the comparison")
            return left

    def _note(self, line: str) -> None:
        if self.report:
            print(line, file=self.out or sys.stderr, flush=True)
        else:
            log.info(line)

    def _halt(self) -> None:
        """Stop the comparer (a process finishes the batch it holds, then exits)."""
        self._stop.set()
        try:
            if self._process is not None:
                self._process.stop()
            if self._thread is not None:
                self._thread.join(self.stop_timeout_s)
            if self._worker is not None:
                self._worker.stop(self.stop_timeout_s)
                self.errors += self._worker.failures
            self._release_thread_parts()
        except Exception:
            self.errors += 1
            log.exception("isoaudit: stopping the comparer of run %s failed", self.run_id)

    def _release_thread_parts(self) -> None:
        engine, store = self._engine, self._store
        self._engine = self._store = None
        self._worker = None
        try:
            if engine is not None:
                engine.close()
        finally:
            if store is not None:
                store.dispose()
