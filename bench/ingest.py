"""Ingest one synthetic RL step (1,024 samples x 2,048 tokens on both sides, ~4M token logprobs) into
SQLite and PostgreSQL through ``Store.ingest``, against the plainest bulk load of the same bytes into a
bare table, measured in the same run: on PostgreSQL a binary ``COPY ... FROM STDIN`` (psycopg's copy),
on SQLite an ``executemany`` INSERT (SQLite has no COPY). Each is timed ``--repeat`` times, alternating,
into a fresh store, and the medians are compared. Targets: <= 1.5x the binary COPY on PostgreSQL; the
whole step in under 5 s on SQLite.

Also the store boundary's per-record check (``isoaudit.audit.records.validate_record`` on
``model_construct``'ed records, as collectors build them) against pydantic's ``model_validate`` of the same fields and against
the plain insert's cost per record, all measured in this run. Target: a few microseconds a record.

    python bench/ingest.py [--samples 1024] [--tokens 2048] [--repeat 3] [--postgres URL]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import time
import uuid

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.audit.records import RegionFingerprints, SampleLogprobs, validate_record
from sqlalchemy import create_engine, text
from tqdm import tqdm


def synthetic_step(n_samples: int, n_tokens: int, prompt_len: int = 256) -> list[SampleLogprobs]:
    rng = np.random.default_rng(0)
    records = []
    for i in tqdm(range(n_samples), desc="building records", leave=False):
        tokens = rng.integers(0, 150_000, n_tokens, dtype=np.int32)
        tokens[0] = i  # distinct samples
        lp = -rng.exponential(1.0, n_tokens - prompt_len).astype(np.float32)
        for side, noise in (("trainer", 0.0), ("rollout", 1e-3)):
            records.append(
                SampleLogprobs(
                    run_id="bench",
                    step=0,
                    side=side,
                    prompt_len=prompt_len,
                    token_ids=tokens,
                    logprobs=np.minimum(lp + noise * rng.standard_normal(lp.size).astype(np.float32), 0),
                )
            )
    return records


def plain_rows(records: list[SampleLogprobs]) -> list[tuple]:
    return [
        (r.run_id, r.step, r.side, r.sample_key, r.token_ids.tobytes(), r.logprobs.tobytes()) for r in records
    ]


BARE_TABLE = "CREATE TABLE bare (run_id TEXT, step BIGINT, side TEXT, sample_key TEXT, token_ids {blob}, logprobs {blob})"


def time_sqlite(records: list[SampleLogprobs], directory: str) -> tuple[float, float]:
    store = Store(f"sqlite:///{directory}/store.db")
    start = time.perf_counter()
    store.ingest(records)
    ours = time.perf_counter() - start
    store.dispose()

    connection = sqlite3.connect(f"{directory}/bare.db")
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.execute(BARE_TABLE.format(blob="BLOB"))
    start = time.perf_counter()
    rows = plain_rows(records)
    with connection:
        connection.executemany("INSERT INTO bare VALUES (?, ?, ?, ?, ?, ?)", rows)
    baseline = time.perf_counter() - start
    connection.close()
    return ours, baseline


def _plain_copy(raw, table: str, rows: list[tuple]) -> None:
    """The baseline: one binary COPY of ``rows`` into ``table``, committed."""
    with raw.cursor() as cursor:
        with cursor.copy(f"COPY {table} FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["text", "int8", "text", "text", "bytea", "bytea"])
            for row in rows:
                copy.write_row(row)
    raw.commit()


def time_postgres(records: list[SampleLogprobs], url: str, repeat: int) -> tuple[float, float]:
    """Medians of ``repeat`` alternating runs: ``Store.ingest`` into a fresh schema at head, and a
    binary COPY of the same bytes (rows built inside the clock, as ingest builds its own) into a
    fresh bare table."""
    admin = create_engine(url)
    ours, baseline = [], []
    try:
        for attempt in range(repeat):
            schema = f"isoaudit_bench_{uuid.uuid4().hex[:8]}"
            with admin.begin() as connection:
                connection.execute(text(f'CREATE SCHEMA "{schema}"'))
            scoped = f"{url}?options=-csearch_path%3D{schema}"
            try:
                store = Store(scoped, upgrade=True)
                start = time.perf_counter()
                store.ingest(records)
                ours.append(time.perf_counter() - start)
                store.dispose()

                engine = create_engine(scoped)
                with engine.begin() as connection:
                    connection.execute(text(BARE_TABLE.format(blob="BYTEA")))
                raw = engine.raw_connection()
                start = time.perf_counter()
                _plain_copy(raw.driver_connection, "bare", plain_rows(records))
                baseline.append(time.perf_counter() - start)
                raw.close()
                engine.dispose()
            finally:
                with admin.begin() as connection:
                    connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            print(
                f"  postgresql run {attempt + 1}: ingest {ours[-1]:.2f} s, binary COPY {baseline[-1]:.2f} s"
            )
    finally:
        admin.dispose()
    return statistics.median(ours), statistics.median(baseline)


def fingerprint_records(samples: list[SampleLogprobs], rows: int = 256) -> list[RegionFingerprints]:
    """One region's fingerprints per sample: ``rows`` positions, 4 ladder rungs, a 16-wide sketch."""
    rng = np.random.default_rng(1)
    return [
        RegionFingerprints(
            run_id=s.run_id,
            step=s.step,
            side=s.side,
            case="trainer_fwd",
            sample_key=s.sample_key,
            region="layers.0.mlp",
            positions=np.arange(rows, dtype=np.int32),
            digest=rng.integers(0, 2**63, rows, dtype=np.uint64),
            ladder_bits=[6, 4, 2, 0],
            ladder=rng.integers(0, 2**63, (rows, 4), dtype=np.uint64),
            sketch=rng.standard_normal((rows, 16)).astype(np.float32),
            l2=rng.random(rows).astype(np.float32),
            maxabs=rng.random(rows).astype(np.float32),
        )
        for s in samples
    ]


