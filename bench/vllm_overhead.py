"""Generation throughput of a real vLLM engine with the rollout collector, against none, in one run.

Three configurations on the same in-process engine, interleaved over several rounds (so drift in
machine load hits them alike). Each configuration's figure is its best round (as ``timeit`` does:
other processes on a shared machine only ever slow a round down, so the fastest is the closest to
the configuration's own cost); the medians are printed beside it:

* ``none``: no collector attached (the requests still ask for ``logprobs=0``: an RL job always does);
* ``logprobs``: the collector records every sample's logprobs, no fingerprints (``fingerprint=None``);
* ``fp1in8``: the same plus per-region fingerprints of one request in 8 (``fingerprint=8``).

``record_step`` runs inside the timed region: the collector's whole cost is measured. The engine
runs vLLM's default compilation (``--eager``: ``enforce_eager=True``); there, the first attach with
fingerprints compiles the graph taps into the decoder at its next step, and the worker keeps that
variant across detach and attach. So every configuration is first attached once and warmed
(untimed: the recompile, whose seconds are printed); each timed round then attaches, runs one
small untimed step, and times the next one, and the bench checks that no recompile happened in
the timed rounds. Targets: logprobs-only at most 3% slower, one-in-8 fingerprints at most 10%.

    python bench/vllm_overhead.py [--rounds 11] [--prompts 32] [--max-tokens 128] [--eager] [--profile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TARGETS = {"logprobs": 0.03, "fp1in8": 0.10}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--prompts", type=int, default=32)
    # 128 tokens a request: a round of 64 lasts about 0.4 s on a quiet 2-core machine, where the
    # rounds of one configuration spread by ±25% and each generate's fixed costs weigh twice
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--eager", action="store_true", help="enforce_eager=True instead of vLLM's compilation"
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="write cProfile stats of each configuration's timed rounds here (<name>.prof)",
    )
    args = parser.parse_args()

    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        print("vllm is not installed: skipped (pip install 'isoaudit[vllm]')")
        return 0
    import isoaudit.collectors.vllm as cv
    import numpy as np
    from isoaudit.collectors.sinks import MemorySink
    from isoaudit.collectors.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(
            "qwen3",
            Path(tmp) / "model",
            num_layers=args.layers,
            hidden=args.hidden,
            heads=args.hidden // 32,
            kv_heads=max(1, args.hidden // 64),
            vocab=1024,
            seed=0,
            dtype="bfloat16",
        )
        llm = LLM(
            model=str(path),
            dtype="bfloat16",
            max_model_len=512,
            enforce_eager=args.eager,
            seed=0,
            kv_cache_memory_bytes=128 << 20,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
        )
        rng = np.random.default_rng(0)
        prompts = [
            {"prompt_token_ids": rng.integers(3, 1000, int(rng.integers(16, 96))).tolist()}
            for _ in range(args.prompts)
        ]
        params = SamplingParams(
            temperature=0.7, max_tokens=args.max_tokens, min_tokens=args.max_tokens, logprobs=0, seed=1
        )
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        warm = SamplingParams(temperature=0.7, max_tokens=2, logprobs=0, seed=1)
        recompiles: list[float] = []
        compiles = {"count": 0}
        taps: dict[str, Any] = {}

        profiles: dict[str, cProfile.Profile] = {}

        def timed(
            fingerprint: object | None, attach: bool, step: int, name: str | None = None
        ) -> tuple[float, float]:
            handle = (
                cv.attach(
                    llm, run="bench", sink=MemorySink(keep=False, validate=False), fingerprint=fingerprint
                )
                if attach
                else None
            )
            # untimed: the step that compiles this configuration's decoder (nothing to compile: no cost)
            warm_outputs = llm.generate(prompts[:2], warm, use_tqdm=False)
            if handle is not None:
                handle.record_step(2 * step, warm_outputs)
                graph = getattr(handle, "graph_state", None) or {}
                if graph.get("tap_buffer_bytes"):
                    taps.update(graph)
                if graph.get("compiles", 0) > compiles["count"]:
                    compiles["count"] = int(graph["compiles"])
                    recompiles.append(float(graph["recompile_s"]))
            profile = profiles.setdefault(name, cProfile.Profile()) if args.profile and name else None
            start, cpu = time.perf_counter(), time.process_time()
            if profile is not None:
                profile.enable()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            if handle is not None:
                handle.record_step(2 * step + 1, outputs)
            if profile is not None:
                profile.disable()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            if handle is not None:
                stats = handle.stats()
                if stats["errors"] or stats["missing_logprobs"] or stats["missing_engine_info"]:
                    raise RuntimeError(f"collector problems during the bench: {stats}")
                handle.detach()
                handle.sink.close()
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            return tokens / elapsed, tokens / cpu

        configs = {"none": (None, False), "logprobs": (None, True), "fp1in8": (8, True)}
        rates: dict[str, list[float]] = {name: [] for name in configs}
        cpu_rates: dict[str, list[float]] = {name: [] for name in configs}
        for name in configs:  # each configuration attached once and warmed: what it compiles, untimed
            timed(*configs[name], step=args.rounds)
        warmed = compiles["count"]
        for r in range(args.rounds):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in order:
                wall, cpu = timed(*configs[name], step=r, name=name)
                rates[name].append(wall)
                cpu_rates[name].append(cpu)
        for name, profile in profiles.items():
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            profile.dump_stats(Path(args.profile) / f"{name}.prof")
        base, median_base = max(rates["none"]), statistics.median(rates["none"])
        cpu_base = max(cpu_rates["none"])
        compilation = llm.llm_engine.vllm_config.compilation_config
        print(
            f"vLLM {llm.llm_engine.vllm_config.model_config.model.split('/')[-1]}: {args.prompts} requests x "
            f"{args.max_tokens} tokens, qwen3 {args.layers} layers hidden {args.hidden}, {args.rounds} rounds, "
            f"{'eager' if args.eager else f'compiled ({compilation.mode.name}, backend {compilation.backend})'}"
        )
        if recompiles:
            print(
                f"  recompile with the graph taps: {', '.join(f'{s:.2f}' for s in recompiles)} s "
                f"(warm-up; {compiles['count'] - warmed} recompiles in the timed rounds)"
            )
        if taps:
            print(
                f"  graph taps' fingerprint buffers: {taps['tap_slots']} regions x {taps['tap_rows']} rows, "
                f"{int(taps['tap_buffer_bytes']) / 2**20:.2f} MiB"
            )
        if compiles["count"] != warmed:
            raise RuntimeError("the decoder recompiled during the timed rounds: the figures would include it")
        failed = False
        for name in configs:
            rate = max(rates[name])
            overhead = 1.0 - rate / base
            median_overhead = 1.0 - statistics.median(rates[name]) / median_base
            target = TARGETS.get(name)
            verdict = (
                "" if target is None else ("  ok" if overhead <= target else f"  OVER target {target:.0%}")
            )
            failed |= target is not None and overhead > target
            cpu_overhead = 1.0 - max(cpu_rates[name]) / cpu_base
            print(
                f"  {name:9s} {rate:9.0f} tokens/s  time ratio {base / rate:.3f}  overhead {overhead:+6.1%}  "
                f"(median {median_overhead:+6.1%}, per CPU second {cpu_overhead:+6.1%}){verdict}"
            )
            print(f"            rounds: {' '.join(f'{x:.0f}' for x in rates[name])} tokens/s")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
