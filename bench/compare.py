"""Compare one RL step as the comparison worker does, against reading the step back, on SQLite and
PostgreSQL, in the same run: the step is stored (both sides, and fingerprints of a 4-layer model for
``--fingerprinted`` samples), then each repeat times, on a fresh copy of the step, reading it back
(the baseline: ``Store.samples_of_steps`` and ``Store.fingerprints_of_steps``, both sides' records,
exactly what the worker reads) and ``ComparisonWorker.run_once`` (the worker's whole pass: claim,
read, compare, save), with the worker's database calls timed inside it. Targets: at most 3x the
read-back, at most 3 s a step; printed on the least and the median of the repeats.

``--in-process`` times instead the worker's three calls (``compare_samples``, the step's
``step_summary``, the dashboard's ``position_bins``) on records in memory, against the same calls of
``--baseline-rev``'s ``audit/compare.py`` and ``audit/summaries.py`` and a per-token Python loop.

    python -m bench.compare --samples 512 --tokens 8192 --prompt-len 1024 [--databases sqlite,postgres]
    python -m bench.compare --in-process [--samples 1024] [--tokens 2048] [--fingerprinted 32] [--baseline-rev cb822db]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from isoaudit.audit import compare as compare_module
from isoaudit.audit import summaries as summaries_module
from isoaudit.audit.db import Store
from isoaudit.audit.records import RegionFingerprints, Run, SampleLogprobs
from isoaudit.audit.regions import canonical_regions
from isoaudit.audit.worker import ComparisonWorker
from tqdm import tqdm

from bench.scale import Database

RUN = "bench"


def make_step(n_samples: int, n_tokens: int, prompt_len: int = 256, differing: float = 0.3):
    """Both sides of a step: random tokens, the trainer's logprobs, the rollout's off by ~1e-2 on a
    ``differing`` share of the tokens (the others bitwise equal)."""
    rng = np.random.default_rng(0)
    pairs = []
    for i in tqdm(range(n_samples), desc="building samples", leave=False):
        tokens = rng.integers(0, 150_000, n_tokens, dtype=np.int32)
        tokens[0] = i
        lp = -rng.exponential(1.0, n_tokens - prompt_len).astype(np.float32)
        noisy = np.minimum(
            lp + (rng.random(lp.size) < differing) * rng.normal(0, 1e-2, lp.size).astype(np.float32), 0
        )
        common = dict(run_id=RUN, step=0, prompt_len=prompt_len, token_ids=tokens)
        pairs.append(
            (
                SampleLogprobs(side="trainer", logprobs=lp, **common),
                SampleLogprobs(side="rollout", logprobs=noisy, **common),
            )
        )
    return pairs


def make_fingerprints(pairs, n_fingerprinted: int, num_layers: int = 4):
    rng = np.random.default_rng(1)
    regions = canonical_regions(num_layers)
    out = {}
    for trainer, _ in tqdm(pairs[:n_fingerprinted], desc="building fingerprints", leave=False):
        n = trainer.token_ids.size
        sides: tuple[list, list] = ([], [])
        diverge_from = int(rng.integers(0, n))
        for r, region in enumerate(regions):
            digest = rng.integers(0, 2**63, n, dtype=np.uint64)
            ladder = rng.integers(0, 2**63, (n, 4), dtype=np.uint64)
            sketch = rng.standard_normal((n, 16)).astype(np.float32)
            l2 = rng.random(n).astype(np.float32) + 1
            for side, s in (("trainer", 0), ("rollout", 1)):
                d, lad, sk = digest.copy(), ladder.copy(), sketch.copy()
                if s and r >= len(regions) // 2:
                    d[diverge_from:] += np.uint64(1)
                    lad[diverge_from:, 0] += np.uint64(1)
                    sk[diverge_from:] += 1e-3
                sides[s].append(
                    RegionFingerprints.model_construct(
                        run_id=RUN,
                        step=0,
                        side=side,
                        case="trainer_fwd" if not s else "engine_prefill",
                        sample_key=trainer.sample_key,
                        region=region,
                        forward_index=0,
                        positions=np.arange(n, dtype=np.int32),
                        digest=d,
                        ladder_bits=[6, 4, 2, 0],
                        ladder=lad,
                        sketch=sk,
                        l2=l2,
                        maxabs=l2,
                    )
                )
        out[trainer.sample_key] = sides
    return out


def python_loop(pairs, fingerprints, clip_eps: float = 0.2) -> float:
    """The natural baseline: the same work in per-token and per-cell Python — every token metric of
    the step (probabilities, KL k1/k3, chi², importance weights, clip fraction, Pearson sums, bitwise
    matches) and, for fingerprinted samples, each cell's verdict with its ladder rung and sketch size."""
    start = time.perf_counter()
    acc = dict.fromkeys(
        ("k1", "k3", "abs", "pd", "pd2", "chi2", "rho", "rho2", "clip", "pt", "pr", "pt2", "pr2", "ptr"), 0.0
    )
    mismatches = count = 0
    for trainer, rollout in pairs:
        first = -1
        for i, (a, b) in enumerate(zip(trainer.logprobs.tolist(), rollout.logprobs.tolist(), strict=True)):
            d = a - b
            pt, pr = math.exp(a), math.exp(b)
            rho = math.exp(max(-20.0, min(20.0, d)))
            acc["k1"] += -d
            acc["k3"] += math.exp(d) - d - 1
            acc["abs"] += abs(d)
            acc["pd"] += abs(pt - pr)
            acc["pd2"] += (pt - pr) ** 2
            acc["chi2"] += rho * rho - 1
            acc["rho"] += rho
            acc["rho2"] += rho * rho
            acc["clip"] += abs(rho - 1) > clip_eps
            acc["pt"] += pt
            acc["pr"] += pr
            acc["pt2"] += pt * pt
            acc["pr2"] += pr * pr
            acc["ptr"] += pt * pr
            if a != b:
                mismatches += 1
                first = i if first < 0 else first
            count += 1
    for trainer_prints, rollout_prints in fingerprints.values():
        for ta, ro in zip(trainer_prints, rollout_prints, strict=True):
            rows = {p: i for i, p in enumerate(ro.positions.tolist())}
            for i, (p, digest) in enumerate(zip(ta.positions.tolist(), ta.digest.tolist(), strict=True)):
                j = rows.get(p)
                if j is None or int(ro.digest[j]) == digest:
                    continue
                rung = next((k for k in range(4) if int(ta.ladder[i, k]) == int(ro.ladder[j, k])), -1)
                diff = math.sqrt(
                    sum(
                        (x - y) ** 2
                        for x, y in zip(ta.sketch[i].tolist(), ro.sketch[j].tolist(), strict=True)
                    )
                )
                _ = (rung, diff / max(float(ta.l2[i]), float(ro.l2[j])))
    return time.perf_counter() - start


