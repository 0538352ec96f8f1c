"""What a session's own comparer costs the job: README's loop (a tiny Qwen3 against isoaudit's reference
engine, both sides recorded, the trainer fingerprinting every 10th step) written to a fresh SQLite
file, with ``compare="none"`` (nothing compares), ``"thread"`` and ``"process"`` (the default).

Interleaved in rounds so drift and the machine's other load hit every mode alike. Reported per mode:
the loop's median step time (generate + record on both sides), the session's close (flush, then the
drain: waiting until the run's steps are compared), steps left uncompared at close, and when the
first step was compared (the comparer's start-up, seen from the job).

    python bench/session_compare.py                 # 20 steps, 3 rounds
    python bench/session_compare.py --steps 50 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model
from isoaudit.kernels.adapters import HFCausalLM
from isoaudit.kernels.engine import RolloutEngine

import isoaudit
from isoaudit import StepBatch

MODES = ("none", "thread", "process")


def run(mode: str, model_dir: Path, directory: Path, steps: int) -> dict[str, Any]:
    """README's loop for ``steps`` steps into ``directory/isoaudit.db``; the figures of one run."""
    policy, _ = load_tiny_model(model_dir)
    engine = RolloutEngine(HFCausalLM(policy), max_len=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 9, 3)]
    url = f"sqlite:///{directory / 'isoaudit.db'}"
    reader = Store(url)
    step_s: list[float] = []
    first_compared: float | None = None
    started = time.perf_counter()
    audit = isoaudit.session(f"bench-{mode}", database_url=url, compare=mode, report=False)  # type: ignore[arg-type]
    with audit:
        trainer = audit.watch_trainer(policy, sample_every=10)
        rollout = audit.watch_engine(engine)
        for step in range(steps):
            t0 = time.perf_counter()
            completions = engine.generate(prompts, [4, 6, 2], seed=step)
            rollout.record_step(step, completions)
            trainer.record_step(step, StepBatch.padded(prompts, [c.tokens for c in completions]))
            audit.weights_changed(step + 1)
            step_s.append(time.perf_counter() - t0)
            if first_compared is None and reader.compared_steps(f"bench-{mode}") > 0:
                first_compared = time.perf_counter() - started
        t_close = time.perf_counter()
    summary = audit.close()
    close_s = time.perf_counter() - t_close
    left = reader.backlog(f"bench-{mode}").steps
    reader.dispose()
    return {
        "mode": mode,
        "step_ms_median": 1000 * statistics.median(step_s),
        "close_s": close_s,
        "left_at_close": left,
        "first_compared_s": first_compared,
        "compared": summary.comparison.compared if summary.comparison is not None else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model("qwen3", root / "model", num_layers=2, hidden=64, vocab=512, seed=3)
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                directory = root / f"{mode}-{r}"
                directory.mkdir()
                results[mode].append(run(mode, model_dir, directory, args.steps))
    base = statistics.median(x["step_ms_median"] for x in results["none"])
    print(f"{args.steps} steps x {args.rounds} rounds (medians over rounds)")
    print(f"{'mode':8} {'step ms':>8} {'vs none':>8} {'close s':>8} {'left':>5} {'1st compared s':>15}")
    for mode in MODES:
        rows = results[mode]
        step = statistics.median(x["step_ms_median"] for x in rows)
        close = statistics.median(x["close_s"] for x in rows)
        left = max(x["left_at_close"] for x in rows)
        firsts = [x["first_compared_s"] for x in rows if x["first_compared_s"] is not None]
        first = f"{statistics.median(firsts):.2f}" if firsts else "—"
        print(f"{mode:8} {step:8.1f} {step / base - 1:+8.1%} {close:8.2f} {left:5d} {first:>15}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
