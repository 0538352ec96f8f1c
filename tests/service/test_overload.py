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

import time
from pathlib import Path

import pytest

from audit.api.live import free_port
from audit.auth import create_token
from audit.records import Run
from audit.store import Store
from collectors.sinks.base import encode_batch
from tests.service.processes import serve
from tests.service.proxy import TcpProxy
from tests.service.workload import reconcile, step_records

HttpSink = pytest.importorskip("collectors.sinks").HttpSink

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