ROOT = Path(__file__).resolve().parents[1]


def modules_at(rev: str, directory: Path) -> tuple[ModuleType, ModuleType]:
    """``audit/compare.py`` and ``audit/summaries.py`` as they were at ``rev``, loaded beside this
    checkout's (the rest of ``audit`` is this checkout's)."""
    loaded = []
    for name in ("compare", "summaries"):
        source = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:audit/{name}.py"], check=True, capture_output=True
        ).stdout
        path = directory / f"{name}_{rev}.py"
        path.write_bytes(source)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}_{rev}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        loaded.append(module)
    return loaded[0], loaded[1]


def worker_step(compare: ModuleType, summaries: ModuleType, pairs, prints) -> tuple[float, list, dict]:
    """Seconds for what the worker computes of one step: the comparisons, the step's figures (over
    its pairs by key, as the worker holds them) and the dashboard's position bins."""
    start = time.perf_counter()
    comparisons = compare.compare_samples(pairs, prints)
    by_key = sorted(pairs, key=lambda pair: pair[0].sample_key)
    summary = compare.step_summary(by_key, comparisons)
    summaries.position_bins(by_key)
    return time.perf_counter() - start, comparisons, summary


def stored_step(store: Store, run_id: str, pairs, prints) -> None:
    """Store the step under ``run_id`` (the same records, re-labelled): a fresh step for the worker."""
    store.ingest([Run(run_id=run_id, name=run_id)])
    for start in range(0, len(pairs), 64):
        store.ingest(
            [s.model_copy(update={"run_id": run_id}) for pair in pairs[start : start + 64] for s in pair]
        )
    for trainer_prints, rollout_prints in prints.values():
        store.ingest([p.model_copy(update={"run_id": run_id}) for p in [*trainer_prints, *rollout_prints]])


