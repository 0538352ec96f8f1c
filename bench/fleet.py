"""A fleet load test: K concurrent jobs against two API replicas and several comparison workers on
one PostgreSQL, as isoaudit is deployed (``isoaudit serve --no-worker`` replicas, ``isoaudit worker``
processes), all of them real processes on this machine.

Each job is a run with two collectors, a trainer's and a rollout's, each an ``HttpSink`` (the real
sink: background thread, batching, spool) posting to a different replica; every ``--interval`` s a job
sends one step (``--samples`` samples of ``--tokens`` tokens, ``--prompt-len`` of them prompt, both
sides, ``--clean-fraction`` of them agreeing bit for bit; every ``--fingerprint-every``-th step also
fingerprints of 2 samples per side over a 1-layer model's regions). Reported:

* **ingest**: samples and tokens stored per second, against what the jobs offered (same run);
  the lag from a step's send to its last sample stored; the sinks' drops and retries, and the
  deadlocks PostgreSQL detected meanwhile;
* **comparison**: steps and tokens compared per second, against what was offered; the lag from a
  step's send to its comparison (``step_results.computed_at``), p50 / p95 / max; steps per worker;
* **disk**: the schema's size (tables, indexes, TOAST, after VACUUM) and the arrays' stored bytes
  (``Store.disk_use``) after the drain, before and after the project's retention policy
  (``--raw-days 0 --fingerprint-steps N``) is applied; it is also applied once mid-run, under load;
* **one worker's limit**: a sweep over step sizes (samples per step at ``--tokens`` tokens) at a fixed
  step rate (one step per ``--interval`` s), one job and ONE ``isoaudit worker``: the first size at
  which the worker's lag (stored -> compared) grows by more than ``BEHIND x interval`` a step is
  where it stops keeping up (a worker needing c > interval per step adds c - interval to each next
  step's lag). The ingest lag's growth is printed beside it, so a point where ingest fell behind
  too is visible as such.

    python bench/fleet.py                      # the figures of docs/scale.md ("Fleet")
    python bench/fleet.py --tiny --json        # seconds: what tests/service/test_fleet.py runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store, StoreConflict, StoreUnavailable
from isoaudit.audit.db.alerts import utc
from isoaudit.audit.db.models import PendingComparisonRow, SampleRow, StepResultRow
from isoaudit.collectors.sinks.http import HttpSink
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import stop_processes  # noqa: E402
from api_load import free_port, serve  # noqa: E402  (`isoaudit serve --no-worker`: workers run apart)
from scale import Database, step_fingerprints, step_records  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROJECT, SWEEP_PROJECT = "fleet", "fleet-sweep"
FINGERPRINTED = 2  # samples per side fingerprinted on a fingerprinted step
#: A worker is behind when its lag grows by more than this share of the step interval per step.
BEHIND = 0.1
MIB = 1 << 20


# ---------------------------------------------------------------------- processes


def start_workers(url: str, n: int, logs: Path, *, run: str | None = None) -> list[subprocess.Popen]:
    """``n`` ``isoaudit worker`` processes (``--run``: one run's steps only), returned once each
    says it compares (its first line of output)."""
    processes, outputs = [], []
    for i in range(n):
        out = logs / f"worker-{run or 'fleet'}-{i}.log"
        command = [sys.executable, "-m", "isoaudit.cli", "worker", "--database-url", url]
        command += ["--run", run] if run else []
        with out.open("wb") as sink:
            processes.append(subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT))
        outputs.append(out)
    deadline = time.monotonic() + 120
    for process, out in zip(processes, outputs, strict=True):
        while out.stat().st_size == 0:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_processes(processes)
                raise RuntimeError(f"isoaudit worker did not start: {out.read_text()[-2000:]}")
            time.sleep(0.1)
    return processes


# ---------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One simulated training job: a run, its trainer's and rollout's collectors, when each step
    was sent (wall clock, to compare with the database's timestamps)."""

    run_id: str
    trainer: HttpSink
    rollout: HttpSink
    seed: int
    sent_at: dict[int, float] = field(default_factory=dict)

    def send_step(self, step: int, args: argparse.Namespace) -> None:
        """Build step ``step`` (the arrays of ``bench/scale.py``'s synthetic step) and hand each
        side to its collector's sink, as a training loop does (never blocks)."""
        samples = step_records(step, args.samples, args.tokens, args.prompt_len, seed=self.seed)
        # The first ``clean`` samples agree bit for bit (a healthy job on invariant kernels), the
        # rest differ by ~1e-3 (step_records' trainer); fingerprints the same way.
        clean = {s.sample_key for s in samples[: 2 * round(args.clean_fraction * args.samples)]}
        rollouts = {s.sample_key: s for s in samples if s.side == "rollout"}
        for s in samples:
            if s.side == "trainer" and s.sample_key in clean:
                s.logprobs = rollouts[s.sample_key].logprobs.copy()
        records: list[Any] = list(samples)
        if args.fingerprint_every and step % args.fingerprint_every == 0:
            prints = step_fingerprints(samples, FINGERPRINTED, 1, seed=self.seed + step)
            trainer = {(p.sample_key, p.region): p for p in prints if p.side == "trainer"}
            for p in prints:
                if p.side == "rollout" and p.sample_key in clean:
                    p.digest, p.ladder = (
                        trainer[p.sample_key, p.region].digest,
                        trainer[p.sample_key, p.region].ladder,
                    )
            records += prints
        for record in records:
            record.run_id = self.run_id
        self.sent_at[step] = time.time()
        self.trainer.send([r for r in records if r.side == "trainer"])
        self.rollout.send([r for r in records if r.side == "rollout"])

    def sinks(self) -> tuple[HttpSink, HttpSink]:
        return self.trainer, self.rollout


def make_jobs(runs: list[str], ports: list[int], token: str, spool: Path) -> list[Job]:
    """A job per run; job i's trainer posts to replica i, its rollout to replica i + 1 (mod the
    replicas), each sink spooling under ``spool``."""
    jobs = []
    for i, run in enumerate(runs):

        def sink(side: str, port: int, run: str = run) -> HttpSink:
            return HttpSink(f"http://127.0.0.1:{port}", token, spool_dir=spool / f"{run}-{side}", timeout=120)

        trainer, rollout = (
            sink("trainer", ports[i % len(ports)]),
            sink("rollout", ports[(i + 1) % len(ports)]),
        )
        jobs.append(Job(run, trainer, rollout, seed=1_000_003 * (i + 1)))
    return jobs


def run_jobs(
    jobs: list[Job], steps: int, args: argparse.Namespace, stop: threading.Event, errors: list[Exception]
) -> list[threading.Thread]:
    """Each job in a thread of its own, one step every ``args.interval`` s, the jobs staggered; what
    a job raises goes to ``errors`` and stops every job."""

    def loop(k: int, job: Job) -> None:
        start = time.monotonic() + k * args.interval / len(jobs)
        for step in range(steps):
            wait = start + step * args.interval - time.monotonic()
            if stop.wait(max(0.0, wait)):
                return
            try:
                job.send_step(step, args)
            except Exception as exc:  # the bench stops at once rather than waiting out the drain
                errors.append(exc)
                stop.set()
                return

    threads = [threading.Thread(target=loop, args=(k, job), daemon=True) for k, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    return threads


# ---------------------------------------------------------------------- reading the database


def stamp(moment: datetime) -> float:
    """A stored timestamp as seconds since the epoch (``time.time()``'s clock)."""
    return utc(moment).timestamp()


def compared_steps(store: Store, runs: list[str], samples: int) -> dict[tuple[str, int], dict[str, Any]]:
    """Every step of ``runs`` compared with all its ``samples``: when, and by which worker."""
    query = select(
        StepResultRow.run_id, StepResultRow.step, StepResultRow.computed_at, StepResultRow.compared_by
    ).where(StepResultRow.run_id.in_(runs), StepResultRow.n_samples >= samples)
    with store.sessions() as session:
        return {(r, s): {"at": stamp(at), "by": by} for r, s, at, by in session.execute(query)}


def stored_steps(store: Store, runs: list[str], samples: int) -> dict[tuple[str, int], float]:
    """Every step of ``runs`` whose ``2 x samples`` sample records are all stored: when the last was."""
    query = (
        select(SampleRow.run_id, SampleRow.step, func.max(SampleRow.created_at))
        .where(SampleRow.run_id.in_(runs))
        .group_by(SampleRow.run_id, SampleRow.step)
        .having(func.count() >= 2 * samples)
    )
    with store.sessions() as session:
        return {(r, s): stamp(at) for r, s, at in session.execute(query)}


def pending(store: Store, runs: list[str]) -> int:
    """Samples of ``runs`` queued for comparison."""
    query = (
        select(func.count()).select_from(PendingComparisonRow).where(PendingComparisonRow.run_id.in_(runs))
    )
    with store.sessions() as session:
        return int(session.scalar(query) or 0)


def deadlock_count(db: Database) -> int:
    """Deadlocks PostgreSQL has detected in this database so far (all its schemas: other clients of
    the same database count too). Each costs the losing transaction ``deadlock_timeout`` (1 s by
    default) before ingest retries it."""
    with db.admin.connect() as connection:
        return int(
            connection.exec_driver_sql(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            ).scalar()
            or 0
        )


def percentiles(values: list[float]) -> dict[str, float]:
    """How many, p50, p95 (nearest rank) and max."""
    if not values:
        return {"n": 0, "p50": float("nan"), "p95": float("nan"), "max": float("nan")}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))],
        "max": ordered[-1],
    }


