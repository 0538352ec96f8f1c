"""``/metrics``: series and scrape time with 10, 100 and 1,000 recorded runs of which 10 are active,
beside the unbounded export (every run ever compared, as ``/metrics`` was before the active window)
measured in the same run, on SQLite and PostgreSQL.

Each run has ``--steps`` compared steps carrying the ~170 figures of a real comparison (one step of
8 samples x 256 tokens compared by the worker, its figures then stored for every step), the default
alert rules evaluated on its latest step (so a run over the threshold has its alert open); the
runs beyond the active ones were last compared a day ago (finished). Both exports are served by the
real app over real HTTP (the unbounded one as a window longer than any run's age) and timed as a
scrape: the median of ``--repeat`` GETs. Targets: the series count flat in the recorded runs, a
scrape at most 0.3 s at 1,000 runs.

    python bench/metrics_scrape.py [--runs 10,100,1000] [--active 10] [--steps 20]
        [--backend sqlite|postgres|both] [--postgres-url URL] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

# Run as a script, this file's folder comes first on sys.path and its name would hide the
# `dashboard` package: put the repository root first instead.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [p for p in sys.path if p not in (_HERE, "")]

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel, default_rules, install_rules  # noqa: E402
from isoaudit.audit.api import create_app  # noqa: E402
from isoaudit.audit.api.live import LiveServer  # noqa: E402
from isoaudit.audit.db import Store  # noqa: E402
from isoaudit.audit.db.models import StepResultRow  # noqa: E402
from isoaudit.audit.records import Run, SampleLogprobs, utcnow  # noqa: E402
from isoaudit.audit.settings import Settings  # noqa: E402
from isoaudit.audit.worker import ComparisonWorker  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from sqlalchemy import create_engine, text, update  # noqa: E402

TARGET_S = 0.3
#: A window longer than any run's age: the export of every run ever compared.
UNBOUNDED_S = 10 * 365 * 24 * 3600.0
console = Console(width=150)


def real_figures() -> dict[str, Any]:
    """The figures of one really compared step (8 samples x 256 tokens, 30% of tokens nudged)."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        store = Store(f"sqlite:///{folder}/figures.db")
        records: list[Any] = [Run(run_id="figures")]
        for i in range(8):
            ids = rng.integers(0, 150_000, 16 + 256, dtype=np.int32)
            ids[0] = i
            lp = -rng.exponential(1.0, 256).astype(np.float32)
            nudged = np.minimum(lp + (rng.random(256) < 0.3) * rng.normal(0, 3e-2, 256).astype(np.float32), 0)
            common = {
                "run_id": "figures",
                "step": 0,
                "prompt_len": 16,
                "token_ids": ids,
                "weight_version": "0",
            }
            trainer = SampleLogprobs(side="trainer", logprobs=lp, **common)
            records += [
                trainer,
                SampleLogprobs(side="rollout", logprobs=nudged, sample_key=trainer.sample_key, **common),
            ]
        store.ingest(records)
        ComparisonWorker(store).run_once("figures")
        [row] = store.step_results("figures")
        store.dispose()
    return dict(row.metrics)


def record_runs(
    store: Store, first: int, last: int, args: argparse.Namespace, figures: dict[str, Any]
) -> None:
    """Runs ``first`` .. ``last - 1`` with ``args.steps`` compared steps each and the default rules
    evaluated on the latest; all but the first ``args.active`` runs ever recorded finished a day ago."""
    engine = AlertEngine(store, [DatabaseChannel()])
    ids = [f"run-{i:05d}" for i in range(first, last)]
    store.ingest([Run(run_id=run_id, name=f"bench run {run_id}") for run_id in ids])
    for n, run_id in enumerate(ids, start=first):
        metrics = {**figures, "kl_k3": figures["kl_k3"] * (1 + n % 7)}
        rows = [
            {"run_id": run_id, "step": step, "n_samples": 8, "metrics": metrics, "diagnoses": {}}
            for step in range(args.steps)
        ]
        store.save_comparison([], rows, [])
        engine.evaluate(run_id, args.steps - 1, metrics)
    finished = [r for i, r in enumerate(ids, start=first) if i >= args.active]
    with store.engine.begin() as connection:
        connection.execute(
            update(StepResultRow)
            .where(StepResultRow.run_id.in_(finished))
            .values(computed_at=utcnow() - timedelta(days=1))
        )


