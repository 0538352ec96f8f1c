"""Control: the remediation mode a run's collectors should apply, as a channel of its own.

The dashboard (or ``PUT /v1/runs/{id}/control``) sets a run's desired mode in its control record,
versioned. Every collector asks its :class:`ControlChannel` at each step boundary what is desired;
the channel answers from what it last knew and refreshes itself at most once per ``interval``
seconds, so asking costs nothing on most steps. Where the answer comes from depends on how the
job reaches isoaudit, not on which side asks:

* :class:`StoreControl`: direct writers read the control record from the store;
* :class:`ServiceControl`: service clients learn it from every ingest reply (the sink offers it)
  and poll ``GET /v1/runs/{id}/control`` when no reply came for a while;
* :class:`FixedControl`: set by hand (notebooks, tests, a job with its own control plane).

A failed refresh is logged once and backs off; the last known mode stays in force. Asking never
raises into the job, and never holds it for longer than ``wait``: a refresh runs on a thread of its
own, so a service or database that hangs (a dropped SYN, a frozen server) costs the job at most
``wait`` once per refresh, not the client's timeout; its answer then applies at a later step.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import httpx
from isoaudit.audit.control import REMEDIATION_MODES, ControlRecord, RemediationMode
from isoaudit.collectors.counting import LogOnce

if TYPE_CHECKING:
    from isoaudit.collectors.sinks.direct import SharedStore

log = logging.getLogger(__name__)

#: The modes the service may ask for, and the control record that asks (defined in audit.control).
Mode = RemediationMode
MODES = REMEDIATION_MODES
Control = ControlRecord


class ControlChannel(ABC):
    """The desired mode of one run, refreshed at most every ``interval`` seconds (0: on every ask).

    ``max_backoff``: after failed refreshes the wait doubles up to this, so a destination that is
    down is asked now and then, not at every step. ``wait``: the most a due refresh may hold the
    asking step (it goes on in the background past that; a local answer comes well within it, so
    a change usually applies at the very next step).
    """

    #: Whether refreshes run on a thread of their own (channels that answer from memory: no).
    refreshes_in_background: bool = True

    def __init__(
        self, run_id: str, *, interval: float = 1.0, max_backoff: float = 60.0, wait: float = 0.25
    ) -> None:
        if interval < 0:
            raise ValueError(f"interval: must be >= 0 seconds, got {interval}")
        if wait < 0:
            raise ValueError(f"wait: must be >= 0 seconds, got {wait}")
        self.run_id = run_id
        self.interval = interval
        self.wait = wait
        self.max_backoff = max(max_backoff, interval)
        self._known: Control | None = None
        self._next_poll = 0.0
        self._failures = 0
        self._lock = threading.Lock()
        self._refreshing: threading.Thread | None = None
        self._warn = LogOnce(log)

    def desired(self) -> Control | None:
        """The mode to apply (``None`` until anything is known). Never raises, holds the step at
        most ``wait`` seconds, and refreshes only when one is due (never two at once)."""
        if time.monotonic() >= self._next_poll:
            if not self.refreshes_in_background:
                self.refresh()
            else:
                with self._lock:
                    started = self._refreshing is None or not self._refreshing.is_alive()
                    if started:
                        self._refreshing = threading.Thread(
                            target=self.refresh, name=f"isoaudit-control-{self.run_id}", daemon=True
                        )
                        self._refreshing.start()
                    refreshing = self._refreshing
                # One in flight already: answer from memory, do not wait again.
                if started and refreshing is not None:
                    refreshing.join(self.wait)
        return self._known

    def refresh(self) -> Control | None:
        """Refresh now, whatever the interval (a failure keeps the last known mode)."""
        try:
            found = self._poll()
        except Exception as exc:  # a collector must never raise into the job
            self._failures += 1
            delay = min(self.max_backoff, max(self.interval, 0.5) * 2**self._failures)
            self._next_poll = time.monotonic() + delay
            self._warn.warn(
                "poll",
                f"isoaudit control: cannot read run {self.run_id!r}'s control ({type(exc).__name__}: "
                f"{exc}); keeping mode {self._known.mode if self._known else 'native'}, retrying",
            )
            return self._known
        if self._failures:
            self._warn.forget("poll")
        self._failures = 0
        self._next_poll = time.monotonic() + self.interval
        if found is not None:
            self.offer(found)
        return self._known

    def offer(self, control: Control) -> None:
        """Learn ``control`` from elsewhere (an ingest reply); a newer version wins."""
        with self._lock:
            if self._known is None or control.version >= self._known.version:
                self._known = control

    def close(self) -> None:
        """Release what the channel holds (nothing by default)."""
        return None

    @abstractmethod
    def _poll(self) -> Control | None:
        """Read the current control record, or raise."""


class FixedControl(ControlChannel):
    """A channel set by hand with :meth:`set` (each call bumps the version)."""

    refreshes_in_background = False

    def __init__(self, run_id: str, mode: str = "native") -> None:
        super().__init__(run_id, interval=0.0)
        self._fixed = Control.model_validate({"mode": mode, "version": 0})

    def set(self, mode: str) -> Control:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self._fixed = Control.model_validate({"mode": mode, "version": self._fixed.version + 1})
        return self._fixed

    def _poll(self) -> Control | None:
        return self._fixed


class StoreControl(ControlChannel):
    """Reads ``Store.get_control(run_id)`` from the database the job writes to directly."""

    def __init__(self, run_id: str, store: SharedStore, *, interval: float = 1.0) -> None:
        super().__init__(run_id, interval=interval)
        self.store = store

    def _poll(self) -> Control | None:
        return self.store.get().get_control(self.run_id)


class ServiceControl(ControlChannel):
    """Learns the mode from the sinks' ingest replies (:meth:`offer`) and, when none came within
    ``interval`` seconds, polls ``GET {url}/v1/runs/{run_id}/control`` (``timeout`` seconds at most)."""

    def __init__(
        self, run_id: str, url: str, token: str, *, interval: float = 2.0, timeout: float = 1.0
    ) -> None:
        super().__init__(run_id, interval=interval)
        self.url = f"{service_base(url)}/v1/runs/{run_id}/control"
        self._client = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {token}"})

    def offer(self, control: Control) -> None:
        super().offer(control)
        self._next_poll = time.monotonic() + self.interval  # a fresh reply: no poll needed yet

    def _poll(self) -> Control | None:
        response = self._client.get(self.url)
        if response.status_code == 404:
            return None  # the run is not stored yet: nothing set
        response.raise_for_status()
        return Control.model_validate(response.json())

    def close(self) -> None:
        refreshing = self._refreshing
        if refreshing is not None:
            refreshing.join(self.wait)  # let a refresh in flight finish before its client goes
        self._client.close()


def service_base(url: str) -> str:
    """The service's base URL from one given with or without a ``/v1/...`` path."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url: expected http(s)://host[:port], got {url!r}")
    url = url.rstrip("/")
    return url.split("/v1/", 1)[0] if "/v1/" in url else url.removesuffix("/v1")