# ---------------------------------------------------------------------- the fleet


def drive(
    store: Store,
    jobs: list[Job],
    steps: int,
    args: argparse.Namespace,
    progress: Progress,
    label: str,
    midway: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Send ``steps`` steps from every job, show progress, flush the sinks, wait for the comparisons
    (up to ``args.drain``); ``midway()`` runs in a thread halfway through the sending. Returns the
    times and what is stored and compared."""
    runs = [job.run_id for job in jobs]
    total = len(jobs) * steps
    sent_task = progress.add_task(f"{label}: steps sent", total=total)
    stored_task = progress.add_task(f"{label}: steps stored", total=total)
    compared_task = progress.add_task(f"{label}: steps compared", total=total)
    stop = threading.Event()
    started = time.time()
    errors: list[Exception] = []
    threads = run_jobs(jobs, steps, args, stop, errors)
    helper = None
    sending_s = steps * args.interval
    flushed_at = drained_at = None
    deadline = started + sending_s + args.drain
    stored: dict[tuple[str, int], float] = {}  # kept across polls: retention deletes compared steps
    sinks = [s for job in jobs for s in job.sinks()]
    try:
        while True:
            now = time.time()
            if helper is None and midway is not None and now - started >= sending_s / 2:
                helper = threading.Thread(target=midway, daemon=True)
                helper.start()
            stored.update(stored_steps(store, runs, args.samples))
            done = len(compared_steps(store, runs, args.samples))
            backlog = pending(store, runs)
            progress.update(sent_task, completed=sum(len(job.sent_at) for job in jobs))
            progress.update(stored_task, completed=len(stored))
            progress.update(
                compared_task,
                completed=done,
                description=f"{label}: steps compared, {backlog} samples queued",
            )
            sending = any(t.is_alive() for t in threads)
            if flushed_at is None and not sending and all(s.stats()["outstanding"] == 0 for s in sinks):
                flushed_at = time.time()
            if flushed_at is not None and done == total:
                drained_at = time.time()
                break
            if errors:
                raise RuntimeError(f"a job failed: {errors[0]!r}") from errors[0]
            if now > deadline:
                break
            time.sleep(0.5)
    finally:
        stop.set()
        for s in sinks:
            s.close(timeout=5)
    if helper is not None:
        helper.join()
    stored.update(stored_steps(store, runs, args.samples))
    progress.update(stored_task, completed=len(stored))
    dropped = sum(s.stats()["dropped"] for s in sinks)
    retried = sum(s.stats()["failed_attempts"] for s in sinks)
    return {
        "started": started,
        "flushed_at": flushed_at,
        "drained_at": drained_at,
        "stored": stored,
        "compared": compared_steps(store, runs, args.samples),
        "dropped": dropped,
        "retried": retried,
        "backlog": pending(store, runs),
    }


def lags(
    jobs: list[Job], stored: dict[tuple[str, int], float], compared: dict[tuple[str, int], dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """The lags sent -> stored, stored -> compared and sent -> compared of the steps that got there."""
    sent = {(job.run_id, step): at for job in jobs for step, at in job.sent_at.items()}
    return {
        "sent_stored": percentiles([stored[k] - sent[k] for k in sent if k in stored]),
        "stored_compared": percentiles([compared[k]["at"] - stored[k] for k in stored if k in compared]),
        "sent_compared": percentiles([compared[k]["at"] - sent[k] for k in sent if k in compared]),
    }


def fleet(
    db: Database,
    ports: list[int],
    token: str,
    store: Store,
    tmp: Path,
    args: argparse.Namespace,
    progress: Progress,
) -> dict[str, Any]:
    """The fleet run: ``args.jobs`` jobs, ``args.workers`` workers, retention mid-run and after."""
    store.set_retention_policy(PROJECT, raw_days=0, fingerprint_steps=args.fingerprint_steps)
    # Claimed (and applied, to an empty store) here, as a worker does, so the workers see it applied
    # and leave it for an hour: the bench applies it itself, midway and after the drain, to time it.
    store.apply_due_retention(every_s=0)
    workers = start_workers(db.url, args.workers, tmp)
    jobs = make_jobs([f"job-{i}" for i in range(args.jobs)], ports, token, tmp / "spool")
    stored_before_mid: dict[tuple[str, int], float] = {}
    midway: dict[str, Any] = {}

    def retention_midway() -> None:
        # What retention deletes is gone from the samples table: note when each step was stored first.
        stored_before_mid.update(stored_steps(store, [j.run_id for j in jobs], args.samples))
        midway["size"] = db.size()
        began = time.perf_counter()
        for attempt in range(1, 4):  # a delete under load may lose a race (a deadlock): it rolled back
            try:
                outcome = store.apply_retention(PROJECT)
                break
            except (StoreConflict, StoreUnavailable) as exc:
                if attempt == 3:
                    midway["error"] = repr(exc)
                    return
        midway.update(
            attempts=attempt,
            seconds=time.perf_counter() - began,
            samples_deleted=outcome.samples_deleted,
            fingerprints_deleted=outcome.fingerprints_deleted,
            arrays_before=outcome.bytes_before,
            arrays_after=outcome.bytes_after,
        )

    deadlocks = deadlock_count(db)
    try:
        result = drive(store, jobs, args.steps, args, progress, "fleet", retention_midway)
    finally:
        stop_processes(workers)
    deadlocks = deadlock_count(db) - deadlocks
    stored = {**stored_before_mid, **result["stored"]}
    compared = result["compared"]
    db.vacuum()
    size_before = db.size()
    # Every record of a kind has the same arrays here, so what the run stored in all (what it would
    # hold without retention) is the bytes per record now times the records now and deleted midway
    # (the midway outcome's bytes moved with the ingest that went on meanwhile).
    uses = store.disk_use(project=PROJECT)
    kept = [
        sum(getattr(u, name) for u in uses)
        for name in ("samples", "sample_bytes", "fingerprints", "fingerprint_bytes")
    ]
    arrays_total = kept[1] + kept[3]
    if kept[0]:
        arrays_total += kept[1] / kept[0] * midway.get("samples_deleted", 0)
    if kept[2]:
        arrays_total += kept[3] / kept[2] * midway.get("fingerprints_deleted", 0)
    began = time.perf_counter()
    outcome = store.apply_retention(PROJECT)
    retention_s = time.perf_counter() - began
    db.vacuum()
    size_after = db.size()

    offered_steps = args.jobs / args.interval
    n_steps = len(compared)
    sent_window = max(t for job in jobs for t in job.sent_at.values()) - result["started"]
    ingest_s = (result["flushed_at"] or time.time()) - result["started"]
    compare_s = (max(c["at"] for c in compared.values()) - result["started"]) if compared else float("nan")
    stored_samples = 2 * args.samples * len(stored)
    by_worker: dict[str, int] = {}
    for c in compared.values():
        by_worker[c["by"]] = by_worker.get(c["by"], 0) + 1
    return {
        "jobs": args.jobs,
        "workers": args.workers,
        "steps_sent": sum(len(job.sent_at) for job in jobs),
        "steps_compared": n_steps,
        "dropped": result["dropped"],
        "retried": result["retried"],
        "deadlocks": deadlocks,
        "sending_s": sent_window,
        "drained": result["drained_at"] is not None,
        "drain_s": (result["drained_at"] - result["started"] - sent_window) if result["drained_at"] else None,
        "offered_steps_per_s": offered_steps,
        "offered_tokens_per_s": offered_steps * args.samples * args.tokens * 2,
        "ingest_samples_per_s": stored_samples / ingest_s,
        "ingest_tokens_per_s": stored_samples * args.tokens / ingest_s,
        "compare_steps_per_s": n_steps / compare_s,
        "compare_tokens_per_s": n_steps * args.samples * args.tokens / compare_s,
        "steps_per_worker": sorted(by_worker.values(), reverse=True),
        "lag": lags(jobs, stored, compared),
        "retention_midway": midway,
        "size_before": size_before,
        "size_after": size_after,
        "arrays_total": arrays_total,
        "arrays_before": outcome.bytes_before,
        "arrays_after": outcome.bytes_after,
        "retention_s": retention_s,
        "samples_deleted": outcome.samples_deleted,
        "fingerprints_deleted": outcome.fingerprints_deleted,
    }


def sweep(
    db: Database,
    ports: list[int],
    token: str,
    store: Store,
    tmp: Path,
    args: argparse.Namespace,
    progress: Progress,
) -> list[dict[str, Any]]:
    """One job, one worker, one step per ``args.interval`` s, growing steps until the worker falls
    behind: its lag (stored -> compared) grows by more than :data:`BEHIND` x interval per step (a
    worker that needs c > interval seconds a step adds c - interval to each next step's lag). Stops
    at the first such size."""
    points = []
    for samples in args.sweep:
        point_args = argparse.Namespace(**{**vars(args), "samples": samples, "fingerprint_every": 0})
        run = f"sweep-{samples}"
        worker = start_workers(db.url, 1, tmp, run=run)
        jobs = make_jobs([run], ports, token, tmp / "spool")
        try:
            result = drive(
                store, jobs, args.sweep_steps, point_args, progress, f"sweep {samples} x {args.tokens}"
            )
        finally:
            stop_processes(worker)
        sent, stored, compared = jobs[0].sent_at, result["stored"], result["compared"]
        worker_growth = growth(
            [
                (step, compared[run, step]["at"] - stored[run, step])
                for step in sent
                if (run, step) in compared and (run, step) in stored
            ]
        )
        ingest_growth = growth(
            [(step, stored[run, step] - at) for step, at in sent.items() if (run, step) in stored]
        )
        keeps_up = len(compared) == args.sweep_steps and worker_growth <= BEHIND * args.interval
        seconds = args.interval + max(0.0, worker_growth)  # a step's compare time, when behind
        points.append(
            {
                "samples": samples,
                "tokens_per_step": samples * args.tokens,
                "offered_tokens_per_s": samples * args.tokens / args.interval,
                "steps_sent": args.sweep_steps,
                "steps_compared": len(compared),
                "lag": lags(jobs, stored, compared),
                "worker_lag_growth_s": worker_growth,
                "ingest_lag_growth_s": ingest_growth,
                "worker_tokens_per_s": None if keeps_up else samples * args.tokens / seconds,
                "keeps_up": keeps_up,
                "ingest_keeps_up": len(stored) == args.sweep_steps
                and ingest_growth <= BEHIND * args.interval,
            }
        )
        if not keeps_up:
            break
    return points


def growth(lags: list[tuple[int, float]]) -> float:
    """Seconds a lag grows by per step: the least-squares slope of (step, lag)."""
    if len(lags) < 2:
        return float("nan")
    steps, values = zip(*lags, strict=True)
    return float(np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0])


# ---------------------------------------------------------------------- report


def report(
    console: Console, f: dict[str, Any], points: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    console.print(
        f"[bold]fleet[/bold]: {f['jobs']} jobs x {args.steps} steps, one step per {args.interval:g} s each; "
        f"a step {args.samples} samples x {args.tokens} tokens ({args.prompt_len} prompt) x 2 sides, "
        f"fingerprints of {FINGERPRINTED} samples/side every {args.fingerprint_every} steps; "
        f"2 replicas, {f['workers']} workers, PostgreSQL"
    )
    t = Table("", "offered", "achieved", "achieved / offered")
    t.add_row(
        "ingest (samples/s, both sides)",
        f"{f['offered_steps_per_s'] * args.samples * 2:,.0f}",
        f"{f['ingest_samples_per_s']:,.0f}",
        f"x{f['ingest_samples_per_s'] / (f['offered_steps_per_s'] * args.samples * 2):.2f}",
    )
    t.add_row(
        "ingest (tokens/s, both sides)",
        f"{f['offered_tokens_per_s']:,.0f}",
        f"{f['ingest_tokens_per_s']:,.0f}",
        f"x{f['ingest_tokens_per_s'] / f['offered_tokens_per_s']:.2f}",
    )
    t.add_row(
        "compare (steps/s)",
        f"{f['offered_steps_per_s']:.2f}",
        f"{f['compare_steps_per_s']:.2f}",
        f"x{f['compare_steps_per_s'] / f['offered_steps_per_s']:.2f}",
    )
    t.add_row(
        "compare (tokens/s, pairs)",
        f"{f['offered_tokens_per_s'] / 2:,.0f}",
        f"{f['compare_tokens_per_s']:,.0f}",
        f"x{f['compare_tokens_per_s'] / (f['offered_tokens_per_s'] / 2):.2f}",
    )
    console.print(t)
    lag = Table("lag (s)", "steps", "p50", "p95", "max")
    for name, key in (
        ("sent -> stored", "sent_stored"),
        ("stored -> compared", "stored_compared"),
        ("sent -> compared", "sent_compared"),
    ):
        p = f["lag"][key]
        lag.add_row(name, str(p["n"]), f"{p['p50']:.2f}", f"{p['p95']:.2f}", f"{p['max']:.2f}")
    console.print(lag)
    drain = f"{f['drain_s']:.1f} s after the last send" if f["drained"] else "NOT drained"
    console.print(
        f"steps sent {f['steps_sent']}, compared {f['steps_compared']} ({drain}); records dropped by the "
        f"sinks {f['dropped']}, requests retried {f['retried']}; PostgreSQL deadlocks {f['deadlocks']}; steps per worker {f['steps_per_worker']}"
    )
    m = f["retention_midway"]
    if "error" in m:
        console.print(f"retention mid-run FAILED three times: {m['error']}")
    elif m:
        console.print(
            f"retention mid-run (under load): {m['seconds']:.2f} s, {m['samples_deleted']} samples and "
            f"{m['fingerprints_deleted']} fingerprints deleted, arrays {m['arrays_before'] / MIB:.1f} -> "
            f"{m['arrays_after'] / MIB:.1f} MiB while ingest went on (schema {m['size'] / MIB:.1f} MiB before it)"
        )
    console.print(
        f"retention after the drain: {f['retention_s']:.2f} s, {f['samples_deleted']} samples and "
        f"{f['fingerprints_deleted']} fingerprints deleted; arrays {f['arrays_before'] / MIB:.1f} -> "
        f"{f['arrays_after'] / MIB:.1f} MiB; schema on disk (VACUUM) {f['size_before'] / MIB:.1f} -> "
        f"{f['size_after'] / MIB:.1f} MiB (x{f['size_after'] / max(f['size_before'], 1):.2f})"
    )
    console.print(
        f"arrays stored over the run {f['arrays_total'] / MIB:.1f} MiB, kept {f['arrays_after'] / MIB:.1f} MiB "
        f"(x{f['arrays_after'] / max(f['arrays_total'], 1):.2f})"
    )
    s = Table(
        f"one worker, a step per {args.interval:g} s: samples x {args.tokens} tokens",
        "tokens/s offered", "compared", "sent->stored max (growth/step)", "stored->compared p50 / max",
        "growth/step", "keeps up",
    )  # fmt: skip
    for p in points:
        sc, ss = p["lag"]["stored_compared"], p["lag"]["sent_stored"]
        s.add_row(
            str(p["samples"]),
            f"{p['offered_tokens_per_s']:,.0f}",
            f"{p['steps_compared']}/{p['steps_sent']}",
            f"{ss['max']:.2f} ({p['ingest_lag_growth_s']:+.2f})"
            + ("" if p["ingest_keeps_up"] else " ingest behind"),
            f"{sc['p50']:.2f} / {sc['max']:.2f}",
            f"{p['worker_lag_growth_s']:+.2f} s",
            "yes" if p["keeps_up"] else "NO",
        )
    console.print(s)
    limit = next((p for p in points if not p["keeps_up"]), None)
    if limit is not None:
        console.print(
            f"one worker stops keeping up at {limit['samples']} x {args.tokens} tokens a step: "
            f"{args.interval + limit['worker_lag_growth_s']:.2f} s a step, {limit['worker_tokens_per_s']:,.0f} tokens/s "
            f"(x{limit['worker_tokens_per_s'] / limit['offered_tokens_per_s']:.2f} the offered rate)"
        )
    elif points:
        console.print(
            f"one worker kept up with every size swept (up to {points[-1]['samples']} x {args.tokens})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=8, help="concurrent jobs (runs)")
    parser.add_argument("--workers", type=int, default=3, help="isoaudit worker processes")
    parser.add_argument("--steps", type=int, default=30, help="steps per job")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between a job's steps")
    parser.add_argument("--samples", type=int, default=32, help="samples per step (per side)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sample, prompt included")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument(
        "--clean-fraction",
        type=float,
        default=0.75,
        help="share of each step's samples whose sides agree bit for bit",
    )
    parser.add_argument(
        "--fingerprint-every", type=int, default=8, help="fingerprint every Nth step (0: never)"
    )
    parser.add_argument(
        "--fingerprint-steps", type=int, default=4, help="retention: fingerprints kept in full for N steps"
    )
    parser.add_argument(
        "--drain", type=float, default=60.0, help="seconds to wait for the comparisons after sending"
    )
    parser.add_argument(
        "--sweep",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[128, 256, 512, 1024, 2048],
        help="samples per step, one worker",
    )
    parser.add_argument("--sweep-steps", type=int, default=10, help="steps per sweep point")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run (tests)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()
    if args.tiny:
        args.jobs, args.workers, args.steps, args.interval = 2, 2, 3, 0.5
        args.samples, args.tokens, args.prompt_len, args.fingerprint_every = 4, 96, 32, 2
        args.fingerprint_steps, args.drain, args.sweep, args.sweep_steps = 1, 60.0, [2, 4], 2
    console = Console(stderr=args.json)
    if not console.is_terminal:
        console.width = 140  # a log file: the tables on one line each
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        db = Database("postgres", tmp)
        store = Store(db.url)
        replicas: list[subprocess.Popen] = []
        try:
            token = create_token(store, PROJECT)
            sweep_token = create_token(store, SWEEP_PROJECT)
            ports = [free_port(), free_port()]
            replicas = [serve(db.url, port) for port in ports]
            with Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=False,
            ) as progress:  # fmt: skip
                figures = fleet(db, ports, token, store, tmp, args, progress)
                points = sweep(db, ports, sweep_token, store, tmp, args, progress)
        finally:
            stop_processes(replicas)
            store.dispose()
            db.close()
    report(console, figures, points, args)
    if args.json:
        print(json.dumps({"fleet": figures, "sweep": points, "at": datetime.now(UTC).isoformat()}))


if __name__ == "__main__":
    main()
