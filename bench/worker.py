"""Comparison-worker throughput: pairs compared per second from a filled queue, on SQLite and on
PostgreSQL, this checkout against a baseline revision of the code measured in the same run.

The queue holds what the soak's collectors send: ``--runs`` runs of ``--steps`` steps, each step 8
samples x 2 sides x 384 completion tokens with a manifest per side. The baseline is the worker of
``--baseline-rev`` (``git archive`` of that revision's ``audit`` and ``migrations``, run in a child
process on a database of its own), so both figures come from the same machine at the same moment.

    python bench/worker.py [--runs 4] [--steps 40] [--baseline-rev f2e813a] [--databases sqlite,postgres]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("ISOAUDIT_BENCH_CODE"):  # the baseline: that revision's code, not the editable install
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    sys.path.insert(0, os.environ["ISOAUDIT_BENCH_CODE"])

import numpy as np  # noqa: E402

PG_URL = os.environ.get("ISOAUDIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def records(run_id: str, step: int, n: int, n_completion: int, prompt_len: int = 64) -> list:
    from isoaudit.audit.records import SampleLogprobs

    rng = np.random.default_rng(step * 7919 + hash(run_id) % 1000)
    out = []
    for i in range(n):
        tokens = rng.integers(0, 150_000, prompt_len + n_completion, dtype=np.int32)
        rollout = -rng.exponential(1.0, n_completion).astype(np.float32)
        trainer = np.minimum(rollout + rng.normal(0, 1e-3, n_completion).astype(np.float32), 0)
        for side, lp in (("trainer", trainer), ("rollout", rollout)):
            out.append(
                SampleLogprobs(
                    run_id=run_id, step=step, side=side, prompt_len=prompt_len, token_ids=tokens, logprobs=lp
                )
            )
        del i
    return out


def fill(store, runs: int, steps: range, n: int, n_completion: int) -> int:
    from isoaudit.audit.records import Manifest, Run

    pairs = 0
    for r in range(runs):
        run_id = f"bench-{r}"
        head = [Run(run_id=run_id, name=run_id)]
        head += [Manifest(run_id=run_id, side="trainer", case="trainer_fwd")]
        head += [Manifest(run_id=run_id, side="rollout", case="engine_decode")]
        store.ingest(head, project="bench")
        for step in steps:
            store.ingest(records(run_id, step, n, n_completion), project="bench")
            pairs += n
    return pairs


def measure(url: str, runs: int, steps: int, n: int, n_completion: int, history: int) -> dict:
    """Fill a fresh database at ``url`` with ``history`` compared steps per run, then ``steps`` more
    queued, and time the worker draining the queue."""
    from isoaudit.audit.db import Store
    from isoaudit.audit.worker import ComparisonWorker

    if not url.startswith("sqlite"):
        from isoaudit.audit.db.schema import upgrade

        upgrade(url)
    store = Store(url)
    on_step = None
    if (
        os.environ.get("ISOAUDIT_BENCH_ALERTS") == "1"
    ):  # the service's shape: default rules evaluated per step
        from isoaudit.audit.alerts import (
            AlertEngine,
            DatabaseChannel,
            LogChannel,
            default_rules,
            install_rules,
        )

        install_rules(store, default_rules(), "default", replace=False)
        on_step = AlertEngine(store, [LogChannel(), DatabaseChannel()]).evaluate
    worker = ComparisonWorker(store, on_step=on_step)
    if history:
        fill(store, runs, range(history), n, n_completion)
        while worker.run_once():
            pass
    pairs = fill(store, runs, range(history, history + steps), n, n_completion)
    started = time.perf_counter()
    done = 0
    while True:
        got = worker.run_once()
        if not got:
            break
        done += got
    elapsed = time.perf_counter() - started
    compared = sum(len(store.step_results(f"bench-{r}")) for r in range(runs)) - runs * history
    store.dispose()
    return {
        "pairs": pairs,
        "compared": done,
        "steps": compared,
        "seconds": elapsed,
        "pairs_per_s": done / elapsed,
    }


def pg_schema_url() -> tuple[str, object]:
    from sqlalchemy import create_engine, text

    schema = f"isoaudit_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))

    def drop() -> None:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()

    return f"{PG_URL}?options=-csearch_path%3D{schema}", drop


def run_here(database: str, args: argparse.Namespace) -> dict:
    if database == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            return measure(
                f"sqlite:///{tmp}/bench.db", args.runs, args.steps, args.samples, args.tokens, args.history
            )
    url, drop = pg_schema_url()
    try:
        return measure(url, args.runs, args.steps, args.samples, args.tokens, args.history)
    finally:
        drop()  # type: ignore[operator]


def run_baseline(rev: str, database: str, argv: list[str]) -> dict:
    """This script, run against revision ``rev``'s ``audit`` and ``migrations`` in a child process."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "audit", "migrations"], check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryDirectory() as code:
        tarfile.open(fileobj=BytesIO(archive)).extractall(code, filter="data")
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--databases", database, "--baseline-rev", "", "--json"],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "ISOAUDIT_BENCH_CODE": code, "PYTHONPATH": code},
        )
    return json.loads(out.stdout.strip().splitlines()[-1])[database]


