"""Load: concurrent collectors (real HttpSinks, one run each) against `isoaudit serve` in its own
process with the comparison worker and alert evaluation on, on SQLite and PostgreSQL. Reports
throughput, ingest latency (p50/p99 from the service's own histogram), the comparison lag, and the
memory growth of the API process and of the collectors' process; then reconciles every record.

`make test` runs the 30 s load check (ISOAUDIT_SOAK_SECONDS, 15 s on each database, 4 collectors); `make soak`
runs 5 minutes with 16 collectors on PostgreSQL and 4 on SQLite."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import SampleResultRow
from isoaudit.audit.records import Run
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from tests.service.processes import children, rss_mib, serve
from tests.service.workload import reconcile, step_records

HttpSink = pytest.importorskip("isoaudit.collectors.sinks").HttpSink

SECONDS = float(os.environ.get("ISOAUDIT_SOAK_SECONDS", "15"))
SOAK = SECONDS >= 60
#: How long the comparison worker gets to catch up after the last send (asserted only in the short pass).
DRAIN_LIMIT_S = 120.0
CLIENTS = {"sqlite": 4, "postgres": 16 if SOAK else 4}
#: ISOAUDIT_SOAK_WORKER_THREAD=1: the worker as a thread of the API process (`serve --worker-thread`,
#: the layout before it became a child process), to compare the two under this load.
WORKER_THREAD = os.environ.get("ISOAUDIT_SOAK_WORKER_THREAD") == "1"
STEP_EVERY_S = 0.25  # each collector: one step (8 samples x 2 sides x 512 tokens) every 250 ms


def quantile(histogram: list[tuple[float, float]], q: float) -> float:
    """Upper bound of the bucket holding the q-quantile of a cumulative Prometheus histogram."""
    total = histogram[-1][1]
    return next(bound for bound, count in histogram if count >= q * total)


def ingest_latency(url: str, token: str) -> tuple[float, float, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    buckets = sorted(
        (float(s.labels["le"]), s.value)
        for s in families["isoaudit_ingest_duration_seconds"].samples
        if s.name.endswith("_bucket")
    )
    return quantile(buckets, 0.5), quantile(buckets, 0.99), buckets[-1][1]


@pytest.mark.slow
def test_concurrent_collectors_with_the_worker_on(database_url: str, tmp_path: Path):
    kind = "sqlite" if database_url.startswith("sqlite") else "postgres"
    clients = CLIENTS[kind]
    store = Store(database_url)
    token = create_token(store, "load")
    port = free_port()
    api = serve(
        database_url,
        port,
        worker=True,
        env={"ISOAUDIT_WORKER_INTERVAL_S": "0.2"},
        args=("--worker-thread",) if WORKER_THREAD else (),
    )
    url = f"http://127.0.0.1:{port}"
    sent: list = []
    sent_lock = threading.Lock()
    last_sent: dict[str, float] = {}
    stop = threading.Event()
    sinks = [
        HttpSink(url, token, spool_dir=tmp_path / f"spool-{i}", backoff_initial=0.05, backoff_max=1.0)
        for i in range(clients)
    ]

    def compared_pairs() -> int:
        """One query on the store (polling every run's steps through the API would load the service
        the worker shares the cores with)."""
        with store.sessions() as session:
            return session.scalar(select(func.count()).select_from(SampleResultRow)) or 0

    def collector(i: int) -> None:
        run_id = f"load-{i}"
        sinks[i].send([Run(run_id=run_id, name=f"load {i}")])
        step = 0
        while not stop.is_set():
            batch = step_records(step, 0.01 * (step % 3), run_id=run_id, n=8, n_completion=384)
            with sent_lock:
                sent.extend(batch)
            sinks[i].send(batch)
            last_sent[run_id] = time.monotonic()
            step += 1
            stop.wait(STEP_EVERY_S)

    try:
        time.sleep(2.0)  # the API process warms up (imports, first queries) before its memory is read
        [worker] = [api.pid] if WORKER_THREAD else children(api.pid)  # `serve` runs it as its child
        api_rss_start, own_rss_start = rss_mib(api.pid), rss_mib(os.getpid())
        worker_rss_start = rss_mib(worker)
        threads = [threading.Thread(target=collector, args=(i,)) for i in range(clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        backlog = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
            while time.monotonic() - started < SECONDS:
                time.sleep(min(2.0, SECONDS / 4))
                sent_steps = {r.run_id: r.step for r in list(sent)}
                for run_id, last in sent_steps.items():
                    steps = http.get(f"/v1/runs/{run_id}/steps").json()
                    compared = [s["step"] for s in steps if s["compared_samples"] == 8]
                    backlog = max(backlog, last - (max(compared) if compared else -1))
            stop.set()
            for thread in threads:
                thread.join(30)
            elapsed = time.monotonic() - started
            send_rate = compared_pairs() / elapsed  # the worker's pace while ingest runs
            for sink in sinks:
                assert sink.flush(120)
            flushed = time.monotonic()
            expected: dict[str, int] = {}
            for record in sent:
                expected[record.run_id] = max(expected.get(record.run_id, 0), record.step)

            def uncompared() -> int:
                """Sample pairs sent but not yet compared."""
                return len(sent) // 2 - compared_pairs()

            while (left := uncompared()) and time.monotonic() - flushed < DRAIN_LIMIT_S:
                time.sleep(1.0)
            drain_lag = time.monotonic() - max(last_sent.values()) if not left else None
            pairs = len(sent) // 2  # samples per side
            compare_rate = (pairs - left) / (time.monotonic() - started)
            p50, p99, requests = ingest_latency(url, token)
        api_rss_end, own_rss_end = rss_mib(api.pid), rss_mib(os.getpid())
        worker_rss_end = rss_mib(worker)
        stats = [sink.stats() for sink in sinks]
    finally:
        stop.set()
        for sink in sinks:
            sink.close(10)
        api.terminate()
        api.wait(30)
    counts = reconcile(store, sent)
    store.dispose()
    # the sinks' own counts first: a record a sink dropped (and counted) is not a silent loss
    dropped, rejected = sum(s["dropped"] for s in stats), sum(s["rejected"] for s in stats)
    spilled, replayed = sum(s["spilled"] for s in stats), sum(s["replayed"] for s in stats)
    assert dropped == 0 and rejected == 0, {
        "dropped": dropped,
        "rejected": rejected,
        "store": counts,
        "sinks": stats,
    }
    assert (counts["lost"], counts["extra"], counts["doubled"]) == (0, 0, 0), counts
    drained = (
        f"all compared {drain_lag:.1f} s after the last send"
        if drain_lag is not None
        else f"{left} sample pairs still uncompared {DRAIN_LIMIT_S:.0f} s after the flush"
    )
    layout = "worker thread in the API" if WORKER_THREAD else "worker child process"
    print(
        f"\nload {kind} ({layout}): {clients} collectors for {elapsed:.0f} s: {counts['stored'] / elapsed:.0f} samples/s "
        f"({counts['stored']} stored, 0 lost, 0 doubled); ingest p50 <= {p50 * 1000:.0f} ms, p99 <= "
        f"{p99 * 1000:.0f} ms over {requests:.0f} requests; worker compared {send_rate:.0f} pairs/s while "
        f"ingest ran, {compare_rate:.0f} pairs/s over send and drain, "
        f"backlog <= {backlog} steps, {drained}; sinks spilled {spilled} records to their spools under "
        f"load ({replayed} replayed), dropped 0; API RSS {api_rss_start:.0f} -> {api_rss_end:.0f} MiB, "
        f"worker process RSS {worker_rss_start:.0f} -> {worker_rss_end:.0f} MiB, collectors' process RSS "
        f"{own_rss_start:.0f} -> {own_rss_end:.0f} MiB"
    )
    if not SOAK:  # the short pass must catch up; a soak reports how far behind the worker is
        assert drain_lag is not None, drained
    assert api_rss_end - api_rss_start < 400, "the API process grew by more than 400 MiB"
    assert worker_rss_end - worker_rss_start < 400, "the worker process grew by more than 400 MiB"
