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
import statistics
import tempfile
import time
from pathlib import Path

from isoaudit.audit import worker as worker_module
from isoaudit.audit.db import Store
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors.environment import process_environment

from tests.audit import environment_records as records
from tests.audit.environment_records import drifting_run


def _batch(store: Store, run_id: str, first: int, *, hook: bool) -> float:
    """Store 8 new non-clean steps from ``first`` on and time the worker's pass over them."""
    original = worker_module.note_changes_since_clean
    if not hook:
        worker_module.note_changes_since_clean = lambda *a, **k: 0  # type: ignore[assignment]
    try:
        for step in range(first, first + 8):
            records._step(store, run_id, step, differ=True)
        began = time.perf_counter()
        ComparisonWorker(store, max_pairs=24).run_once()
        return time.perf_counter() - began
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
        on, off = [], []
        for b in range(args.batches):  # interleaved, so warm-up and growth fall on both alike
            off.append(_batch(store, "bench", args.steps + 16 * b, hook=False))
            on.append(_batch(store, "bench", args.steps + 16 * b + 8, hook=True))
        store.dispose()
    a, b = statistics.median(on), statistics.median(off)
    print(
        f"worker, a batch of 8 non-clean steps after {args.steps} stored (median of {args.batches}): "
        f"{a * 1e3:.1f} ms with the changes named, {b * 1e3:.1f} ms without (x{a / b:.2f})"
    )


if __name__ == "__main__":
    main()
