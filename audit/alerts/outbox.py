"""The durable outbox of alert notices: one row per notice and destination (``alert_outbox``),
written in the transaction that claims the announcement, delivered by one thread per destination.

Why: a notice held only in memory is lost when the worker is killed, and notices sent from one
thread wait behind a webhook that retries for minutes. Here a pending notice survives a restart
(the next worker delivers it, once: the row is deleted in the transaction that records the
outcome), each destination has its own thread, and within a destination notices go out in order
(a resolution never overtakes its firing). Attempts are spaced by the channel's backoff; the
outcome is recorded in ``alert_notifications`` with every attempt, as a synchronous send records it.

Several workers may share one database: a destination's oldest pending row is taken under a lease
(``claimed_by``/``claimed_until``), so one worker sends it; a receiver that took a message but whose
answer was lost (the worker killed mid-request, a timeout) gets it again: at least once, like any
webhook, and exactly once whenever the attempt's outcome was recorded.

A channel with a ``repost_s`` (Alertmanager, which ends an alert nobody posts again) has its firing
alerts posted again at that interval until they resolve. Once a firing notice's outcome is recorded
its row stays, as the alert's one standing re-post for that destination (bounded: one row per firing
alert and destination), due every ``repost_s``. A re-post holds up no notice while it waits, records
no notification (the alert was announced once), and is dropped when it falls due after the alert
stopped firing or its resolution was announced (one already in flight is sent before the
resolution). A firing notice whose attempts all failed on transport errors or 5xx is posted again
the same way, so an Alertmanager that was down gets the alert once it is back; one refused as such
(4xx) is not.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, TypeGuard

from isoaudit.audit.alerts.channels import ATTEMPTS_KEY, Notice, attempt_record
from isoaudit.audit.db import Store
from isoaudit.audit.db.alerts import REPOST, Notification, OutboxEntry, OutboxRepository
from isoaudit.audit.records import utcnow

log = logging.getLogger("isoaudit.alerts")

#: A claimed notice is retaken by another worker this long after its attempt's timeout ran out
#: (its worker died mid-attempt: a restart delivers it within the timeout plus this).
LEASE_MARGIN_S = 2.0


class OutboxChannel(Protocol):
    """A channel the outbox can deliver to: one attempt at a time, with its own backoff."""

    name: str
    attempts: int
    timeout_s: float
    #: Seconds between re-posts of a firing alert; None: each notice is sent once.
    repost_s: float | None

    @property
    def destination(self) -> str: ...

    def payload(self, notice: Notice, now: datetime) -> dict[str, Any]: ...

    def attempt(self, payload: dict[str, Any]) -> tuple[str, bool]: ...

    def wait_s(self, attempt: int) -> float: ...


def is_durable(channel: object) -> TypeGuard[OutboxChannel]:
    """Whether ``channel`` is delivered from the outbox (it says so: ``durable = True``)."""
    return bool(getattr(channel, "durable", False))


class Outbox:
    """Writes notices for ``channels`` and (after :meth:`start`) delivers them, a thread each."""

    def __init__(
        self,
        store: Store,
        channels: Sequence[OutboxChannel],
        *,
        worker: str | None = None,
        poll_s: float = 0.5,
        now: Callable[[], datetime] = utcnow,
    ) -> None:
        self.queue = OutboxRepository(store.sessions)
        self.channels = list(channels)
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.poll_s = poll_s
        self.now = now
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ writing

    def entries(self, notice: Notice) -> list[OutboxEntry]:
        """A row per destination for ``notice``, to be queued in the transaction that claims the
        announcement (both commit, or neither)."""
        return [
            OutboxEntry(
                alert_id=notice.alert_id,
                event=notice.event,
                channel=channel.name,
                destination=channel.destination,
                notice=notice.to_record(),
            )
            for channel in self.channels
        ]

    def pending(self, destination: str | None = None) -> int:
        """Notices not yet delivered (or given up on), for one destination or all."""
        return self.queue.count(destination)

    def reposts(self, destination: str | None = None) -> int:
        """Firing alerts standing to be posted again, for one destination or all."""
        return self.queue.count(destination, status=REPOST)

    # ------------------------------------------------------------------ delivering

    def start(self) -> Outbox:
        """One delivery thread per destination; says once if notices wait for one no longer configured."""
        if self._threads:
            return self
        self._stop.clear()
        orphans = self.queue.count_elsewhere({c.destination for c in self.channels})
        if orphans:
            log.warning(
                "%d alert notices wait for a destination that is no longer configured; they stay in "
                "alert_outbox until it is configured again",
                orphans,
            )
        for channel in self.channels:
            thread = threading.Thread(
                target=self._loop, args=(channel,), name=f"isoaudit-notices-{channel.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the threads (an attempt in flight finishes: at most the channel's timeout)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    def _loop(self, channel: OutboxChannel) -> None:
        while not self._stop.is_set():
            try:
                wait = self.deliver_next(channel)
            except Exception:  # the database is away: try again later, the rows are safe
                log.exception("alert outbox of %s: delivery pass failed", channel.name)
                wait = max(self.poll_s, 1.0)
            if wait > 0:
                self._stop.wait(wait)

    def deliver_next(self, channel: OutboxChannel) -> float:
        """Make one attempt at the oldest pending notice of ``channel``'s destination if it is due
        and nobody else holds it; returns how long to wait before the next call (0: call again now)."""
        now = self.now()
        lease = now + timedelta(seconds=channel.timeout_s + LEASE_MARGIN_S)
        row = self.queue.take(channel.destination, self.worker, now=now, lease_until=lease)
        if row is None:  # nothing queued, or another worker is sending the head (the rest wait)
            return self.poll_s
        if isinstance(row, datetime):  # the head waits for its backoff
            return min(self.poll_s, (row - now).total_seconds())
        notice = Notice.from_record(row.notice)
        # The payload's clock is read after the take: a slow database must not age what it says
        # (Alertmanager's endsAt counts from it).
        payload = channel.payload(notice, self.now())
        attempt = row.attempts + 1
        at, started = datetime.now(UTC), time.monotonic()
        outcome, retry = channel.attempt(payload)
        record = [*row.attempts_log, attempt_record(attempt, at, started, outcome)]
        now = self.now()
        if outcome != "sent" and retry and attempt < channel.attempts:
            wait = channel.wait_s(attempt)
            record[-1]["wait_s"] = wait
            self.queue.retry_later(
                row.id, self.worker, attempts=attempt, attempts_log=record, at=now + timedelta(seconds=wait)
            )
            return 0.0  # the head is now waiting for its backoff; the next call says how long
        # Posted again later: a firing alert to a channel that re-posts, unless refused as such.
        repost_at = (
            now + timedelta(seconds=channel.repost_s)
            if channel.repost_s is not None and row.event == "firing" and (outcome == "sent" or retry)
            else None
        )
        if row.repost:
            if self.queue.finish(row.id, self.worker, None, repost_at=repost_at) and outcome != "sent":
                log.warning(
                    "%s: re-post of firing alert %s failed after %d attempts: %s (%s)",
                    channel.name,
                    row.alert_id,
                    attempt,
                    outcome,
                    "posted again later" if repost_at is not None else "not posted again",
                )
            return 0.0
        status: Literal["sent", "failed"] = "sent" if outcome == "sent" else "failed"
        kept = self.queue.finish(
            row.id,
            self.worker,
            Notification(
                alert_id=row.alert_id,
                event=row.event,
                channel=row.channel,
                status=status,
                attempts=attempt,
                error=None if status == "sent" else outcome,
                payload={**payload, ATTEMPTS_KEY: record},
                created_at=now,
            ),
            repost_at=repost_at,
        )
        if kept and status == "failed":  # not kept: our lease ran out, another worker's outcome stands
            log.error(
                "%s gave up on alert %s (%s) after %d attempts: %s",
                channel.name,
                row.alert_id,
                row.event,
                attempt,
                outcome,
            )
        return 0.0
