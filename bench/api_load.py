"""Load on the HTTP ingest path: 8 concurrent collector clients, each posting steps of 128 samples x
2,048 tokens on both sides (one request per side per step, as a trainer and a rollout collector
would), against ``isoaudit serve`` in its own process. Reports records/s and ingest latency
percentiles on SQLite and PostgreSQL, then checks that every record is stored exactly once,
including a replay of each client's first step (which must store nothing).

    python bench/api_load.py [--clients 8] [--steps 6] [--samples 128] [--tokens 2048] [--postgres URL]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, func, select, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isoaudit.audit.auth import create_token  # noqa: E402
from isoaudit.audit.db import Store  # noqa: E402
from isoaudit.audit.db.models import SampleRow  # noqa: E402
from isoaudit.audit.records import Batch, SampleLogprobs  # noqa: E402

PROMPT_LEN = 256


def side_template(run_id: str, side: str, n_samples: int, n_tokens: int, seed: int) -> str:
    """The JSON body of one side of step 0; other steps differ only in ``"step"``."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n_samples):
        tokens = rng.integers(0, 150_000, n_tokens, dtype=np.int32)
        tokens[0] = i
        lp = -rng.exponential(1.0, n_tokens - PROMPT_LEN).astype(np.float32)
        if side == "rollout":
            lp = np.minimum(lp + 1e-3 * rng.standard_normal(lp.size).astype(np.float32), 0)
        records.append(
            SampleLogprobs(
                run_id=run_id, step=0, side=side, prompt_len=PROMPT_LEN, token_ids=tokens, logprobs=lp
            )
        )
    body = Batch(records=records).model_dump_json()
    assert body.count('"step":0,') == n_samples
    return body


def body_for_step(template: str, step: int) -> bytes:
    return template.replace('"step":0,', f'"step":{step},').encode()


@dataclass
class ClientResult:
    latencies: list[float] = field(default_factory=list)
    stored: int = 0
    duplicates: int = 0
    errors: list[str] = field(default_factory=list)


def client(
    url: str, token: str, templates: dict[str, str], steps: int, result: ClientResult, start: threading.Event
) -> None:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
        start.wait()
        for step in [*range(steps), 0]:  # the last one replays step 0: it must store nothing
            for side in ("trainer", "rollout"):
                body = body_for_step(templates[side], step)
                began = time.perf_counter()
                reply = http.post("/v1/ingest", content=body)
                elapsed = time.perf_counter() - began
                if reply.status_code != 200:
                    result.errors.append(f"step {step} {side}: {reply.status_code} {reply.text[:200]}")
                    continue
                result.latencies.append(elapsed)
                counts = reply.json()
                result.stored += counts["stored"].get("sample", 0)
                result.duplicates += counts["duplicates"].get("sample", 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(database_url: str, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "isoaudit.cli",
        "serve",
        "--database-url",
        database_url,
        "--port",
        str(port),
        "--no-worker",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the service did not start")


def run_load(name: str, database_url: str, args: argparse.Namespace) -> dict:
    store = Store(database_url, upgrade=True)  # the bench's own scratch database
    token = create_token(store, "bench")
    templates = [
        {
            side: side_template(f"load-{c}", side, args.samples, args.tokens, seed=c)
            for side in ("trainer", "rollout")
        }
        for c in range(args.clients)
    ]
    port = free_port()
    server = serve(database_url, port)
    results = [ClientResult() for _ in range(args.clients)]
    start = threading.Event()
    threads = [
        threading.Thread(
            target=client,
            args=(f"http://127.0.0.1:{port}", token, templates[c], args.steps, results[c], start),
        )
        for c in range(args.clients)
    ]
    try:
        for thread in threads:
            thread.start()
        began = time.perf_counter()
        start.set()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
    finally:
        server.terminate()
        server.wait(30)

    errors = [e for r in results for e in r.errors]
    latencies = sorted(x for r in results for x in r.latencies)
    expected = args.clients * args.steps * 2 * args.samples
    stored = sum(r.stored for r in results)
    duplicates = sum(r.duplicates for r in results)
    with store.sessions() as session:
        in_db = session.scalar(select(func.count()).select_from(SampleRow))
        per_key = session.execute(
            select(SampleRow.run_id, SampleRow.step, SampleRow.side, func.count()).group_by(
                SampleRow.run_id, SampleRow.step, SampleRow.side
            )
        ).all()
    store.dispose()
    exactly_once = (
        not errors
        and stored == expected == in_db
        and duplicates == args.clients * 2 * args.samples
        and len(per_key) == args.clients * args.steps * 2
        and all(n == args.samples for *_, n in per_key)
    )
    mb = sum(len(body) for t in templates for body in t.values()) * (args.steps + 1) / 1e6
    summary = {
        "database": name,
        "clients": args.clients,
        "requests": len(latencies),
        "records_stored": stored,
        "records_per_s": round(stored / wall, 1),
        "MB_per_s": round(mb / wall, 1),
        "wall_s": round(wall, 2),
        "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "latency_p99_s": round(float(np.percentile(latencies, 99)), 3) if latencies else None,
        "latency_max_s": round(latencies[-1], 3) if latencies else None,
        "exactly_once": exactly_once,
        "errors": errors[:5],
    }
    print(json.dumps(summary))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="steps per client (plus one replayed step)")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--postgres", default=os.environ.get("ISOAUDIT_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    print(
        f"{args.clients} clients x {args.steps} steps x {args.samples} samples x {args.tokens} tokens x 2 sides "
        f"(+1 replayed step each)"
    )
    summaries = []
    with tempfile.TemporaryDirectory() as directory:
        summaries.append(run_load("sqlite", f"sqlite:///{directory}/load.db", args))
    if args.postgres:
        schema = f"isoaudit_load_{uuid.uuid4().hex[:8]}"
        admin = create_engine(args.postgres)
        with admin.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        try:
            summaries.append(
                run_load("postgresql", f"{args.postgres}?options=-csearch_path%3D{schema}", args)
            )
        finally:
            with admin.begin() as connection:
                connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
    if not all(s["exactly_once"] for s in summaries):
        sys.exit("FAILED: some record was not stored exactly once")


if __name__ == "__main__":
    main()
