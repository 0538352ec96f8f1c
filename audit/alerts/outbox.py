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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from isoaudit.audit.alerts.channels import ATTEMPTS_KEY, Notice, attempt_record, slack_payload
from isoaudit.audit.records import utcnow
from isoaudit.audit.service_models import NoticeOutboxRow, NotificationRow
from isoaudit.audit.store import Store
from sqlalchemy import delete, func, or_, select, true, update
from sqlalchemy.orm import Session

log = logging.getLogger("isoaudit.alerts")

#: A claimed notice is retaken by another worker this long after its attempt's timeout ran out
#: (its worker died mid-attempt: a restart delivers it within the timeout plus this).
LEASE_MARGIN_S = 2.0


class OutboxChannel(Protocol):
    """A channel the outbox can deliver to: one attempt at a time, with its own backoff."""

    name: str
    attempts: int
    timeout_s: float

    @property
    def destination(self) -> str: ...

    def attempt(self, payload: dict[str, Any]) -> tuple[str, bool]: ...

    def wait_s(self, attempt: int) -> float: ...


def _aware(moment: datetime) -> datetime:
    """SQLite hands timestamps back without their zone; they were written in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


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
        self.store = store
        self.channels = list(channels)
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.poll_s = poll_s
        self.now = now
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ writing

    def enqueue(self, session: Session, notice: Notice) -> None:
        """Add a row per destination for ``notice`` inside the caller's transaction (the one that
        claims the announcement: both commit, or neither)."""
        now = self.now()
        session.add_all(
            NoticeOutboxRow(
                alert_id=notice.alert_id,
                event=notice.event,
                channel=channel.name,
                destination=channel.destination,
                status="pending",
                notice=dataclasses.asdict(notice),
                attempts=0,
                attempts_log=[],
                next_attempt_at=now,
                created_at=now,
            )
            for channel in self.channels
        )

    def pending(self, destination: str | None = None) -> int:
        """Notices not yet delivered (or given up on), for one destination or all."""
        query = select(func.count()).select_from(NoticeOutboxRow)
        if destination is not None:
            query = query.where(NoticeOutboxRow.destination == destination)
        with self.store.sessions() as session:
            return int(session.scalar(query) or 0)

    # ------------------------------------------------------------------ delivering

    def start(self) -> Outbox:
        """One delivery thread per destination; says once if notices wait for one no longer configured."""
        if self._threads:
            return self
        self._stop.clear()
        known = {c.destination for c in self.channels}
        with self.store.sessions() as session:
            orphans = session.scalar(
                select(func.count())
                .select_from(NoticeOutboxRow)
                .where(NoticeOutboxRow.destination.not_in(known) if known else true())
            )
        if orphans:
            log.warning(
                "%d alert notices wait for a webhook that is no longer configured; they stay in "
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
        row = self._claim(channel)
        if isinstance(row, float):
            return row
        notice = Notice(**row.notice)
        payload = slack_payload(notice)
        attempt = row.attempts + 1
        at, started = datetime.now(UTC), time.monotonic()
        outcome, retry = channel.attempt(payload)
        record = [*row.attempts_log, attempt_record(attempt, at, started, outcome)]
        table = NoticeOutboxRow.__table__
        mine = (table.c.id == row.id, table.c.claimed_by == self.worker)
        now = self.now()
        with self.store.sessions.begin() as session:
            if outcome != "sent" and retry and attempt < channel.attempts:
                wait = channel.wait_s(attempt)
                record[-1]["wait_s"] = wait
                session.execute(
                    update(table)
                    .where(*mine)
                    .values(
                        attempts=attempt,
                        attempts_log=record,
                        next_attempt_at=now + timedelta(seconds=wait),
                        claimed_by=None,
                        claimed_until=None,
                    )
                )
                return 0.0  # the head is now waiting for its backoff; _claim says how long
            if session.execute(delete(table).where(*mine)).rowcount == 0:
                return 0.0  # our lease ran out and another worker took the row: its outcome stands
            status = "sent" if outcome == "sent" else "failed"
            session.add(
                NotificationRow(
                    alert_id=row.alert_id,
                    event=row.event,
                    channel=row.channel,
                    status=status,
                    attempts=attempt,
                    error=None if status == "sent" else outcome,
                    payload={**payload, ATTEMPTS_KEY: record},
                    created_at=now,
                )
            )
        if status == "failed":
            log.error(
                "webhook %s gave up on alert %s (%s) after %d attempts: %s",
                channel.name,
                row.alert_id,
                row.event,
                attempt,
                outcome,
            )
        return 0.0

    def _claim(self, channel: OutboxChannel) -> NoticeOutboxRow | float:
        """The destination's oldest pending row, leased to this worker; or how long to wait."""
        table = NoticeOutboxRow.__table__
        now = self.now()
        with self.store.sessions.begin() as session:
            head = session.execute(
                select(table.c.id, table.c.next_attempt_at, table.c.claimed_until)
                .where(table.c.destination == channel.destination)
                .order_by(table.c.id)
                .limit(1)
            ).first()
            if head is None:
                return self.poll_s
            due = _aware(head.next_attempt_at)
            if due > now:
                return min(self.poll_s, (due - now).total_seconds())
            lease = now + timedelta(seconds=channel.timeout_s + LEASE_MARGIN_S)
            taken = session.execute(
                update(table)
                .where(
                    table.c.id == head.id,
                    or_(table.c.claimed_until.is_(None), table.c.claimed_until < now),
                )
                .values(claimed_by=self.worker, claimed_until=lease)
            ).rowcount
            if not taken:  # another worker is sending it (in order: the rest wait behind it)
                return self.poll_s
            row = session.get(NoticeOutboxRow, head.id)
            assert row is not None
            session.expunge(row)
            return row
