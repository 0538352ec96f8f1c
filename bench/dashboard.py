"""The dashboard's page callbacks on a large run, each beside the time of its store queries alone
(the baseline, measured in the same run), on SQLite and PostgreSQL.

The run (default 1,000 steps x 256 samples x 1,024 completion tokens on both sides, fingerprints for
16 samples a step) is written through ``Store.ingest`` and compared by the worker, once: the SQLite
file and the PostgreSQL schema are named by the size and reused (and resumed if a build was
interrupted). Targets: run page < 1.5 s, sample page < 0.5 s, a live update with one new step < 0.2 s.

    python bench/dashboard.py [--steps 1000 --samples 256 --tokens 1024 --fingerprinted 16]
        [--backend sqlite|postgres|both] [--postgres-url URL] [--repeat 3]

The full size takes hours on a small machine: build it in the background (``nice -n 19``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script, this file's folder comes first on sys.path and its name would hide the
# `dashboard` package: put the repository root first instead.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [p for p in sys.path if p not in (_HERE, "")]

import numpy as np  # noqa: E402
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel, default_rules, install_rules  # noqa: E402
from isoaudit.audit.db import Store, reads  # noqa: E402
from isoaudit.audit.records import Manifest, RegionFingerprints, Run, RuntimeFacts, SampleLogprobs  # noqa: E402
from isoaudit.audit.regions import canonical_regions  # noqa: E402
from isoaudit.audit.worker import ComparisonWorker  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402
from tqdm import tqdm  # noqa: E402

RUN_ID = "bench-dashboard"
PROMPT = 16
TARGETS = {"run page": 1.5, "sample page": 0.5, "live update (1 step)": 0.2}
console = Console(width=150)


# ---------------------------------------------------------------------- building the run


def step_records(step: int, samples: int, tokens: int, fingerprinted: int, fp_positions: int) -> list[Any]:
    """One step: ``samples`` samples on both sides (30% of tokens nudged on the rollout), and
    fingerprints of 8 regions over the first ``fp_positions`` positions for ``fingerprinted`` of them,
    diverging from a random region on."""
    rng = np.random.default_rng(step)
    out: list[Any] = []
    regions = canonical_regions(1)
    for i in range(samples):
        ids = rng.integers(0, 150_000, PROMPT + tokens, dtype=np.int32)
        ids[:2] = (step, i)
        lp = -rng.exponential(1.0, tokens).astype(np.float32)
        nudged = np.minimum(
            lp + (rng.random(tokens) < 0.3) * rng.normal(0, 1e-2, tokens).astype(np.float32), 0
        )
        common = {
            "run_id": RUN_ID,
            "step": step,
            "prompt_len": PROMPT,
            "token_ids": ids,
            "weight_version": "0",
        }
        trainer = SampleLogprobs(side="trainer", logprobs=lp, **common)
        rollout = SampleLogprobs(side="rollout", logprobs=nudged, sample_key=trainer.sample_key, **common)
        out += [trainer, rollout]
        if i >= fingerprinted:
            continue
        n = min(fp_positions, ids.size)
        positions = np.arange(n, dtype=np.int32)
        first = int(rng.integers(1, len(regions)))
        for r, region in enumerate(regions):
            digest = rng.integers(0, 2**63, n, dtype=np.uint64)
            ladder = rng.integers(0, 2**63, (n, 4), dtype=np.uint64)
            sketch = rng.standard_normal((n, 16)).astype(np.float32)
            l2 = (rng.random(n) + 1).astype(np.float32)
            for side, case in (("trainer", "trainer_fwd"), ("rollout", "engine_prefill")):
                d = digest + np.uint64(1) if side == "rollout" and r >= first else digest
                out.append(
                    RegionFingerprints(
                        run_id=RUN_ID, step=step, side=side, case=case, sample_key=trainer.sample_key,
                        region=region, positions=positions, digest=d, ladder_bits=[6, 4, 2, 0], ladder=ladder,
                        sketch=sketch * (1.001 if d is not digest else 1.0), l2=l2, maxabs=l2,
                    )
                )  # fmt: skip
    return out


def header_records() -> list[Any]:
    manifests = [
        Manifest(run_id=RUN_ID, side=side, case=case, runtime=RuntimeFacts(dtype=dtype, remediation="native"))
        for side, case, dtype in (
            ("trainer", "trainer_fwd", "bfloat16"),
            ("rollout", "engine_decode", "float16"),
        )
    ]
    return [Run(run_id=RUN_ID, name="bench: dashboard"), *manifests]


def build(store: Store, args: argparse.Namespace, upto: int) -> None:
    """Write and compare steps until ``upto`` steps exist (resuming a build that stopped)."""
    install_rules(store, default_rules(), "default", replace=False)
    engine = AlertEngine(store, channels=[DatabaseChannel()])
    worker = ComparisonWorker(store, on_step=engine.evaluate)
    have = reads.last_compared_step(store, RUN_ID)
    start = 0 if have is None else have + 1
    if start >= upto:
        return
    if start == 0:
        store.ingest(header_records())
    for step in tqdm(range(start, upto), desc=f"building {store.dialect}", initial=start, total=upto):
        store.ingest(step_records(step, args.samples, args.tokens, args.fingerprinted, args.fp_positions))
        worker.run_once(RUN_ID)


def open_store(backend: str, args: argparse.Namespace) -> Store:
    size = f"{args.steps}x{args.samples}x{args.tokens}x{args.fingerprinted}"
    if backend == "sqlite":
        path = Path(args.cache_dir) / f"bench-dashboard-{size}.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        return Store(f"sqlite:///{path}")
    schema = f"bench_dashboard_{size.replace('x', '_')}"
    admin = create_engine(args.postgres_url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    admin.dispose()
    url = f"{args.postgres_url}?options=-csearch_path%3D{schema}"
    from isoaudit.audit.db.schema import upgrade

    upgrade(url)
    return Store(url, upgrade=False)


# ---------------------------------------------------------------------- timing


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(store: Store, repeat: int) -> list[tuple[str, float, float]]:
    """(page, callback seconds, queries-alone seconds) for each page."""
    from isoaudit.dashboard import create_app
    from isoaudit.dashboard.pages import alerts, contract, runs, sample
    from isoaudit.dashboard.pages.run import header, heatmaps, live, page, timelines
    from isoaudit.dashboard.pages.run.state import LiveState

    app = create_app(store)
    last = reads.last_compared_step(store, RUN_ID)
    assert last is not None and last >= 1, "the run needs at least two compared steps"
    worst = max(reads.step_samples(store, RUN_ID, last), key=lambda s: s.abs_diff_max or 0)
    key = next(
        (s.sample_key for s in reads.step_samples(store, RUN_ID, last) if s.first_divergence_region),
        worst.sample_key,
    )
    rows = []
    with app.server.test_request_context("/"):
        state = live.draw(store, RUN_ID).state
        state.last_step = last - 1  # the page has drawn every step but the newest
        live_state = state.to_json()

        def run_queries() -> None:
            points = reads.step_series(store, RUN_ID)
            timelines.annotation_frames(store, RUN_ID, points[-1].step)
            reads.run_overview(store, RUN_ID)
            reads.step_samples(store, RUN_ID, last)

        def live_queries() -> None:
            points = reads.step_series(store, RUN_ID, after_step=last - 1)
            timelines.annotation_frames(store, RUN_ID, points[-1].step)
            reads.run_overview(store, RUN_ID)

        def live_callbacks() -> None:
            out = live.tick(1, live_state)
            assert LiveState.from_json(out[4]).last_step == last
            header.tick_status(1, live_state)

        cases: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
            ("runs page", runs.layout, lambda: reads.runs_overview(store)),
            ("run page", lambda: page.layout(run_id=RUN_ID), run_queries),
            ("run page: mean/max switch", lambda: heatmaps.redraw_position("max", live_state), lambda: reads.step_series(store, RUN_ID)),
            ("live update (1 step)", live_callbacks, live_queries),
            ("sample page", lambda: sample.layout(run_id=RUN_ID, step=str(last), sample_key=key),
             lambda: (reads.sample_detail(store, RUN_ID, last, key), store.get_run(RUN_ID))),
            ("contract page", lambda: contract.layout(run_id=RUN_ID), lambda: reads.contract_view(store, RUN_ID)),
            ("alerts page", alerts.layout, lambda: reads.alerts_view(store)),
        ]  # fmt: skip
        for name, callback, baseline in cases:
            callback()  # warm caches (imports, the database's pages)
            rows.append((name, median_time(callback, repeat), median_time(baseline, repeat)))
    return rows


def report(backend: str, rows: list[tuple[str, float, float]], args: argparse.Namespace) -> None:
    table = Table(title=f"{backend}: {args.steps} steps x {args.samples} samples x {args.tokens} tokens, "
                  f"{args.fingerprinted} fingerprinted a step (median of {args.repeat})")  # fmt: skip
    for column in ("page (callbacks)", "callbacks s", "queries s", "callbacks / queries", "target s", "met"):
        table.add_column(column)
    for name, callback, baseline in rows:
        target = TARGETS.get(name)
        met = "" if target is None else ("yes" if callback < target else "NO")
        table.add_row(name, f"{callback:.3f}", f"{baseline:.3f}", f"{callback / baseline:.2f}x",
                      "" if target is None else f"{target:g}", met)  # fmt: skip
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024, help="completion tokens per sample")
    parser.add_argument("--fingerprinted", type=int, default=16, help="samples a step with fingerprints")
    parser.add_argument("--fp-positions", type=int, default=64, help="positions each fingerprint covers")
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("ISOAUDIT_BENCH_POSTGRES_URL", os.environ.get("ISOAUDIT_TEST_POSTGRES_URL")),
    )
    parser.add_argument("--cache-dir", default=".isoaudit")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--build-only", action="store_true", help="build (or finish building) and exit")
    parser.add_argument(
        "--no-build", action="store_true", help="measure the steps built so far (of a build still under way)"
    )
    args = parser.parse_args(argv)
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    if "postgres" in backends and not args.postgres_url:
        parser.error("--postgres-url (or ISOAUDIT_BENCH_POSTGRES_URL) is needed for PostgreSQL")
    for backend in backends:
        store = open_store(backend, args)
        try:
            if not args.no_build:
                build(store, args, args.steps)
            if not args.build_only:
                built = (reads.last_compared_step(store, RUN_ID) or 0) + 1
                report(f"{backend} ({built} of {args.steps} steps built)", measure(store, args.repeat), args)
        finally:
            store.dispose()


if __name__ == "__main__":
    main()
