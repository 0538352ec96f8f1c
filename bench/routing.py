"""The cost of MoE routing in the audit (issue 19), each against a baseline measured in the same run:

1. **comparator**: ``compare_samples`` + ``step_summary`` + the step's routing aggregate over one
   step of 256 samples x 1,024 tokens whose records carry routes (48 MoE layers, top-8 of 128: the
   Qwen3-30B-A3B shape), against the same step without routes.
2. **boundary check**: ``validate_record`` of a sample with routes against one without.
3. **size**: stored bytes per token of the routes against the sample's own arrays.
4. **trainer collector**: ``record_step`` of a tiny HF Qwen3-MoE with routing recorded
   (``collectors.routing.watch_routing``) against the same collector without it.

    python -m bench.routing [--samples 256] [--tokens 1024] [--layers 48]

(as a module: run as a script, ``bench/`` would shadow the ``kernels`` package with bench/kernels.py)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from audit.compare import compare_samples, step_summary
from audit.records import Routes, SampleLogprobs, validate_record
from audit.routing import routes_columns, step_routing


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _pairs(n_samples: int, n_tokens: int, layers: int, top_k: int, experts: int, routed: bool):
    rng = np.random.default_rng(0)
    prompt = n_tokens // 4
    pairs = []
    for i in range(n_samples):
        tokens = rng.integers(0, 150_000, n_tokens, dtype=np.int32)
        tokens[0] = i
        lp = -rng.exponential(1.0, n_tokens - prompt).astype(np.float32)
        sides = []
        for side, noise in (("trainer", 0.0), ("rollout", 1e-3)):
            routes = None
            if routed:
                # Distinct ids per (token, layer): a random start and a random stride coprime to E
                # would do; consecutive ids from a random start are enough for a cost measurement.
                start = rng.integers(0, experts, (n_tokens, layers, 1))
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


def bench_comparator(n_samples: int, n_tokens: int, layers: int) -> None:
    print(f"building {n_samples} samples x {n_tokens} tokens, {layers} MoE layers, top-8 of 128 ...")
    plain = _pairs(n_samples, n_tokens, layers, 8, 128, routed=False)
    routed = _pairs(n_samples, n_tokens, layers, 8, 128, routed=True)

    def run(pairs):
        results = compare_samples(pairs)
        step_summary(pairs, results)
        step_routing(pairs)

    base, with_routes = _best(lambda: run(plain)), _best(lambda: run(routed))
    print(
        f"comparator, one step: {base * 1e3:.0f} ms without routes, {with_routes * 1e3:.0f} ms with "
        f"(x{with_routes / base:.2f})"
    )
    sample, bare = routed[0][0], plain[0][0]
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
    from transformers import AutoModelForCausalLM

    import collectors.trainer as trainer
    from collectors.layout import StepBatch
    from collectors.routing import watch_routing
    from collectors.sinks import MemorySink
    from collectors.tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_moe", Path(tempfile.mkdtemp()) / "m", hidden=128, seed=0, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    batch = StepBatch.padded(
        [rng.integers(5, 500, 32).tolist() for _ in range(8)],
        [rng.integers(5, 500, 96).tolist() for _ in range(8)],
    )

    def steps_of(routing: bool) -> float:
        sink = MemorySink()
        handle = trainer.attach(model, run="bench", sink=sink, regions=None, async_transfer=False)
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

    base, routed = min(steps_of(False) for _ in range(2)), min(steps_of(True) for _ in range(2))
    print(
        f"trainer record_step (tiny Qwen3-MoE, 8 x 128 tokens, own forward): {base * 1e3:.1f} ms without "
        f"routing, {routed * 1e3:.1f} ms with (x{routed / base:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=48)
    args = parser.parse_args()
    bench_comparator(args.samples, args.tokens, args.layers)
    bench_trainer()


if __name__ == "__main__":
    main()
