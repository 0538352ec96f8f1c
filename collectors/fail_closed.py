"""Fail-closed sessions: ``isoaudit.session(run, fail_closed=True)`` stops the job once its run holds a
non-identical token (:mod:`isoaudit.audit.metrics.exact`), for stacks meant to be bitwise identical.

Steps are compared asynchronously (the session's comparer, :mod:`isoaudit.collectors.comparer`, or the
service), so the check runs in two places:

* **during the run**: a watcher thread reads the run's compared steps every ``interval`` seconds
  (the store, or the service's ``GET /v1/runs/{run}/metrics``; the newest steps and ``lookback``
  below them, so a step compared again is read again). Once it has read a step with a differing
  token, the next step boundary of the session raises :class:`NotIdentical`: the ``begin_step`` or
  ``record_step`` of any of its collectors (before it records anything) and
  :meth:`Session.check <isoaudit.collectors.sessions.Session.check>`. The step it names is the
  earliest known, with its count of differing tokens and max ``|Δ|``. A job therefore runs on for at
  most the comparison's lag plus ``interval`` after the step that differed.
* **at close**: the session closes as ever (collectors detached, sinks flushed, its comparer drained
  within ``compare_timeout``), then waits up to ``settle_s`` for steps stored on both sides to be
  compared (none when its own comparer has drained already), reads every compared step once more
  and raises :class:`NotIdentical` if any differs, else :class:`ParityUnverified` if steps stored on
  both sides are still not compared, a compared step has no bitwise count, no step was compared at
  all, or the results cannot be read. Fail-closed: what is not verified identical does not pass. It
  verifies the tokens both sides recorded: a sample only one side recorded is never compared.

A session closing because the job raised already does not raise again. The watcher itself never
raises into the job (a failed read is logged and retried); only the opted-in checks above raise.
A destination that keeps no results (:class:`~isoaudit.collectors.sessions.MemoryDestination`) is
refused when the session is built.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from isoaudit.audit.metrics.exact import EXACT_KEYS, Exactness, NotIdentical, ParityUnverified

if TYPE_CHECKING:
    from isoaudit.collectors.base import Collector
    from isoaudit.collectors.trackers import Results

log = logging.getLogger(__name__)

#: Seconds between the watcher's reads of the run's compared steps.
INTERVAL_S = 1.0
#: The collector methods that are step boundaries of a fail-closed session.
BOUNDARIES: tuple[str, ...] = ("begin_step", "record_step")


class FailClosed:
    """Watches run ``run_id``'s compared steps in ``results`` for a non-identical token (see the
    module docstring)."""

    def __init__(
        self, run_id: str, results: Results, *, interval: float = INTERVAL_S, lookback: int = 32
    ) -> None:
        self.run_id = run_id
        self.results = results
        self.interval = interval
        self.lookback = lookback
        self.read_errors = 0
        self._lock = threading.Lock()
        self._failing: dict[int, Exactness] = {}  # step -> what was read of it, while it differs
        self._top: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._quiet = False
        self._closed = False

    def start(self) -> FailClosed:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="isoaudit-fail-closed", daemon=True)
            self._thread.start()
        return self

    # ---------------------------------------------------------------- the job's thread

    def check(self) -> None:
        """Raise :class:`NotIdentical` if a compared step is known to hold a non-identical token."""
        with self._lock:
            failing = sorted(self._failing.items())
        if failing:
            raise NotIdentical(self.run_id, failing[0][1], len(failing))

    def guard(self, collector: Collector, check: Callable[[], None]) -> None:
        """Make ``collector``'s step boundaries (:data:`BOUNDARIES`) call ``check()`` first."""
        for name in BOUNDARIES:
            method = getattr(collector, name, None)
            if method is None:
                continue

            @functools.wraps(method)
            def checked(*args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
                check()
                return _method(*args, **kwargs)

            setattr(collector, name, checked)

    def quiet(self) -> None:
        """Close without raising (the job is failing already)."""
        self._quiet = True

    def close(self, settle_s: float) -> None:
        """Stop watching, wait up to ``settle_s`` for stored steps to be compared, read every compared
        step and raise :class:`NotIdentical` or :class:`ParityUnverified` unless all are identical
        (nothing when :meth:`quiet`). Idempotent: only the first call can raise."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(5.0, 2 * self.interval))
        try:
            self._final(settle_s)
        finally:
            self.results.close()

    # ---------------------------------------------------------------- reading

    def _final(self, settle_s: float) -> None:
        if self._quiet:
            return
        deadline = time.monotonic() + max(0.0, settle_s)
        try:
            while True:
                waiting = self.results.awaiting(0)
                if not waiting or time.monotonic() >= deadline:
                    break
                time.sleep(min(0.25, self.interval))
            found = [Exactness.of(s.step, s.metrics) for s in self.results.compared(0, EXACT_KEYS)]
        except Exception as exc:
            log.warning("isoaudit: fail-closed: run %s's results cannot be read: %s", self.run_id, exc)
            self.check()  # what was seen differing during the run is still known
            raise ParityUnverified(self.run_id, None, str(exc)) from exc
        differing = [e for e in found if e.differing_tokens]
        if differing:
            raise NotIdentical(self.run_id, differing[0], len(differing))
        self.check()  # seen differing during the run (a result replaced since still failed it)
        unknown = [e for e in found if e.differing_tokens is None]
        if waiting or unknown:
            why = f"no bitwise count at step {unknown[0].step}" if unknown else "compare_timeout"
            raise ParityUnverified(self.run_id, waiting + len(unknown), why)
        if not found:
            raise ParityUnverified(self.run_id, 0, "no step of the run was compared")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._tick()

    def _tick(self) -> None:
        from_step = 0 if self._top is None else max(0, self._top - self.lookback)
        try:
            steps = self.results.compared(from_step, EXACT_KEYS)
        except Exception as exc:
            self.read_errors += 1
            if self.read_errors == 1:
                log.warning("isoaudit: fail-closed: reading run %s's results failed: %s", self.run_id, exc)
            return
        with self._lock:
            for compared in steps:
                self._top = compared.step if self._top is None else max(self._top, compared.step)
                found = Exactness.of(compared.step, compared.metrics)
                if found.differing_tokens:
                    self._failing[compared.step] = found
