"""What naming the changes since the last clean step costs the comparison worker, and what reading the
environment costs a collector at each manifest build.

A SQLite store holds ``--steps`` compared non-clean steps of one run after one clean step (the worst
case: every new batch looks back over the whole stored window) and a rollout manifest change; then
``--batches`` batches of 8 new non-clean steps are compared by the worker with the step's changes
named, against the same worker with that hook switched off, on the same records in the same run.

    python -m bench.environment [--steps 1024] [--batches 10]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from isoaudit.audit import worker as worker_module
from isoaudit.audit.db import Store
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors.environment import process_environment

from tests.audit.environment_records import drifting_run


def _timed_batches(store: Store, run_id: str, start: int, batches: int, *, hook: bool) -> float:
    from tests.audit import environment_records as records

    original = worker_module.note_changes_since_clean
    if not hook:
        worker_module.note_changes_since_clean = lambda *a, **k: 0  # type: ignore[assignment]
    try:
        worker = ComparisonWorker(store, max_pairs=24)
        total = 0.0
        for b in range(batches):
            for step in range(start + 8 * b, start + 8 * (b + 1)):
                records._step(store, run_id, step, differ=True)
            began = time.perf_counter()
            worker.run_once()
            total += time.perf_counter() - began
        return total
    finally:
        worker_module.note_changes_since_clean = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args()
    n = 2000
    began = time.perf_counter()
    for _ in range(n):
        process_environment()
    print(f"process_environment(): {(time.perf_counter() - began) / n * 1e6:.0f} µs per manifest build")
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{Path(tmp) / 'bench.db'}")
        drifting_run(store, run_id="bench", change_at=1, steps=args.steps)
        ComparisonWorker(store, max_pairs=4096).run_once()
        start = args.steps
        off = _timed_batches(store, "bench", start, args.batches, hook=False)
        on = _timed_batches(store, "bench", start + 8 * args.batches, args.batches, hook=True)
        store.dispose()
    print(
        f"worker, {args.batches} batches of 8 non-clean steps after {args.steps} stored: "
        f"{on:.3f} s with the changes named, {off:.3f} s without (x{on / off:.2f})"
    )


if __name__ == "__main__":
    main()
