"""What one RL step costs isoaudit at a given size, and what one API replica ingests, measured on
synthetic data of that size through the real parts (an `isoaudit serve` process, PostgreSQL or
SQLite, the comparison worker), never extrapolated from smaller runs.

Per step (``--prompts`` samples of ``--tokens`` tokens, ``--prompt-len`` of them prompt, both sides):

* **wire**: bytes of the step's ``POST /v1/ingest`` bodies, exactly as ``HttpSink`` encodes them;
* **at rest**: growth of the database (PostgreSQL: ``pg_total_relation_size`` of every table of a
  schema of its own; SQLite: the file and its WAL) per step, samples and results;
* **ingest**: wall time of the POSTs to one replica, against a plain ``executemany`` INSERT of the
  same array bytes into a bare table on the same database (the floor any store pays), same run;
* **compare**: the comparison worker's time for the step, against reading the step's samples back;
* **fingerprints** (``--fingerprinted K``): the same for K samples per side fingerprinted at every
  position over the canonical regions of a ``--layers``-layer model.

Then **records/s per replica**: ``--clients`` concurrent clients each posting soak-sized steps
(8 samples x 2 sides x 384 tokens) for ``--seconds`` to one replica, then spread over two.

    python bench/scale.py                      # 512 prompts x 8k tokens on PostgreSQL (the doc's figures)
    python bench/scale.py --tiny               # seconds: what tests/service/test_scale.py runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.records import RegionFingerprints, Run, SampleLogprobs
from isoaudit.audit.regions import canonical_regions
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors.sinks.base import encode_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import run_clients, stop_processes  # noqa: E402
from api_load import serve  # noqa: E402  (`isoaudit serve` without its worker: this bench times the worker alone)

PG_URL = os.environ.get("ISOAUDIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
RUN = "scale"


# ---------------------------------------------------------------------- synthetic step


def step_records(
    step: int, prompts: int, tokens: int, prompt_len: int, seed: int = 0
) -> list[SampleLogprobs]:
    """Both sides of one step: random tokens, rollout logprobs, the trainer's off by ~1e-3."""
    rng = np.random.default_rng(seed + step)
    n_completion = tokens - prompt_len
    out = []
    for _ in range(prompts):
        ids = rng.integers(0, 150_000, tokens, dtype=np.int32)
        rollout = -rng.exponential(1.0, n_completion).astype(np.float32)
        trainer = np.minimum(rollout + rng.normal(0, 1e-3, n_completion).astype(np.float32), 0)
        common = {"run_id": RUN, "step": step, "prompt_len": prompt_len, "token_ids": ids}
        out.append(SampleLogprobs(side="trainer", logprobs=trainer, **common))
        out.append(SampleLogprobs(side="rollout", logprobs=rollout, **common))
    return out


def step_fingerprints(
    samples: list[SampleLogprobs], k: int, layers: int, seed: int = 0
) -> list[RegionFingerprints]:
    """Every canonical region of a ``layers``-layer model at every position of the first ``k``
    samples, both sides (the rollout diverging from the middle layer on)."""
    rng = np.random.default_rng(seed)
    regions = canonical_regions(layers)
    out = []
    trainers = [s for s in samples if s.side == "trainer"][:k]
    for trainer in trainers:
        n = int(trainer.token_ids.size)
        for r, region in enumerate(regions):
            digest = rng.integers(0, 2**63, n, dtype=np.uint64)
            for side, case in (("trainer", "trainer_fwd"), ("rollout", "engine_prefill")):
                d = digest + np.uint64(1) if side == "rollout" and r > len(regions) // 2 else digest
                out.append(
                    RegionFingerprints(
                        run_id=RUN, step=trainer.step, side=side, case=case, sample_key=trainer.sample_key,
                        region=region, positions=np.arange(n, dtype=np.int32), digest=d, ladder_bits=[6, 4, 2, 0],
                        ladder=rng.integers(0, 2**63, (n, 4), dtype=np.uint64),
                        sketch=rng.standard_normal((n, 16)).astype(np.float32),
                        l2=rng.random(n).astype(np.float32) + 1, maxabs=rng.random(n).astype(np.float32),
                    )
                )  # fmt: skip
    return out


