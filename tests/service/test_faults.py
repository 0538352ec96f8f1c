"""Faults of the service's database and of the service itself, with the real parts: a real SQLite
file locked by another writer, the real PostgreSQL server behind a TCP proxy that cuts the
connection mid-batch, the real `isoaudit serve` process SIGKILLed mid-ingest. Each test ends by
reconciling the store against what was sent: 0 lost, 0 doubled, 0 altered.

Figures each test measured are printed (``-s``) and written down in docs/reliability.md."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
from isoaudit.audit.api import create_app
from isoaudit.audit.api.live import LiveServer, free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.records import Batch
from isoaudit.audit.settings import Settings
from sqlalchemy.engine import make_url

from tests import factories
from tests.service.processes import serve
from tests.service.proxy import TcpProxy
from tests.service.workload import reconcile, step_records

HttpSink = pytest.importorskip("isoaudit.collectors.sinks").HttpSink


def body(*records) -> str:
    return Batch(records=list(records)).model_dump_json()


def quick_sink(url: str, token: str, spool: Path) -> HttpSink:
    """A real HttpSink that retries fast (tests should not wait out production backoffs)."""
    return HttpSink(url, token, spool_dir=spool, backoff_initial=0.05, backoff_max=0.5, timeout=10)


def test_sqlite_locked_by_another_writer_answers_503_then_recovers(tmp_path: Path):
    path = tmp_path / "locked.db"
    store = Store(f"sqlite:///{path}", timeout_s=0.25)
    token = create_token(store, "alpha")
    sent = [*step_records(0)]
    with (
        LiveServer(create_app(store, Settings(run_worker=False, database_timeout_s=1.0))) as server,
        httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as api,
    ):
        assert api.post("/v1/ingest", content=body(factories.run(), *sent)).status_code == 200
        locker = sqlite3.connect(path, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
        locker.execute("UPDATE runs SET name = 'held by another writer'")
        try:
            started = time.monotonic()
            locked = api.post("/v1/ingest", content=body(*step_records(1)))
            waited = time.monotonic() - started
            assert locked.status_code == 503, locked.text
            assert locked.headers["retry-after"] == "1" and locked.json()["detail"].startswith("database:")
            assert waited < 5, waited
            assert api.get("/v1/runs/run-1/steps").status_code == 200  # WAL: reads go on
            sink = quick_sink(server.url, token, tmp_path / "spool")
            for step in (2, 3):
                batch = step_records(step)
                sent += batch
                sink.send(batch)
            time.sleep(2.0)  # the lock is held ~2.5 s in all
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        released = time.monotonic()
        assert sink.flush(60)
        recovered = time.monotonic() - released
        sent += step_records(1)
        assert api.post("/v1/ingest", content=body(*step_records(1))).status_code == 200
        stats = sink.stats()
        sink.close()
    counts = reconcile(store, sent)
    assert (counts["lost"], counts["extra"], counts["doubled"]) == (0, 0, 0), counts
    assert stats["dropped"] == 0 and stats["failed_attempts"] > 0, stats
    print(
        f"\nsqlite locked: 503 after {waited:.2f} s; sink drained {recovered:.2f} s after release; {counts}"
    )
    store.dispose()


@pytest.mark.parametrize("blank_database_url", ["postgres"], indirect=True)
def test_postgres_connection_cut_mid_batch_answers_503_and_heals(database_url: str, tmp_path: Path):
    url = make_url(database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    via_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    store = Store(via_proxy, timeout_s=2)
    direct = Store(database_url)  # counts what is really in the database, around the proxy
    token = create_token(store, "alpha")
    sent = [*step_records(0)]
    big = step_records(1, n=24, n_completion=4000)  # ~1.3 MB of inserts: the cut lands inside them
    settings = Settings(run_worker=False, database_timeout_s=3.0)
    try:
        with (
            LiveServer(create_app(store, settings)) as server,
            httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
            ) as api,
        ):
            assert api.post("/v1/ingest", content=body(factories.run(), *sent)).status_code == 200
            before = reconcile(direct, sent)["stored"]
            proxy.cut_after(256 << 10)
            started = time.monotonic()
            cut = api.post("/v1/ingest", content=body(*big))
            waited = time.monotonic() - started
            assert cut.status_code == 503, cut.text
            assert proxy.cuts == 1
            assert reconcile(direct, sent)["stored"] == before  # no half-written batch
            assert api.get("/healthz").status_code == 503
            assert api.get("/v1/runs/run-1").status_code == 503  # every endpoint, not only ingest
            sink = quick_sink(server.url, token, tmp_path / "spool")
            sent += big
            sink.send(big)  # sent during the outage: retried, spooled
            time.sleep(1.0)
            proxy.restore()
            restored = time.monotonic()
            assert sink.flush(60)
            healed = time.monotonic() - restored
            assert api.get("/healthz").status_code == 200
            stats = sink.stats()
            sink.close()
    finally:
        proxy.stop()
        store.dispose()
    counts = reconcile(direct, sent)
    direct.dispose()
    assert (counts["lost"], counts["extra"], counts["doubled"]) == (0, 0, 0), counts
    assert stats["dropped"] == 0, stats
    print(
        f"\npostgres cut mid-batch: 503 after {waited:.2f} s; healed {healed:.2f} s after restore; {counts}"
    )


@pytest.mark.slow
def test_api_sigkilled_during_ingest_then_restarted_loses_and_doubles_nothing(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'killed.db'}"
    store = Store(url)
    token = create_token(store, "alpha")
    port = free_port()
    process = serve(url, port)
    sink = quick_sink(f"http://127.0.0.1:{port}", token, tmp_path / "spool")
    sent: list = []
    steps, kill_at = 40, 12

    def train() -> None:  # the job: a step every 50 ms, whatever the service does
        for step in range(steps):
            batch = step_records(step, n=8, n_completion=256)
            sent.extend(batch)
            sink.send(batch)
            time.sleep(0.05)

    job = threading.Thread(target=train)
    try:
        job.start()
        while len(sent) < kill_at * 16:
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)  # mid-ingest: the sink posts continuously
        process.wait(10)
        killed = time.monotonic()
        time.sleep(1.0)
        process = serve(url, port)
        job.join(60)
        assert sink.flush(120)
        recovered = time.monotonic() - killed
        stats = sink.stats()
    finally:
        sink.close()
        process.kill()
        process.wait(10)
    counts = reconcile(store, sent)
    store.dispose()
    assert counts["sent"] == steps * 16
    assert (counts["lost"], counts["extra"], counts["doubled"]) == (0, 0, 0), counts
    assert stats["dropped"] == 0 and stats["failed_attempts"] > 0, stats
    print(f"\nSIGKILL + restart: everything stored {recovered:.2f} s after the kill; {counts}; sink {stats}")