def per_record_us(action, items: list) -> float:
    """Best of three passes of ``action`` over ``items``, in microseconds a record."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for item in items:
            action(item)
        best = min(best, time.perf_counter() - start)
    return best / len(items) * 1e6


def time_validation(records: list[SampleLogprobs], insert_s: float) -> None:
    """The boundary check against pydantic validation and against a plain insert, per record."""
    insert_us = insert_s / len(records) * 1e6
    for name, items in (("sample", records), ("fingerprints", fingerprint_records(records[:512]))):
        model = type(items[0])
        constructed = [model.model_construct(**dict(r)) for r in items]
        fields = [dict(r) for r in items]
        check = per_record_us(validate_record, constructed)
        pydantic = per_record_us(model.model_validate, fields)
        print(
            f"boundary check ({name:12s}) {check:6.2f} us/record   pydantic model_validate {pydantic:6.2f} us "
            f"(ratio {check / pydantic:4.2f}x)   plain sqlite insert of a sample {insert_us:6.2f} us "
            f"(ratio {check / insert_us:4.2f}x)"
        )


def report(name: str, n_logprobs: int, ours: float, baseline: float, baseline_name: str) -> None:
    print(
        f"{name:10s} Store.ingest {ours:6.2f} s ({n_logprobs / ours / 1e6:6.2f} M token logprobs/s)   "
        f"{baseline_name} {baseline:6.2f} s ({n_logprobs / baseline / 1e6:6.2f} M/s)   ratio {ours / baseline:5.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs of each (medians)")
    parser.add_argument("--postgres", default=os.environ.get("ISOAUDIT_TEST_POSTGRES_URL"))
    args = parser.parse_args()

    records = synthetic_step(args.samples, args.tokens)
    n_logprobs = sum(r.logprobs.size for r in records)
    print(f"one step: {len(records)} records, {n_logprobs / 1e6:.2f} M token logprobs")
    timings = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as directory:
            timings.append(time_sqlite(records, directory))
    ours, baseline = (statistics.median(t) for t in zip(*timings, strict=True))
    report("sqlite", n_logprobs, ours, baseline, "plain executemany")
    time_validation(records, baseline)
    print(f"sqlite target (< 5 s for the step): {'met' if ours < 5 else 'MISSED'}")
    if args.postgres:
        ours, baseline = time_postgres(records, args.postgres, args.repeat)
        report("postgresql", n_logprobs, ours, baseline, "binary COPY")
        print(
            f"postgresql target (<= 1.5x a binary COPY of the same bytes): {'met' if ours <= 1.5 * baseline else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