#: The worker's database calls, timed inside its pass: what it does beside the arithmetic (the save
#: includes the dashboard's summary, computed inside its transaction; the fingerprint read runs on a
#: thread while the samples' tokens are measured, so the calls' sum can exceed their share of the pass).
DATABASE_CALLS = ("claim_steps", "samples_and_arrivals", "fingerprints_of_steps", "save_outcomes")


class Timed:
    """Seconds spent in some methods of one object (wrapped on the instance), summed since ``reset``."""

    def __init__(self, target: object, names: tuple[str, ...]) -> None:
        self.seconds = dict.fromkeys(names, 0.0)
        for name in names:
            setattr(target, name, self._timed(name, getattr(target, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def read_back(store: Store, run_id: str) -> tuple[float, float]:
    """Seconds to read the step back as the comparison needs it: every stored sample of the step (both
    sides' token ids and logprobs) and every fingerprint record of it (both sides), one query each,
    the records the worker reads."""
    started = time.perf_counter()
    samples = store.samples_of_steps([(run_id, 0)])
    middle = time.perf_counter()
    store.fingerprints_of_steps([(run_id, 0)])
    done = time.perf_counter()
    assert samples[(run_id, 0)], f"run {run_id}: nothing read back"
    return middle - started, done - middle


def against_read_back(kind: str, pairs, prints, repeat: int, processes: int = 1) -> dict[str, list[float]]:
    """Per repeat, on a fresh copy of the step on one database: the read-back's seconds (samples,
    fingerprints), the worker's whole pass and its database calls (:data:`DATABASE_CALLS`)."""
    names = ("samples", "fingerprints", "worker", "database", "read cpu", "worker cpu")
    out: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        db = Database(kind, Path(tmp))
        store = Store(db.url)
        try:
            worker = ComparisonWorker(store, max_pairs=max(1024, len(pairs)), processes=processes)
            calls = Timed(store, DATABASE_CALLS)
            stored_step(store, f"{RUN}-warm-up", pairs[:2], {})  # first-call costs are not per step
            worker.run_once(f"{RUN}-warm-up")
            worker.block_pool()  # its processes started, as a serving worker's are after its first big step
            gc.freeze()  # start-up's objects out of the collector's passes, as `isoaudit worker` does
            for i in range(repeat):
                run_id = f"{RUN}-{i}"
                stored_step(store, run_id, pairs, prints)
                db.vacuum()
                cpu = time.process_time()
                samples, fingerprints = read_back(store, run_id)
                out["read cpu"].append(time.process_time() - cpu)
                out["samples"].append(samples)
                out["fingerprints"].append(fingerprints)
                calls.reset()
                started, cpu = time.perf_counter(), time.process_time()
                assert worker.run_once(run_id) == len(pairs)
                out["worker"].append(time.perf_counter() - started)
                out["worker cpu"].append(time.process_time() - cpu)
                out["database"].append(sum(calls.seconds.values()))
        finally:
            worker.close_pool()
            store.dispose()
            db.close()
    return out


def report(kind: str, times: dict[str, list[float]]) -> None:
    """Both targets as ratios of the same run's read-back, on the least and the median of the repeats
    (the least is the least disturbed by other jobs on the machine)."""
    reads = [s + f for s, f in zip(times["samples"], times["fingerprints"], strict=True)]
    for how, pick in (("least", min), ("median", statistics.median)):
        read, worker, database = pick(reads), pick(times["worker"]), pick(times["database"])
        print(
            f"{kind:10s} {how:6s}  read back {read:5.2f} s (samples {pick(times['samples']):.2f}, "
            f"fingerprints {pick(times['fingerprints']):.2f})   worker {worker:5.2f} s   "
            f"x{worker / read:.2f} the read-back   (its database calls {database:.2f} s, x{database / read:.2f}; "
            f"the rest {worker - database:.2f} s)"
        )
        print(
            f"{kind:10s} {how:6s}  targets: <= 3x the read-back {'met' if worker <= 3 * read else 'MISSED'}, "
            f"<= 3 s a step {'met' if worker <= 3 else 'MISSED'}"
        )
    read_cpu, worker_cpu = min(times["read cpu"]), min(times["worker cpu"])
    print(
        f"{kind:10s} least   CPU seconds of this process (with SQLite's work, without the PostgreSQL "
        f"server's; other jobs on the machine count less here): read back {read_cpu:.2f}, "
        f"worker {worker_cpu:.2f}, x{worker_cpu / read_cpu:.2f}"
    )
    print(
        f"{kind:10s} each repeat: reads {', '.join(f'{t:.2f}' for t in reads)}; "
        f"worker {', '.join(f'{t:.2f}' for t in times['worker'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--fingerprinted", type=int, default=32)
    parser.add_argument(
        "--differing",
        type=float,
        default=0.3,
        help="share of tokens whose sides differ (1: every token, native-like)",
    )
    parser.add_argument(
        "--baseline-rev", default="cb822db", help="comparator revision to time against ('' to skip)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="timings of each (median; baseline and ours alternate)"
    )
    parser.add_argument("--no-loop", action="store_true", help="skip the per-token Python loop")
    parser.add_argument("--in-process", action="store_true", help="the worker's calls in memory, no database")
    parser.add_argument("--databases", default="sqlite,postgres", help="with the database: which ones")
    parser.add_argument(
        "--processes",
        default="1",
        help="the worker's block-pool processes (audit.metrics.block_pool), comma-separated to time each",
    )
    args = parser.parse_args()

    pairs = make_step(args.samples, args.tokens, args.prompt_len, args.differing)
    prints = make_fingerprints(pairs, args.fingerprinted)
    n_tokens = sum(t.logprobs.size for t, _ in pairs)
    print(
        f"one step: {len(pairs)} samples, {n_tokens / 1e6:.2f} M completion tokens, {len(prints)} fingerprinted"
    )
    if not args.in_process:
        for kind in args.databases.split(","):
            for processes in [int(p) for p in args.processes.split(",")]:
                label = f"{kind}/p{processes}" if "," in args.processes else kind
                report(label, against_read_back(kind, pairs, prints, args.repeat, processes))
        return
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"ours": (compare_module, summaries_module)}
        if args.baseline_rev:
            sides[args.baseline_rev] = modules_at(args.baseline_rev, Path(tmp))
        times: dict[str, list[float]] = {name: [] for name in sides}
        for compare, _ in sides.values():
            compare.compare_samples(
                pairs[:2], {}
            )  # warm-up: first-call costs (imports, pandas) are not per step
        for _ in range(args.repeat):
            for name, (compare, summaries) in reversed(sides.items()):
                seconds, comparisons, summary = worker_step(compare, summaries, pairs, prints)
                times[name].append(seconds)
    ours = statistics.median(times["ours"])
    firsts = sum(c.first_divergence is not None for c in comparisons)
    print(
        f"isoaudit.audit.compare     {ours:6.2f} s   ({n_tokens / ours / 1e6:6.2f} M tokens/s; {firsts} first divergences found)"
    )
    if args.baseline_rev:
        base = statistics.median(times[args.baseline_rev])
        print(
            f"{args.baseline_rev:17s} {base:6.2f} s   (ours x{ours / base:.2f} its time; "
            f"each the median of {args.repeat}: ours {', '.join(f'{t:.2f}' for t in times['ours'])}, "
            f"{args.baseline_rev} {', '.join(f'{t:.2f}' for t in times[args.baseline_rev])})"
        )
    if not args.no_loop:
        baseline = python_loop(pairs, prints)
        print(f"per-token loop    {baseline:6.2f} s   ({n_tokens / baseline / 1e6:6.2f} M tokens/s)")
        print(
            f"speed-up          {baseline / ours:6.1f}x   kl_k3 of the step {summary['metrics']['kl_k3']:.3g}"
        )
    print(f"target (< 2 s for the step): {'met' if ours < 2 else 'MISSED'}")


if __name__ == "__main__":
    main()