def batches(records: list[Any], max_records: int = 4096, max_bytes: int = 192 << 20) -> list[bytes]:
    """The bodies HttpSink would post: ``max_records`` per batch, split further while over ``max_bytes``."""
    out: list[bytes] = []
    for start in range(0, len(records), max_records):
        todo = [records[start : start + max_records]]
        while todo:
            chunk = todo.pop(0)
            body = encode_batch(chunk)
            if len(body) > max_bytes and len(chunk) > 1:
                todo[:0] = [chunk[: len(chunk) // 2], chunk[len(chunk) // 2 :]]
            else:
                out.append(body)
    return out


# ---------------------------------------------------------------------- databases


class Database:
    """A scratch database: a PostgreSQL schema of its own (dropped after) or an SQLite file."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        if kind == "sqlite":
            self.path = directory / "scale.db"
            self.url = f"sqlite:///{self.path}"
            Store(self.url).dispose()
            return
        from isoaudit.audit.db.schema import upgrade
        from sqlalchemy import create_engine, text

        self.schema = f"isoaudit_scale_{uuid.uuid4().hex[:10]}"
        self.admin = create_engine(PG_URL)
        with self.admin.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        self.url = f"{PG_URL}?options=-csearch_path%3D{self.schema}"
        upgrade(self.url)

    def size(self) -> int:
        """Bytes the database holds now (tables, indexes and TOAST; SQLite: file and WAL)."""
        if self.kind == "sqlite":
            return sum(p.stat().st_size for p in self.path.parent.glob(self.path.name + "*"))
        from sqlalchemy import text

        with self.admin.connect() as connection:
            return int(
                connection.execute(
                    text(
                        "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s AND c.relkind = 'r'"
                    ),
                    {"s": self.schema},
                ).scalar()
            )

    def vacuum(self) -> None:
        """Settle the sizes (PostgreSQL: VACUUM ANALYZE; SQLite: a WAL checkpoint)."""
        from sqlalchemy import text

        if self.kind == "sqlite":
            store = Store(self.url)
            with store.engine.connect() as connection:
                connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            store.dispose()
            return
        with self.admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text(f'SET search_path TO "{self.schema}"'))
            connection.execute(text("VACUUM ANALYZE"))

    def floor_insert(self, samples: list[SampleLogprobs]) -> float:
        """Seconds to INSERT the samples' array bytes into a bare table (no checks, no index but the
        key): the cost any store of these bytes pays on this database."""
        from sqlalchemy import BigInteger, Column, Integer, LargeBinary, MetaData, String, Table, insert

        table = Table(
            f"floor_{uuid.uuid4().hex[:6]}", MetaData(),
            Column("id", Integer, primary_key=True), Column("step", BigInteger), Column("side", String(16)),
            Column("token_ids", LargeBinary), Column("logprobs", LargeBinary),
        )  # fmt: skip
        store = Store(self.url)
        table.create(store.engine)
        rows = [
            {
                "step": s.step,
                "side": s.side,
                "token_ids": s.token_ids.tobytes(),
                "logprobs": s.logprobs.tobytes(),
            }
            for s in samples
        ]
        started = time.perf_counter()
        with store.engine.begin() as connection:
            connection.execute(insert(table), rows)
        elapsed = time.perf_counter() - started
        table.drop(store.engine)
        store.dispose()
        return elapsed

    def close(self) -> None:
        if self.kind == "sqlite":
            return
        from sqlalchemy import text

        with self.admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{self.schema}" CASCADE'))
        self.admin.dispose()


def post(client: httpx.Client, bodies: list[bytes]) -> int:
    stored = 0
    for body in bodies:
        response = client.post("/v1/ingest", content=body, headers={"Content-Type": "application/json"})
        response.raise_for_status()
        stored += sum(response.json()["stored"].values())
    return stored


# ---------------------------------------------------------------------- the measurements


def rl_step_cost(db: Database, args: argparse.Namespace) -> dict[str, Any]:
    """Wire bytes, bytes at rest, ingest and compare time of ``args.steps`` steps at full size."""
    store = Store(db.url)
    token = create_token(store, "scale")
    port = free_port()
    process = serve(db.url, port)
    worker = ComparisonWorker(store)
    figures: dict[str, list[float]] = {
        k: [] for k in ("wire", "rest", "ingest", "floor", "compare", "read", "rest_results")
    }
    fp: dict[str, float] = {}
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=600
        ) as api:
            post(api, batches([Run(run_id=RUN, name=RUN)]))
            for step in range(args.steps):
                samples = step_records(step, args.prompts, args.tokens, args.prompt_len)
                bodies = batches(samples)
                figures["wire"].append(sum(map(len, bodies)))
                db.vacuum()
                before = db.size()
                started = time.perf_counter()
                assert post(api, bodies) == len(samples)
                figures["ingest"].append(time.perf_counter() - started)
                db.vacuum()
                after = db.size()
                figures["rest"].append(after - before)
                figures["floor"].append(db.floor_insert(samples))
                del samples, bodies
                started = time.perf_counter()
                store.samples_of_steps([(RUN, step)])
                figures["read"].append(time.perf_counter() - started)
                started = time.perf_counter()
                assert worker.run_once(RUN) == args.prompts
                figures["compare"].append(time.perf_counter() - started)
                db.vacuum()
                figures["rest_results"].append(db.size() - after)
            if args.fingerprinted:
                step = args.steps
                samples = step_records(step, args.fingerprinted, args.tokens, args.prompt_len)
                prints = step_fingerprints(samples, args.fingerprinted, args.layers)
                bodies = batches(prints, max_records=512)
                fp["records"] = len(prints)
                fp["wire"] = sum(map(len, bodies))
                post(api, batches(samples))
                db.vacuum()
                before = db.size()
                started = time.perf_counter()
                post(api, bodies)
                fp["ingest"] = time.perf_counter() - started
                db.vacuum()
                fp["rest"] = db.size() - before
                del bodies, prints
                started = time.perf_counter()
                assert worker.run_once(RUN) == args.fingerprinted
                fp["compare"] = time.perf_counter() - started
    finally:
        stop_processes([process])
        store.dispose()
    out: dict[str, Any] = {k: statistics.median(v) for k, v in figures.items()}
    out["fingerprints"] = fp
    return out


def replica_throughput(db: Database, replicas: int, clients: int, seconds: float) -> dict[str, float]:
    """Samples/s that ``clients`` concurrent clients get stored through ``replicas`` replicas."""
    store = Store(db.url)
    token = create_token(store, "scale")
    ports = [free_port() for _ in range(replicas)]
    processes = [serve(db.url, port) for port in ports]
    stored = [0] * clients
    latencies: list[float] = []
    stop = threading.Event()
    # The bodies are built before the clock starts: the clients' own CPU must not compete with the
    # replicas' for this machine's cores. Enough for 50 batches/s per client.
    bodies = []
    for i in range(clients):
        run_id = f"load-{replicas}-{i}"
        mine = [batches([Run(run_id=run_id, name=run_id)])[0]]
        for step in range(int(50 * seconds) + 1):
            samples = step_records(step, 8, 448, 64, seed=i * 100_000)
            for s in samples:
                s.run_id = run_id
            mine += batches(samples)
        bodies.append(mine)

    def client(i: int) -> None:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{ports[i % replicas]}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        ) as api:
            post(api, bodies[i][:1])
            for body in bodies[i][1:]:
                if stop.is_set():
                    break
                started = time.perf_counter()
                stored[i] += post(api, [body])
                latencies.append(time.perf_counter() - started)

    try:
        elapsed = run_clients(client, clients, seconds, stop, join_s=120)
    finally:
        stop_processes(processes)
        store.dispose()
    latencies.sort()
    return {
        "samples_per_s": sum(stored) / elapsed,
        "per_replica": sum(stored) / elapsed / replicas,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def report_step(cost: dict[str, Any], raw: int, args: argparse.Namespace) -> None:
    mib = 1 << 20
    print(
        f"one RL step: {args.prompts} prompts x {args.tokens} tokens ({args.prompt_len} prompt), both sides, {args.database}"
    )
    print(f"  arrays (int32 tokens + float32 logprobs):  {raw / mib:8.1f} MiB")
    print(
        f"  on the wire (HttpSink JSON, base64):       {cost['wire'] / mib:8.1f} MiB  (x{cost['wire'] / raw:.2f} the arrays)"
    )
    print(
        f"  at rest, samples:                          {cost['rest'] / mib:8.1f} MiB  (x{cost['rest'] / raw:.2f})"
    )
    print(f"  at rest, comparison results:               {cost['rest_results'] / mib:8.1f} MiB")
    print(
        f"  ingest through one replica:                {cost['ingest']:8.2f} s    (x{cost['ingest'] / cost['floor']:.2f} a bare INSERT of the bytes, {cost['floor']:.2f} s)"
    )
    print(
        f"  compare (worker):                          {cost['compare']:8.2f} s    (x{cost['compare'] / cost['read']:.2f} reading the step back, {cost['read']:.2f} s)"
    )
    fp = cost["fingerprints"]
    if fp:
        print(
            f"  fingerprints, {args.fingerprinted} samples/side x {len(canonical_regions(args.layers))} regions x {args.tokens} positions "
            f"({fp['records']} records): wire {fp['wire'] / mib:.1f} MiB, at rest {fp['rest'] / mib:.1f} MiB, "
            f"ingest {fp['ingest']:.2f} s, compare {fp['compare']:.2f} s"
        )


def report_replicas(one: dict[str, float], two: dict[str, float], args: argparse.Namespace) -> None:
    for name, r in (("1 replica ", one), ("2 replicas", two)):
        print(
            f"records/s, {args.clients} clients, {name}: {r['samples_per_s']:.0f} samples/s "
            f"({r['per_replica']:.0f} per replica), p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms per 16-sample batch"
        )
    print(f"  two replicas against one: x{two['samples_per_s'] / one['samples_per_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per sample, prompt included")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="full-size steps measured (median)")
    parser.add_argument("--fingerprinted", type=int, default=2, help="samples per side fingerprinted")
    parser.add_argument("--layers", type=int, default=4, help="model layers the fingerprints cover")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run (tests)")
    parser.add_argument("--only", choices=("all", "step", "replicas"), default="all", help="what to measure")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()
    # The replicas this bench starts inherit these: no alert rules, and room for a full step's batch.
    os.environ.update(ISOAUDIT_DEFAULT_ALERT_RULES="0", ISOAUDIT_MAX_BODY_BYTES=str(256 << 20))
    if args.tiny:
        args.prompts, args.tokens, args.prompt_len, args.steps = 4, 96, 32, 1
        args.fingerprinted, args.layers, args.clients, args.seconds = 1, 1, 2, 1.0
    with tempfile.TemporaryDirectory() as tmp:
        db = Database(args.database, Path(tmp))
        try:
            cost = rl_step_cost(db, args) if args.only != "replicas" else None
            one, two = (
                [replica_throughput(db, n, args.clients, args.seconds) for n in (1, 2)]
                if args.only != "step"
                else (None, None)
            )
        finally:
            db.close()
    raw = args.prompts * 2 * (4 * args.tokens + 4 * (args.tokens - args.prompt_len))
    if cost is not None:
        report_step(cost, raw, args)
    if one is not None and two is not None:
        report_replicas(one, two, args)
    if args.json:
        print(json.dumps({"cost": cost, "raw_bytes": raw, "one": one, "two": two}))


if __name__ == "__main__":
    main()