def live(url: str, layout: str, clients: int, seconds: float, drain_s: float = 60.0) -> dict:
    """The soak's shape against ``layout``: ``thread`` (one `isoaudit serve --worker-thread`: the
    worker a thread of the API process, the default before), ``child`` (one `isoaudit serve`: the
    worker a child process it supervises, the default now) or ``process`` (`isoaudit serve
    --no-worker` plus one `isoaudit worker` process). ``clients``
    HttpSinks each send a step of 8 samples x 2 sides x 384 tokens every 250 ms for ``seconds``;
    returns samples/s stored and pairs/s compared over the send window plus the drain."""
    import threading

    from isoaudit.audit.api.live import free_port
    from isoaudit.audit.auth import create_token
    from isoaudit.audit.db import Store
    from isoaudit.audit.db.models import SampleResultRow
    from isoaudit.audit.records import Run
    from isoaudit.collectors.sinks.http import HttpSink
    from sqlalchemy import func, select

    sys.path.insert(0, str(ROOT / "bench"))
    from _runner import run_clients, stop_processes
    from api_load import serve

    store = Store(url)
    token = create_token(store, "live")
    port = free_port()
    env = {"ISOAUDIT_DEFAULT_ALERT_RULES": "1", "ISOAUDIT_WORKER_INTERVAL_S": "0.2"}
    os.environ.update(env)
    processes = []
    if layout == "process":
        processes.append(serve(url, port))  # --no-worker
        worker = [sys.executable, "-m", "isoaudit.cli", "worker", "--database-url", url]
        processes.append(subprocess.Popen(worker, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    else:
        command = [sys.executable, "-m", "isoaudit.cli", "serve", "--database-url", url, "--port", str(port)]
        command += ["--worker-thread"] if layout == "thread" else []
        processes.append(subprocess.Popen([*command, "--log-level", "warning"]))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                import httpx

                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except Exception:
                time.sleep(0.1)
    sinks = [HttpSink(f"http://127.0.0.1:{port}", token, spool_dir=None) for _ in range(clients)]
    stop = threading.Event()
    sent = [0] * clients

    def collector(i: int) -> None:
        run_id = f"live-{layout}-{i}"
        sinks[i].send([Run(run_id=run_id, name=run_id)])
        step = 0
        while not stop.is_set():
            batch = [r.model_copy(update={"run_id": run_id}) for r in records("x", step, 8, 384)]
            sinks[i].send(batch)
            sent[i] += len(batch) // 2
            step += 1
            stop.wait(0.25)

    def compared() -> int:
        with store.sessions() as session:
            return session.scalar(select(func.count()).select_from(SampleResultRow)) or 0

    try:
        started = time.monotonic()
        sent_window = run_clients(collector, clients, seconds, stop, join_s=30)
        for sink in sinks:
            sink.flush(120)
        at_send_end = compared()
        deadline = time.monotonic() + drain_s
        while compared() < sum(sent) and time.monotonic() < deadline:
            time.sleep(0.5)
        done, elapsed = compared(), time.monotonic() - started
    finally:
        for sink in sinks:
            sink.close(10)
        stop_processes(processes)
        store.dispose()
    return {
        "samples_per_s": 2 * sum(sent) / sent_window,
        "pairs_sent": sum(sent),
        "compared_during_send": at_send_end,
        "compared": done,
        "pairs_per_s": done / elapsed,
        "left": sum(sent) - done,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--history", type=int, default=0, help="steps per run compared before timing")
    parser.add_argument("--samples", type=int, default=8, help="samples per step")
    parser.add_argument("--tokens", type=int, default=384, help="completion tokens per sample")
    parser.add_argument("--databases", default="sqlite,postgres")
    parser.add_argument("--baseline-rev", default="f2e813a", help="'' to skip the baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON line (used for the baseline)")
    parser.add_argument(
        "--live",
        type=float,
        default=0.0,
        help="seconds of the soak's shape: the worker as the API's thread, its child, its own process",
    )
    parser.add_argument("--clients", type=int, default=16, help="collectors of --live")
    args = parser.parse_args()
    if args.live:
        for layout in ("thread", "child", "process"):
            url, drop = pg_schema_url()
            try:
                from isoaudit.audit.db.schema import upgrade

                upgrade(url)
                r = live(url, layout, args.clients, args.live)
            finally:
                drop()  # type: ignore[operator]
            print(
                f"live {layout:7s} {args.clients} collectors {args.live:.0f} s: ingest {r['samples_per_s']:.0f} samples/s; "
                f"compared {r['compared_during_send']} of {r['pairs_sent']} pairs by the last send, {r['compared']} "
                f"after the drain ({r['pairs_per_s']:.0f} pairs/s overall, {r['left']} left)"
            )
        return
    shape = ["--runs", str(args.runs), "--steps", str(args.steps), "--history", str(args.history)]
    shape += ["--samples", str(args.samples), "--tokens", str(args.tokens)]
    results = {}
    for database in args.databases.split(","):
        current = run_here(database, args)
        results[database] = current
        if args.baseline_rev:
            base = run_baseline(args.baseline_rev, database, shape)
            print(
                f"{database:8s} {current['pairs']} pairs: now {current['pairs_per_s']:.0f} pairs/s "
                f"({current['seconds']:.2f} s), {args.baseline_rev} {base['pairs_per_s']:.0f} pairs/s "
                f"({base['seconds']:.2f} s): x{current['pairs_per_s'] / base['pairs_per_s']:.2f}"
            )
        elif not args.json:
            print(f"{database:8s} {current['pairs']} pairs: {current['pairs_per_s']:.0f} pairs/s")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
