"""Sinks: the spool, the queue that never blocks, retries, and DirectSink into a real database."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from isoaudit.audit.db import Store
from isoaudit.audit.records import Record, RegionFingerprintsBlock
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import DirectSink, MemorySink, Spool
from isoaudit.collectors.sinks.base import DeliveryError, Sink, _Item, decode_batch, encode_batch
from isoaudit.collectors.trainer import attach

from tests import factories
from tests.collectors.conftest import random_samples


def test_spool_is_fifo_bounded_and_survives_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=100)
    assert spool.put(b"a" * 40, 1) and spool.put(b"b" * 40, 2)
    assert not spool.put(b"c" * 40, 3)  # over max_bytes: refused, nothing written
    (tmp_path / "0000000000000009-1-deadbeef.batch.tmp").write_bytes(b"half")  # a crashed writer's leftover
    again = Spool(tmp_path, max_bytes=100)
    assert len(again) == 2 and again.n_records == 3 and not list(tmp_path.glob("*.tmp"))
    first = again.peek()
    assert first is not None and first.read() == b"a" * 40
    again.remove(first)
    assert again.put(b"d" * 40, 4)
    order = []
    while (entry := again.peek()) is not None:
        order.append(entry.read()[:1])
        again.remove(entry)
    assert order == [b"b", b"d"] and again.bytes == 0


def test_batches_round_trip_as_ingest_bodies() -> None:
    sample = factories.sample()
    records = [factories.run(), factories.manifest(), sample, factories.fingerprints(sample)]
    back = decode_batch(encode_batch(records))
    assert [r.model_dump(mode="json") for r in back] == [r.model_dump(mode="json") for r in records]


class GatedSink(Sink):
    """Delivers only when ``gate`` is set; fails (retryably) while ``down`` is set."""

    def __init__(self, **options) -> None:
        self.gate = threading.Event()
        self.down = threading.Event()
        self.delivered: list[Record] = []
        super().__init__(**options)

    def _deliver(self, item: _Item) -> None:
        self.gate.wait()
        if self.down.is_set():
            raise DeliveryError("down", retry=True)
        self.delivered.extend(item.records)


def test_send_never_blocks_and_counts_what_a_full_queue_drops() -> None:
    sink = GatedSink(queue_size=2, max_batch_records=1)
    records = [factories.sample(seed=i) for i in range(10)]
    started = time.perf_counter()
    sink.send(records)  # one in flight (blocked), two queued, the rest dropped
    assert time.perf_counter() - started < 1.0  # never waits for the blocked delivery
    time.sleep(0.1)
    sink.send(records[:1])
    sink.gate.set()
    assert sink.flush(5)
    assert sink.counters.sent + sink.counters.dropped == 11
    assert sink.counters.dropped >= 7 and len(sink.delivered) == sink.counters.sent
    sink.close()


def test_outage_spools_in_order_and_replays_exactly_once(tmp_path: Path) -> None:
    sink = GatedSink(spool_dir=tmp_path, attempts=2, backoff_initial=0.01, backoff_max=0.05)
    sink.gate.set()
    sink.down.set()
    batches = [[factories.sample(seed=10 * b + i, step=b) for i in range(3)] for b in range(5)]
    for batch in batches:
        sink.send(batch)
    assert not sink.flush(0.3)  # destination down: not delivered
    assert sink.counters.spooled == 15 and sink.counters.sent == 0 and len(sink.spool) == 5
    sink.down.clear()
    assert sink.flush(5)
    assert sink.counters.replayed == 15 and sink.counters.dropped == 0
    keys = [r.sample_key for r in sink.delivered]
    assert keys == [r.sample_key for batch in batches for r in batch]  # order kept, none twice
    sink.close()


def test_close_leaves_undelivered_records_in_the_spool_for_the_next_process(tmp_path: Path) -> None:
    first = GatedSink(spool_dir=tmp_path, attempts=1, backoff_initial=0.01, backoff_max=0.02)
    first.gate.set()
    first.down.set()
    first.send([factories.sample(seed=i) for i in range(4)])
    assert not first.close(timeout=0.2)
    second = GatedSink(spool_dir=tmp_path, backoff_initial=0.01, backoff_max=0.02)
    second.gate.set()
    assert second.flush(5) and len(second.delivered) == 4 and second.counters.replayed == 4
    second.close()


def test_a_refused_batch_is_dropped_not_retried() -> None:
    class Refusing(Sink):
        calls = 0

        def _deliver(self, item: _Item) -> None:
            Refusing.calls += 1
            raise DeliveryError("422: bad record", retry=False)

    sink = Refusing()
    sink.send([factories.sample()])
    assert sink.flush(5)
    assert Refusing.calls == 1 and sink.counters.dropped == 1
    sink.close()


def _train(model, sink, steps: int) -> int:
    """A few collector steps; return the number of records produced (run and manifest included)."""
    handle = attach(model, run="direct-run", sink=sink, sample_every=2, strict=True, keep_records=True)
    produced = 2
    prompts, completions = random_samples(4, seed=1)
    batch = StepBatch.packed(prompts, completions)
    for step in range(steps):
        handle.begin_step(step)
        with torch.no_grad():
            model(**batch.model_inputs())
        produced += len(handle.record_step(step, batch).records)
    handle.detach()
    return produced


def _stored(store: Store, run_id: str, steps: int) -> int:
    n = len(store.manifests(run_id)) + 1
    for step in range(steps):
        n += len(store.samples(run_id, step)) + len(store.fingerprints(run_id, step))
    return n


def test_direct_sink_writes_through_the_store(load, database_url: str) -> None:
    sink = DirectSink(database_url, project="p")
    produced = _train(load("qwen3"), sink, steps=3)
    assert sink.flush(30) and sink.counters.sent == produced and sink.counters.dropped == 0
    store = Store(database_url)
    try:
        assert _stored(store, "direct-run", 3) == produced
        assert len(store.fingerprints("direct-run", 1)) == 0  # sample_every=2
        sink.send(store.samples("direct-run", 0))  # a retried batch: nothing stored twice
        assert sink.flush(30) and sink.counters.duplicates == 4
        assert _stored(store, "direct-run", 3) == produced
    finally:
        sink.close()
        store.dispose()


def test_direct_sink_spools_while_the_database_is_unreachable(load, tmp_path: Path) -> None:
    """SQLite in a directory that does not exist yet: every write fails until it is created."""
    db = tmp_path / "later" / "isoaudit.db"
    sink = DirectSink(f"sqlite:///{db}", spool_dir=tmp_path / "spool", backoff_initial=0.02, backoff_max=0.1)
    produced = _train(load("qwen3"), sink, steps=2)
    assert not sink.flush(0.5)
    assert sink.counters.spooled == produced and sink.counters.sent == 0
    db.parent.mkdir()
    assert sink.flush(30)
    assert sink.counters.replayed == produced and sink.counters.dropped == 0
    store = Store(f"sqlite:///{db}")
    try:
        assert _stored(store, "direct-run", 2) == produced
    finally:
        sink.close()
        store.dispose()


def test_memory_sink_keeps_records() -> None:
    sink = MemorySink()
    sink.send([factories.run(), factories.sample()])
    assert sink.flush(5) and [r.kind for r in sink.records] == ["run", "sample"]
    sink.close()
    sink.send([factories.sample()])  # after close: counted as dropped, no exception
    assert sink.counters.dropped == 1


@pytest.mark.parametrize("bad", [{"queue_size": 0}, {"attempts": 0}, {"backoff_initial": 0}])
def test_sink_options_are_checked_and_named(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        MemorySink(**bad)


def test_direct_sink_spools_until_the_database_is_upgraded(blank_database_url: str, tmp_path: Path) -> None:
    """A PostgreSQL store behind the schema refuses to open ("run `isoaudit db upgrade`"): records
    wait in the spool instead of being lost, and arrive once someone upgrades it."""
    if blank_database_url.startswith("sqlite"):
        pytest.skip("the embedded SQLite store upgrades itself")
    from isoaudit.audit.db.schema import upgrade

    sink = DirectSink(blank_database_url, spool_dir=tmp_path / "spool", backoff_initial=0.02, backoff_max=0.1)
    sink.send([factories.run(), factories.sample()])
    assert not sink.flush(1.0)
    assert sink.counters.spooled == 2 and sink.counters.dropped == 0 and sink.counters.sent == 0
    upgrade(blank_database_url)
    assert sink.flush(30) and sink.counters.replayed == 2 and sink.counters.dropped == 0
    sink.close()


def test_a_block_counts_as_the_records_it_stands_for_sent_or_rejected() -> None:
    """A fingerprints block of two samples is two records in every counter, kept or refused."""
    samples = [factories.sample(seed=1), factories.sample(seed=2)]
    good = factories.fingerprints_block(samples)
    bad = RegionFingerprintsBlock.model_construct(**{**dict(good), "lengths": np.array([1, 1], np.int32)})
    sink = MemorySink()
    try:
        sink.send([*samples, good, bad])
        assert sink.flush(5)
        assert sink.counters.queued == 6 and sink.counters.rejected == 2 and sink.counters.sent == 4
        assert len(sink.of_kind("fingerprints")) == 2 and sink.of_kind("fingerprints_block") == []
    finally:
        sink.close()
