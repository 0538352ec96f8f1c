"""Overload: a collector that sends faster than the service takes its records, with the real parts
(`isoaudit serve` in its own process, a real `HttpSink`, a real spool directory). The link to the
service is paced (a TCP proxy at a fixed byte rate), so the service stays up and answers every
request, only slower than the job sends. The sink must merge waiting batches into fewer requests,
spill what still waits to its disk spool rather than drop it, and deliver all of it: the store is
reconciled record by record against what was sent.

The soak's one loss (28,560 of 257,648 samples at machine load 18) was this: each sink posted one
batch per request, so when the service answered more slowly than the job sent, the in-memory queue
filled and ``send`` dropped whole batches (counted, but lost)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.records import Run
from isoaudit.collectors.sinks.base import DeliveryError, Sink, _Item, encode_batch

from tests import factories
from tests.service.processes import serve
from tests.service.proxy import TcpProxy
from tests.service.workload import reconcile, step_records

HttpSink = pytest.importorskip("isoaudit.collectors.sinks").HttpSink

RATE = 400_000  # bytes/s through the link: about half of what the collector below sends
SEND_FOR_S = 4.0
SEND_EVERY_S = 0.005


@pytest.mark.slow
def test_a_collector_faster_than_the_service_spools_and_loses_nothing(tmp_path: Path):
    database_url = f"sqlite:///{tmp_path / 'overload.db'}"
    store = Store(database_url)
    token = create_token(store, "overload")
    port = free_port()
    api = serve(database_url, port)
    link = TcpProxy("127.0.0.1", port, rate_bytes_per_s=RATE)
    sink = HttpSink(
        f"http://127.0.0.1:{link.port}",
        token,
        spool_dir=tmp_path / "spool",
        max_batch_bytes=64 << 10,
        backoff_initial=0.05,
        backoff_max=0.5,
    )
    sent: list = []
    send_s: list[float] = []
    try:
        sink.send([Run(run_id="overload", name="overload")])
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < SEND_FOR_S:
            batch = step_records(step, 0.0, run_id="overload", n=2, n_completion=64)
            sent.extend(batch)
            t0 = time.perf_counter()
            sink.send(batch)
            send_s.append(time.perf_counter() - t0)
            step += 1
            time.sleep(SEND_EVERY_S)
        sending = time.monotonic() - started
        offered = len(encode_batch(batch)) * step / sending
        assert sink.flush(120), sink.stats()
        drained = time.monotonic() - started
        stats = sink.stats()
    finally:
        sink.close(10)
        link.stop()
        api.terminate()
        api.wait(30)
    counts = reconcile(store, sent)
    store.dispose()
    print(
        f"\noverload: {step} batches ({len(sent)} samples) in {sending:.1f} s, {offered / 1e3:.0f} kB/s "
        f"offered over a {RATE / 1e3:.0f} kB/s link; spilled {stats['spilled']} records to the spool, "
        f"{stats['replayed']} replayed, {stats['dropped']} dropped; all delivered {drained:.1f} s after "
        f"the first send; send() max {max(send_s) * 1e3:.1f} ms; store: {counts}"
    )
    assert offered > 1.5 * RATE, "the collector must send faster than the link takes"
    assert stats["dropped"] == 0, stats  # the soak's loss: a full queue dropped whole batches
    assert stats["spilled"] > 0 and stats["replayed"] >= stats["spilled"], stats
    assert (counts["lost"], counts["extra"], counts["doubled"]) == (0, 0, 0), counts
    assert max(send_s) < 0.05, "send() must never wait for the service"


class _SlowSink(Sink):
    """Takes ``delay`` seconds per request, records what each request carried; refuses (as a 422
    would) any request holding a record of ``refuse_step``."""

    def __init__(self, delay: float, refuse_step: int | None = None, **options) -> None:
        self.delay = delay
        self.refuse_step = refuse_step
        self.requests: list[list[int]] = []
        self.in_flight = threading.Event()  # set when the first delivery starts
        super().__init__(**options)

    def _deliver(self, item: _Item) -> int:
        self.in_flight.set()
        time.sleep(self.delay)
        steps = [r.step for r in item.records]
        if self.refuse_step in steps:
            raise DeliveryError("422: refused", retry=False)
        self.requests.append(steps)
        return 0


def test_waiting_batches_go_in_one_request_in_order_and_a_refused_one_drops_alone():
    sink = _SlowSink(0.2, refuse_step=3)
    sink.send([factories.sample(step=0, seed=0)])
    # The first is in flight while the other seven wait (waited for, not left to the scheduler:
    # a worker woken late would otherwise take the first three together).
    assert sink.in_flight.wait(10)
    for step in range(1, 8):
        sink.send([factories.sample(step=step, seed=step)])
    assert sink.flush(10)
    delivered = [s for request in sink.requests for s in request]
    assert delivered == [0, 1, 2, 4, 5, 6, 7], sink.requests  # in order, once each; step 3 refused
    assert sink.requests[0] == [0] and len(sink.requests) < 8  # merged, then split to find the bad one
    assert (sink.counters.sent, sink.counters.dropped) == (7, 1)
    sink.close()


class _PacedSink(_SlowSink):
    """A destination that takes exactly as long as ``lag`` more sends: each delivery waits until the
    job has sent ``lag`` records past the newest one it carries (or all of them). Paced by the sends
    rather than by a clock, the queue fills faster than it drains however the threads are scheduled
    (timed sleeps let a worker starved of the interpreter lock fall behind until ``send`` drops)."""

    def __init__(self, lag: int, total: int, **options) -> None:
        self.lag, self.total = lag, total
        self.sent = 0
        self.sends = threading.Condition()
        super().__init__(0.0, **options)

    def _deliver(self, item: _Item) -> int:
        newest = max(r.step for r in item.records)
        with self.sends:
            assert self.sends.wait_for(lambda: self.sent >= min(self.total, newest + 1 + self.lag), 30)
        return super()._deliver(item)

    def send_paced(self, records: list, room: int) -> None:
        """Send once fewer than ``room`` records are queued or in flight (never into a full queue:
        a full queue drops by design, and that case has its own test), then count the send."""
        deadline = time.monotonic() + 30
        while self.stats()["outstanding"] >= room:
            assert time.monotonic() < deadline, self.stats()
            time.sleep(0.001)
        self.send(records)
        with self.sends:
            self.sent += len(records)
            self.sends.notify_all()


def test_a_queue_filling_faster_than_it_drains_spills_to_the_spool_and_drops_nothing(tmp_path: Path):
    # Each request carries at most 2 records and lasts as long as 5 more sends: the queue of 8 passes
    # its spill mark (4 waiting) after every delivery.
    sink = _PacedSink(5, 60, queue_size=8, max_batch_records=2, spool_dir=tmp_path / "spool")
    for step in range(60):
        sink.send_paced([factories.sample(step=step, seed=step)], room=8)
    assert sink.flush(30)
    delivered = [s for request in sink.requests for s in request]
    assert delivered == list(range(60)), sink.stats()  # in order, each once, through memory and the spool
    assert sink.counters.dropped == 0 and sink.counters.spilled > 0, sink.stats()
    assert sink.counters.replayed == sink.counters.spooled == sink.counters.spilled
    sink.close()


def test_a_bug_in_one_delivery_counts_its_records_dropped_and_the_sink_goes_on():
    class Buggy(Sink):
        def _deliver(self, item: _Item) -> int:
            if any(r.step == 1 for r in item.records):
                raise RuntimeError("a bug")
            return 0

    sink = Buggy()
    for step in range(3):
        sink.send([factories.sample(step=step, seed=step)])
        assert sink.flush(5)  # never hangs on the batch the bug ate
    assert (sink.counters.sent, sink.counters.dropped) == (2, 1)  # nothing uncounted
    sink.close()
