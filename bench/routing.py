"""The cost of MoE routing in the audit, each against a baseline measured in the same run:

1. **comparator**: ``compare_samples`` + ``step_summary`` (which makes the step's routing aggregate
   from the samples' comparisons) over one step of 256 samples x 1,024 tokens whose records carry
   routes (48 MoE layers, top-8 of 128: the Qwen3-30B-A3B shape), against the same step without
   routes; with ``--before REV``, also with ``audit/routing.py`` as it was at ``REV`` (read with
   ``git show``), so the comparison's before/after are measured in the same run on the same data.
2. **boundary check**: ``validate_record`` of a sample with routes against one without.
3. **size**: stored bytes per token of the routes against the sample's own arrays.
4. **trainer collector**: ``record_step`` of a tiny HF Qwen3-MoE with routing recorded
   (``isoaudit.collectors.routing.watch_routing``) against the same collector without it; and, every region
   fingerprinted with the kernels off, with the per-slot ``layers.i.experts`` tap against without.

    python -m bench.routing [--samples 256] [--tokens 1024] [--layers 48] [--before cb822db]

(as a module: run as a script, ``bench/`` would shadow the ``kernels`` package with bench/kernels.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from isoaudit.audit.compare import compare_samples, step_summary
from isoaudit.audit.records import Routes, SampleLogprobs, validate_record
from isoaudit.audit.routing import routes_columns


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _pairs(
    n_samples: int,
    n_tokens: int,
    layers: int,
    top_k: int,
    experts: int,
    routed: bool,
    agree: float | None = None,
):
    """One step's (trainer, rollout) pairs. ``agree``: the fraction of (token, layer) cells whose
    rollout routes are the trainer's (the rest shifted by one expert); ``None``: both sides drawn
    independently (almost no cell agrees: the comparison's worst case)."""
    rng = np.random.default_rng(0)
    prompt = n_tokens // 4
    pairs = []
    for i in range(n_samples):
        tokens = rng.integers(0, 150_000, n_tokens, dtype=np.int32)
        tokens[0] = i
        lp = -rng.exponential(1.0, n_tokens - prompt).astype(np.float32)
        sides = []
        first = np.zeros((n_tokens, layers, 1), dtype=np.int64)  # the trainer's starts
        for side, noise in (("trainer", 0.0), ("rollout", 1e-3)):
            routes = None
            if routed:
                # Distinct ids per (token, layer): a random start and a random stride coprime to E
                # would do; consecutive ids from a random start are enough for a cost measurement.
                start = rng.integers(0, experts, (n_tokens, layers, 1))
                if side == "rollout" and agree is not None:
                    start = (first + (rng.random((n_tokens, layers, 1)) >= agree)) % experts
                first = start
                chosen = (start + np.arange(top_k)) % experts
                if side == "rollout":
                    chosen = chosen[: n_tokens - 1]
                routes = Routes.model_construct(
                    layers=list(range(layers)),
                    top_k=top_k,
                    num_experts=experts,
                    positions=np.arange(chosen.shape[0], dtype=np.int32),
                    experts=chosen.reshape(chosen.shape[0], -1).astype(np.uint8),
                    replayed=None,
                )
            sides.append(
                SampleLogprobs.model_construct(
                    run_id="bench", step=0, side=side, sample_key=None, weight_version=None,
                    prompt_len=prompt, token_ids=tokens, logprobs=(lp - noise).astype(np.float32),
                    temperature=1.0, top_k=None, top_p=None, min_p=None, weight_spans=None, rank=None,
                    semantics="processed", routes=routes, topk_ids=None, topk_logprobs=None, path={},
                ).checked()
            )  # fmt: skip
        pairs.append(tuple(sides))
    return pairs


@contextlib.contextmanager
def routing_at(rev: str) -> Iterator[None]:
    """The comparator with ``audit/routing.py`` as it was at git revision ``rev``."""
    import isoaudit.audit.compare as compare

    source = subprocess.run(
        ["git", "show", f"{rev}:audit/routing.py"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    old = types.ModuleType(f"audit_routing_{rev}")
    sys.modules[old.__name__] = old  # dataclasses look their module up
    exec(compile(source, f"audit/routing.py@{rev}", "exec"), old.__dict__)
    names = [
        n
        for n in ("compare_sample_routes", "explain", "step_routing", "step_routing_metrics")
        if hasattr(compare, n)
    ]
    saved = {n: getattr(compare, n) for n in names}
    for n in names:
        setattr(compare, n, getattr(old, n))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(compare, n, fn)


def bench_comparator(n_samples: int, n_tokens: int, layers: int, before: str | None = None) -> None:
    print(f"building {n_samples} samples x {n_tokens} tokens, {layers} MoE layers, top-8 of 128 ...")
    plain = _pairs(n_samples, n_tokens, layers, 8, 128, routed=False)

    def run(pairs):
        results = compare_samples(pairs)
        summary = step_summary(pairs, results)
        return summary, [(c.metrics, c.diagnosis.kind, c.diagnosis.sentence) for c in results]

    # Interleaved, best of five each: this machine is shared, so the variants take turns.
    routed_sets = [
        (label, _pairs(n_samples, n_tokens, layers, 8, 128, routed=True, agree=agree))
        for label, agree in (("95% of cells agree", 0.95), ("independent routes (worst case)", None))
    ]
    times: dict[str, list[float]] = {}

    def timed(name: str, pairs) -> Any:
        start = time.perf_counter()
        out = run(pairs)
        times.setdefault(name, []).append(time.perf_counter() - start)
        return out

    same = {label: True for label, _ in routed_sets}
    for _ in range(5):
        timed("plain", plain)
        for label, routed in routed_sets:
            now = timed(label, routed)
            if before is not None:
                with routing_at(before):
                    then = timed(f"{label} before", routed)
                same[label] &= json.dumps(then, sort_keys=True, default=str) == json.dumps(
                    now, sort_keys=True, default=str
                )
    base = min(times["plain"])
    print(f"comparator, one step without routes: {base * 1e3:.0f} ms")
    for label, _ in routed_sets:
        with_routes = min(times[label])
        line = (
            f"  with routes, {label}: {with_routes * 1e3:.0f} ms (x{with_routes / base:.2f} the plain step)"
        )
        if before is not None:
            old = min(times[f"{label} before"])
            line += (
                f"; at {before}: {old * 1e3:.0f} ms (x{old / base:.2f}); {old / with_routes:.2f}x faster now, "
                f"same step and sample results: {same[label]}"
            )
        print(line)
    sample, bare = routed_sets[0][1][0][0], plain[0][0]
    n = 2000
    t_bare = _best(lambda: [validate_record(bare) for _ in range(n)]) / n
    t_routed = _best(lambda: [validate_record(sample) for _ in range(n)]) / n
    print(
        f"boundary check per record: {t_bare * 1e6:.1f} us without routes, {t_routed * 1e6:.1f} us with "
        f"(x{t_routed / t_bare:.2f})"
    )
    route_bytes = len(routes_columns(sample.routes)["routes_data"])
    own = sample.token_ids.nbytes + sample.logprobs.nbytes
    print(
        f"stored per token: routes {route_bytes / n_tokens:.0f} B ({layers} layers x 8 one-byte ids + position), "
        f"tokens+logprobs {own / n_tokens:.1f} B (x{route_bytes / own:.1f})"
    )


def bench_trainer(steps: int = 8) -> None:
    import isoaudit.collectors.trainer as trainer
    from isoaudit.collectors.layout import StepBatch
    from isoaudit.collectors.routing import watch_routing
    from isoaudit.collectors.sinks import MemorySink
    from isoaudit.collectors.tiny_models import make_tiny_model
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("qwen3_moe", Path(tempfile.mkdtemp()) / "m", hidden=128, seed=0, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    batch = StepBatch.padded(
        [rng.integers(5, 500, 32).tolist() for _ in range(8)],
        [rng.integers(5, 500, 96).tolist() for _ in range(8)],
    )

    def steps_of(routing: bool, regions: Any = None) -> float:
        sink = MemorySink()
        handle = trainer.attach(model, run="bench", sink=sink, regions=regions, async_transfer=False)
        if routing:
            assert watch_routing(handle) is not None
        with torch.no_grad():
            handle.record_step(0, batch)  # warm-up
            start = time.perf_counter()
            for step in range(1, steps + 1):
                handle.record_step(step, batch)
            elapsed = (time.perf_counter() - start) / steps
        handle.detach()
        return elapsed

    def turns(*variants: Any, n: int = 5) -> list[float]:
        """Best time of each variant, the variants taking turns (this machine is shared)."""
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(n):
            for i, (routing, regions) in enumerate(variants):
                times[i].append(steps_of(routing, regions))
        return [min(t) for t in times]

    base, routed = turns((False, None), (True, None))
    print(
        f"trainer record_step (tiny Qwen3-MoE, 8 x 128 tokens, own forward): {base * 1e3:.1f} ms without "
        f"routing, {routed * 1e3:.1f} ms with (x{routed / base:.2f})"
    )
    # Every region fingerprinted, kernels off: the per-slot experts tap runs HF's experts k more
    # times per MoE layer on fingerprinted forwards; against every region but layers.i.experts.
    from isoaudit.collectors.regions import resolve_regions

    every = resolve_regions(model).names
    others = [name for name in every if not name.endswith(".experts")]
    without, with_slots = turns((False, others), (False, every))
    print(
        f"trainer record_step fingerprinting every region (kernels off): {without * 1e3:.1f} ms without "
        f"layers.i.experts, {with_slots * 1e3:.1f} ms with (x{with_slots / without:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--before", help="a git revision: also time the comparison as it was there")
    parser.add_argument("--no-trainer", action="store_true", help="skip the trainer collector's figure")
    args = parser.parse_args()
    bench_comparator(args.samples, args.tokens, args.layers, args.before)
    if not args.no_trainer:
        bench_trainer()


if __name__ == "__main__":
    main()