def scrape(url: str, repeat: int) -> tuple[int, float]:
    """(series, median seconds) of ``repeat`` GETs of ``/metrics`` after one warm-up."""
    with httpx.Client(timeout=120) as client:
        client.get(f"{url}/metrics").raise_for_status()
        times, body = [], ""
        for _ in range(repeat):
            start = time.perf_counter()
            reply = client.get(f"{url}/metrics")
            times.append(time.perf_counter() - start)
            reply.raise_for_status()
            body = reply.text
    series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
    return series, statistics.median(times)


def open_store(backend: str, args: argparse.Namespace, folder: Path) -> tuple[Store, str | None]:
    """A fresh store (the PostgreSQL schema's name comes back, to drop after)."""
    if backend == "sqlite":
        return Store(f"sqlite:///{folder / 'metrics-scrape.db'}"), None
    schema = f"bench_metrics_{uuid.uuid4().hex[:10]}"
    admin = create_engine(args.postgres_url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    return Store(f"{args.postgres_url}?options=-csearch_path%3D{schema}", upgrade=True), schema


def drop_schema(args: argparse.Namespace, schema: str) -> None:
    admin = create_engine(args.postgres_url)
    with admin.begin() as connection:
        connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


def measure(
    backend: str, args: argparse.Namespace, figures: dict[str, Any]
) -> list[tuple[int, int, float, int, float]]:
    """(recorded runs, series, scrape s, unbounded series, unbounded scrape s) per size."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store, schema = open_store(backend, args, Path(folder))
        try:
            install_rules(store, default_rules(), "default", replace=False)
            served = {
                name: LiveServer(create_app(store, Settings(
                    run_worker=False, default_alert_rules=False, require_token_for_reads=False,
                    metrics_active_window_s=window,
                )))
                for name, window in (("window", 3600.0), ("unbounded", UNBOUNDED_S))
            }  # fmt: skip
            for server in served.values():
                server.start()
            recorded = 0
            for size in args.runs:
                started = time.perf_counter()
                record_runs(store, recorded, size, args, figures)
                recorded = size
                console.log(f"{backend}: {size} runs recorded ({time.perf_counter() - started:.1f} s)")
                bounded = scrape(served["window"].url, args.repeat)
                unbounded = scrape(served["unbounded"].url, args.repeat)
                rows.append((size, *bounded, *unbounded))
            for server in served.values():
                server.stop()
        finally:
            store.dispose()
            if schema is not None:
                drop_schema(args, schema)
    return rows


def report(backend: str, rows: list[tuple[int, int, float, int, float]], args: argparse.Namespace) -> None:
    table = Table(title=f"{backend}: /metrics with {args.active} active runs, {args.steps} compared steps a run "
                  f"(median of {args.repeat} scrapes over HTTP)")  # fmt: skip
    for column in ("recorded runs", "series", "scrape s", "unbounded series", "unbounded scrape s",
                   "series ratio", "time ratio", f"scrape <= {TARGET_S:g} s"):  # fmt: skip
        table.add_column(column, justify="right")
    for size, series, seconds, all_series, all_seconds in rows:
        table.add_row(
            f"{size:,}", f"{series:,}", f"{seconds:.3f}", f"{all_series:,}", f"{all_seconds:.3f}",
            f"{series / all_series:.3f}", f"{seconds / all_seconds:.3f}", "yes" if seconds <= TARGET_S else "NO",
        )  # fmt: skip
    console.print(table)
    flat = len({series for _, series, *_ in rows}) == 1
    console.print(f"{backend}: series count {'flat' if flat else 'NOT flat'} in the recorded runs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=lambda v: sorted(int(x) for x in v.split(",")), default=[10, 100, 1000]
    )
    parser.add_argument("--active", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="compared steps of each run")
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("ISOAUDIT_BENCH_POSTGRES_URL", os.environ.get("ISOAUDIT_TEST_POSTGRES_URL")),
    )
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if args.runs[0] < args.active:
        parser.error(f"--runs: the smallest size must hold the {args.active} active runs")
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    if "postgres" in backends and not args.postgres_url:
        if args.backend == "postgres":
            parser.error("--postgres-url (or ISOAUDIT_TEST_POSTGRES_URL) is needed for PostgreSQL")
        backends.remove("postgres")
        console.print("PostgreSQL: skipped (ISOAUDIT_TEST_POSTGRES_URL is not set)")
    figures = real_figures()
    for backend in backends:
        report(backend, measure(backend, args, figures), args)


if __name__ == "__main__":
    main()
