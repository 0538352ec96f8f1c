"""What every sink shares: a bounded queue drained by one background thread, retries with
exponential backoff, an optional disk spool while the destination is down, and counters.

The training loop only ever calls :meth:`Sink.send`, which puts records on the queue and returns:
it never blocks on I/O and never raises. The worker delivers batches in order, several queued
batches in one request when they wait (up to ``max_batch_records`` records and ``max_batch_bytes``
bytes), so a slow destination gets fewer, larger requests instead of a growing queue. When the
destination still cannot keep up (overload) and half the queue is waiting, the worker spills the
queue to the disk spool rather than let ``send`` drop; after a failed delivery it spools new
batches instead of retrying them in line. The spool is replayed first-in first-out, several
batches a request, once the destination answers again. Only a full queue while one delivery is in
flight (``queue_size`` sends during one request), or a spool without room, drops records: counted,
logged once. Destinations are idempotent (a retried batch stores nothing twice), so "at least
once" here means "exactly once" in the store.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict

from isoaudit.audit.records import AnyRecord, Batch, Record, count_records
from isoaudit.collectors.control import Control
from isoaudit.collectors.counting import Counters, LogOnce
from isoaudit.collectors.sinks.spool import Spool
from pydantic import TypeAdapter

log = logging.getLogger(__name__)

_records_adapter: TypeAdapter[list[AnyRecord]] = TypeAdapter(list[AnyRecord])


def encode_batch(records: Sequence[Record]) -> bytes:
    """The JSON body of ``POST /v1/ingest`` (an :class:`isoaudit.audit.records.Batch`)."""
    return b'{"records":' + _records_adapter.dump_json(list(records)) + b"}"  # type: ignore[arg-type]  # the adapter takes the records' union; a Sequence[Record] holds only those kinds


def decode_batch(payload: bytes) -> list[Record]:
    return list(Batch.model_validate_json(payload).records)


class DeliveryError(Exception):
    """A failed delivery. ``retry``: worth trying again later (destination down, timeout, 5xx);
    otherwise the destination refused the batch as such and it is dropped. ``too_large``: split it."""

    def __init__(self, message: str, *, retry: bool, too_large: bool = False) -> None:
        super().__init__(message)
        self.retry = retry
        self.too_large = too_large


class SinkCounters(Counters):
    """Record counts (not batches). ``sent``: delivered and accepted, including ``replayed`` (sent
    from the spool); ``rejected``: refused one by one as invalid (the rest of their batch stored)."""

    NAMES = (
        "queued",
        "sent",
        "dropped",
        "spooled",
        "replayed",
        "duplicates",
        "rejected",
        "failed_attempts",
        "spilled",
    )


_PREFIX, _SUFFIX = b'{"records":[', b"]}"


def merge_payloads(payloads: Sequence[bytes]) -> bytes:
    """One ingest body holding the records of several, in order: their JSON arrays spliced, without
    decoding a record (a body of another shape is decoded and encoded again)."""
    inner = []
    for payload in payloads:
        if not (payload.startswith(_PREFIX) and payload.endswith(_SUFFIX)):
            return encode_batch([r for p in payloads for r in decode_batch(p)])
        if len(payload) > len(_PREFIX) + len(_SUFFIX):
            inner.append(payload[len(_PREFIX) : -len(_SUFFIX)])
    return _PREFIX + b",".join(inner) + _SUFFIX


class _Item:
    """One batch on its way: records, serialized lazily (and only once) when a sink needs bytes.
    ``parts``: the batches it was merged from (delivered one by one if the merge is refused)."""

    __slots__ = ("_records", "_payload", "n", "parts")

    def __init__(
        self,
        records: list[Record] | None = None,
        payload: bytes | None = None,
        n: int = 0,
        parts: list[_Item] | None = None,
    ) -> None:
        self._records = records
        self._payload = payload
        self.parts = parts or []
        self.n: int
        if parts:
            self.n = sum(p.n for p in parts)
        else:
            self.n = count_records(records) if records is not None else n

    @classmethod
    def merged(cls, parts: list[_Item]) -> _Item:
        return parts[0] if len(parts) == 1 else cls(parts=parts)

    @property
    def records(self) -> list[Record]:
        if self._records is None:
            if self.parts:
                self._records = [r for p in self.parts for r in p.records]
            else:
                assert self._payload is not None
                self._records = decode_batch(self._payload)
        return self._records

    @property
    def payload(self) -> bytes:
        if self._payload is None:
            if self.parts:
                self._payload = merge_payloads([p.payload for p in self.parts])
            else:
                self._payload = encode_batch(self.records)
        return self._payload

    def halves(self) -> list[_Item]:
        records = self.records
        mid = len(records) // 2
        return [_Item(records[:mid]), _Item(records[mid:])]


_STOP = object()


class SinkOptions(TypedDict, total=False):
    """The delivery options every sink takes (see :class:`Sink`): ``queue_size``,
    ``max_batch_records``, ``max_batch_bytes``, ``spool_max_bytes``, ``attempts``,
    ``backoff_initial``, ``backoff_max``, ``name``, ``on_control``."""

    queue_size: int
    max_batch_records: int
    max_batch_bytes: int
    spool_max_bytes: int
    attempts: int
    backoff_initial: float
    backoff_max: float
    name: str
    on_control: Callable[[Control], None] | None


class Sink(ABC):
    """The interface the collectors use. Subclasses implement :meth:`_deliver`."""

    #: Whether deliveries need the batch's bytes (an HTTP body): merges are then bounded in bytes too.
    _wire = False

    def __init__(
        self,
        *,
        queue_size: int = 256,
        max_batch_records: int = 4096,
        max_batch_bytes: int = 8 << 20,
        spool_dir: str | Path | None = None,
        spool_max_bytes: int = 1 << 30,
        attempts: int = 3,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        name: str = "sink",
        on_control: Callable[[Control], None] | None = None,
    ) -> None:
        """``queue_size``: batches waiting for the worker before ``send`` drops (counted);
        ``max_batch_records``: records per delivered batch (``send`` splits larger ones, the worker
        merges waiting ones up to it); ``max_batch_bytes``: the bound of a merged request's body
        (a single batch larger than it is still sent whole); ``spool_dir``: where batches wait while
        the destination is down (``None``: no spool, they are dropped after the retries);
        ``spool_max_bytes``: the spool's bound; ``attempts``/``backoff_initial``/``backoff_max``:
        retries of one batch and the wait between them (seconds); ``name``: in logs and threads;
        ``on_control``: called with the run's control when a destination reply carries it."""
        if queue_size < 1:
            raise ValueError(f"queue_size: must be >= 1, got {queue_size}")
        if max_batch_records < 1:
            raise ValueError(f"max_batch_records: must be >= 1, got {max_batch_records}")
        if max_batch_bytes < 1:
            raise ValueError(f"max_batch_bytes: must be >= 1, got {max_batch_bytes}")
        if attempts < 1:
            raise ValueError(f"attempts: must be >= 1, got {attempts}")
        if not 0 < backoff_initial <= backoff_max:
            raise ValueError(
                f"backoff_initial: must be in (0, backoff_max={backoff_max}], got {backoff_initial}"
            )
        self.counters = SinkCounters()
        self.on_control = on_control
        self.spool = Spool(spool_dir, spool_max_bytes) if spool_dir is not None else None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._max_batch = max_batch_records
        self._max_bytes = max_batch_bytes
        self._merge_bytes = max_batch_bytes  # halved when a merged request fails, regrown as they pass
        self._spill_at = max(1, queue_size // 2)  # waiting batches that mean overload: spill them
        self._attempts = attempts
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._backoff = 0.0  # current delay; 0 while the destination answers
        self._retry_at = 0.0  # monotonic time before which the destination is considered down
        self._outstanding = 0  # records queued or in flight
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._warned = LogOnce(log)
        self._name = name
        self._thread = threading.Thread(target=self._run, name=f"isoaudit-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training-loop side

    def send(self, records: Sequence[Record]) -> None:
        """Queue records for delivery. Never blocks, never raises; a full queue drops them (counted)."""
        try:
            records = list(records)
            for start in range(0, len(records), self._max_batch):
                item = _Item(records[start : start + self._max_batch])
                if self._stop.is_set():
                    self._drop(item.n, "closed", "isoaudit %s is closed: records dropped")
                    continue
                with self._cond:
                    self._outstanding += item.n
                try:
                    self._queue.put_nowait(item)
                    self._add("queued", item.n)
                except queue.Full:
                    with self._cond:
                        self._outstanding -= item.n
                        self._cond.notify_all()
                    self._drop(
                        item.n,
                        "full",
                        "isoaudit %s queue is full: dropping records (see counters.dropped)",
                    )
        except Exception as exc:  # a collector must never raise into the training loop
            self._warn_once("send", "isoaudit %s: send failed (%s)", exc)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything queued was delivered and the spool is empty; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._outstanding > 0 or (self.spool is not None and len(self.spool) > 0):
                if not self._thread.is_alive():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(0.05 if remaining is None else min(0.05, remaining))
        return True

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush (up to ``timeout``), then stop the worker. What could not be delivered stays in the
        spool for the next process over the same directory (or is counted dropped without one)."""
        delivered = self.flush(timeout)
        self._stop.set()
        try:
            self._queue.put_nowait(_STOP)  # only wakes the worker; it also polls the stop flag
        except queue.Full:
            pass
        self._thread.join(timeout=max(5.0, timeout or 0.0))
        self._close_destination()
        return delivered

    def stats(self) -> dict[str, Any]:
        """Counters plus the current backlog, for logs and dashboards."""
        return {
            **self.counters.as_dict(),
            "outstanding": self._outstanding,
            "spool_batches": len(self.spool) if self.spool is not None else 0,
            "spool_records": self.spool.n_records if self.spool is not None else 0,
        }

    # ------------------------------------------------------------ destination

    @abstractmethod
    def _deliver(self, item: _Item) -> int | None:
        """Deliver one batch or raise :class:`DeliveryError`; returns how many of its records the
        destination refused one by one (after counting them with :meth:`_rejected`)."""

    def _close_destination(self) -> None:
        """Release connections (worker stopped). Nothing to release by default."""
        return None

    # ------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            group: list[_Item] = []
            try:
                if self._stop.is_set() and self._queue.empty():
                    return
                if self.spool is not None and self._queue.qsize() >= self._spill_at:
                    self._spill()
                    continue
                entries = self._spool_group() if self.spool is not None else []
                if entries and time.monotonic() >= self._retry_at and not self._stop.is_set():
                    self._replay(entries)
                    continue
                wait = 0.5 if not entries else max(0.01, min(0.5, self._retry_at - time.monotonic()))
                try:
                    first = self._queue.get(timeout=wait)
                except queue.Empty:
                    continue
                if first is _STOP:
                    continue
                group = [first]  # counted from here on, whatever happens next
                self._take_more(group)
                self._live(_Item.merged(group))
            except Exception as exc:  # the worker must outlive any bug in one batch
                if group:  # never uncounted: what the failed pass held is counted dropped
                    self._drop(sum(i.n for i in group), "worker", None)
                self._warn_once("worker", "isoaudit %s: worker error (%s); records counted dropped", exc)
                time.sleep(0.1)
            finally:
                if group:
                    with self._cond:
                        self._outstanding -= sum(i.n for i in group)
                        self._cond.notify_all()

    def _take_more(self, group: list[_Item]) -> None:
        """Add the batches queued behind ``group``'s first until it reaches ``max_batch_records``
        records (or ``max_batch_bytes`` for sinks that send bytes): one request instead of many."""
        records = group[0].n
        size = len(group[0].payload) if self._wire else 0
        while records < self._max_batch and size < self._merge_bytes:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                continue
            group.append(item)
            records += item.n
            size += len(item.payload) if self._wire else 0

    def _spill(self) -> None:
        """The job sends faster than the destination takes: move the waiting batches to the spool
        (behind what it holds, so order is kept) instead of letting ``send`` drop them."""
        assert self.spool is not None
        first = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                continue
            try:
                if first:
                    first = False
                    self._warned.warn(
                        "overload",
                        f"isoaudit {self._name}: the destination is slower than the job sends; batches "
                        "wait in the spool (counters.spilled) and are replayed as it catches up",
                    )
                if self._to_spool(item):
                    self._add("spilled", item.n)
                else:
                    self._drop_unspooled(item)
            except Exception as exc:  # a batch that cannot be written: counted, the others go on
                self._drop(item.n, "worker", None)
                self._warn_once("worker", "isoaudit %s: worker error (%s); records counted dropped", exc)
            finally:
                with self._cond:
                    self._outstanding -= item.n
                    self._cond.notify_all()

    def _spool_group(self) -> list[Any]:
        """The oldest spooled batches that fit one request (at least one)."""
        assert self.spool is not None
        return self.spool.peek_many(self._max_batch, self._merge_bytes)

    def _destination_down(self) -> bool:
        return time.monotonic() < self._retry_at

    def _live(self, item: _Item) -> None:
        backlog = self.spool is not None and len(self.spool) > 0
        if self._stop.is_set() or backlog or self._destination_down():
            # Keep order behind the backlog; don't wait on a destination known to be down.
            if self.spool is not None:
                unspooled = self._spool_parts(item)
                if not unspooled:
                    return
                if self._stop.is_set() or self._destination_down():
                    for part in unspooled:
                        self._drop_unspooled(part)  # never wait for room: the job goes on
                    return
                # The spool is full but the destination may be back: try it rather than drop.
                item = _Item.merged(unspooled)
            elif self._stop.is_set():
                self._drop(
                    item.n, "closed", "isoaudit %s closed with undelivered records and no spool: dropped"
                )
                return
        for attempt in range(self._attempts):
            try:
                refused = self._deliver(item) or 0
                self._delivered(item.n - refused, replayed=False)
                return
            except DeliveryError as exc:
                if exc.too_large and item.n > 1:
                    for half in item.parts or item.halves():
                        self._live(half)
                    return
                self._add("failed_attempts", 1)
                if not exc.retry:
                    if len(item.parts) > 1:  # a merged request: find the batch refused, keep the rest
                        for part in item.parts:
                            self._live(part)
                        return
                    self._drop(
                        item.n, "refused", "isoaudit %s: destination refused a batch (%s); dropped", exc
                    )
                    return
                if item.parts:
                    self._shrink_merges()
                self._warn_once(
                    "down", "isoaudit %s: destination unavailable (%s); retrying, then spooling", exc
                )
                if attempt + 1 < self._attempts and self._stop.wait(self._backoff_initial * 2**attempt):
                    break
        self._mark_down()
        if self.spool is None:
            self._drop(item.n, "lost", "isoaudit %s: destination down and no spool: records dropped")
        else:
            for part in self._spool_parts(item):
                self._drop_unspooled(part)

    def _replay(self, entries: list[Any]) -> bool:
        """Deliver spooled batches as one request and remove them; ``False`` if the destination
        failed (they stay, to be retried after the backoff)."""
        assert self.spool is not None
        parts = []
        for entry in entries:
            try:
                parts.append(_Item(payload=entry.read(), n=entry.n_records))
            except OSError as exc:
                self._warn_once("spool-read", "isoaudit %s: unreadable spool file dropped (%s)", exc)
                self.spool.remove(entry)
                self._drop(entry.n_records, "spool-read", None)
                return True
        item = _Item.merged(parts)
        try:
            refused = self._deliver(item) or 0
        except DeliveryError as exc:
            self._add("failed_attempts", 1)
            if exc.retry:
                if len(entries) > 1:
                    self._shrink_merges()
                self._mark_down()
                return False
            if len(entries) > 1:  # a merged request: each batch on its own, so only a bad one drops
                for entry in entries:
                    if not self._replay([entry]):
                        return False
                return True
            if exc.too_large and item.n > 1:
                self.spool.remove(entries[0])
                self._add("spooled", -item.n)  # re-spooled below as two halves
                for half in item.halves():
                    if not self._to_spool(half):
                        self._drop_unspooled(half)
                return True
            self.spool.remove(entries[0])
            self._drop(
                item.n, "refused", "isoaudit %s: destination refused a spooled batch (%s); dropped", exc
            )
            return True
        self._delivered(item.n - refused, replayed=True)  # counted before the spool looks empty to flush()
        for entry in entries:
            self.spool.remove(entry)
        with self._cond:
            self._cond.notify_all()
        return True

    def _shrink_merges(self) -> None:
        """A merged request failed (a timeout, most often, from a service under load): merge less, so
        a retry is not the same long request again."""
        self._merge_bytes = max(min(64 << 10, self._max_bytes), self._merge_bytes // 2)

    def _delivered(self, n: int, *, replayed: bool) -> None:
        self._add("sent", n)
        self._merge_bytes = min(self._max_bytes, self._merge_bytes * 2)
        if replayed:
            self._add("replayed", n)
        if self._backoff:
            log.info("isoaudit %s: destination is back", self._name)
            self._warned.forget("down")
        self._backoff = 0.0
        self._retry_at = 0.0

    def _mark_down(self) -> None:
        self._backoff = min(self._backoff_max, max(self._backoff_initial, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff * (0.75 + 0.5 * random.random())

    def _spool_parts(self, item: _Item) -> list[_Item]:
        """Spool a (maybe merged) item batch by batch; returns the batches the spool refused."""
        return [part for part in (item.parts or [item]) if not self._to_spool(part)]

    def _to_spool(self, item: _Item) -> bool:
        """Spool one batch; ``False`` (nothing written) when the spool refuses it (full, disk full)."""
        assert self.spool is not None
        if self.spool.put(item.payload, item.n):
            self._add("spooled", item.n)
            return True
        return False

    def _drop_unspooled(self, item: _Item) -> None:
        """Drop a batch the spool refused: counted per record, said once for the sink's life."""
        assert self.spool is not None
        why = self.spool.refusal or "refused"
        self._drop(
            item.n,
            "spool-full",
            f"isoaudit %s: the spool refused a batch ({why}): records are dropped, and counted in "
            "`dropped`, while it has no room (said once)",
        )

    def _add(self, counter: str, n: int) -> None:
        self.counters.add(counter, n)

    def _rejected(self, rejections: Sequence[Any], records: Sequence[Record] = ()) -> int:
        """Count records the destination refused one by one (the rest of their batch was stored) and
        warn once per field, naming it: a collector bug, or data the job should look at. Returns
        how many, as :attr:`_Item.n` counts them (``records``: the batch the rejections' indices
        name; a refused block of fingerprints counts its samples)."""
        if not rejections:
            return 0
        refused = 0
        for rejection in rejections:
            index = (
                rejection.get("index") if isinstance(rejection, dict) else getattr(rejection, "index", None)
            )
            if isinstance(index, int) and 0 <= index < len(records):
                refused += count_records([records[index]])
            else:
                refused += 1
        self._add("rejected", refused)
        for rejection in rejections:
            field = _get(rejection, "field") or "record"
            message = _get(rejection, "message") or "invalid"
            self._warn_once(
                f"rejected:{field}", f"isoaudit %s: destination rejected a record: {message} (counted)", None
            )
        return refused

    def _control(self, control: Control) -> None:
        if self.on_control is not None:
            self.on_control(control)

    def _drop(self, n: int, key: str, message: str | None, exc: BaseException | None = None) -> None:
        self._add("dropped", n)
        if message is not None:
            self._warn_once(key, message, exc)

    def _warn_once(self, key: str, message: str, exc: BaseException | None) -> None:
        """Log ``message`` (``%s`` placeholders: the sink's name, then ``exc``) the first time ``key`` occurs."""
        if key in self._warned:
            return
        text = message.replace("%s", self._name, 1)
        if exc is not None:
            text = text.replace("%s", f"{type(exc).__name__}: {exc}", 1)
        self._warned.warn(key, text)


def _get(item: Any, name: str) -> str | None:
    """A field of a rejection, whether a dataclass/model or the JSON dict of an HTTP reply."""
    value = item.get(name) if isinstance(item, dict) else getattr(item, name, None)
    return None if value is None else str(value)
