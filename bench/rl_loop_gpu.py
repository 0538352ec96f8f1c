"""The GRPO recipe (:func:`isoaudit.collectors.rl.job.run_job`) on a GPU, native against remediated.

    python bench/rl_loop_gpu.py [--steps 3] [--prompts 16] [--group 4] [--max-new 256] [--json out.json]
    python bench/rl_loop_gpu.py --fp8    # remediated = ``invariant-fp8``: FP8 rollouts, FP8 recompute
    python bench/rl_loop_gpu.py --prompt-len 8192 --prompts 2 --group 4 --max-new 1024   # long context

A random Qwen3-shaped ~0.5B bf16 policy (24 layers, hidden 896, 14/2 heads of 64, MLP 4,864,
vocab 151,936, tied embeddings: 0.60B parameters), the reference engine over its own copy of the
weights, the trainer's recompute, one GRPO update per step, the weight sync; both collectors attached
through a session (logprobs only: fingerprinting is the audit's cost, not remediation's). The run
is made twice from the same initial weights: natively (cuBLAS, SDPA/flash, the stock bf16 head;
the engine batched over its cache with CUDA-graph decode) and remediated (the session's control set
to ``invariant``: both sides on :mod:`kernels`, the same CUDA-graph decode). Printed per phase
(generation, training, full step): native s, remediated s, overhead %; and the mismatch each run's
loop saw (the trainer's recompute against the engine's logprobs). The first ``--warmup`` steps
(compilation, graph capture) are left out of the timings. Needs CUDA.

The task's tokenizer here is a character one (the model's vocabulary is far larger than any local
tokenizer's): prompt characters map to their code points, and a sampled id decodes to a digit when
it is divisible by 3, else to a letter, so a random policy earns rewards with some spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import qwen3_05b  # noqa: E402
from isoaudit.collectors.rl.job import JobConfig, run_job  # noqa: E402
from isoaudit.collectors.rl.rollout import ReferenceRollout  # noqa: E402
from isoaudit.collectors.sessions import MemoryDestination, Session  # noqa: E402

import isoaudit  # noqa: E402
from isoaudit import kernels  # noqa: E402


class CharTokenizer:
    """Prompt text to code points; ids back to a digit (id % 3 == 0) or a letter."""

    pad_token_id = 0

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["".join(str(t % 10) if t % 3 == 0 else chr(97 + t % 26) for t in row) for row in rows]


class LogprobsOnlyRollout(ReferenceRollout):
    """The reference rollout with its collector on logprobs only (no fingerprint hooks, so its
    decode steps replay CUDA graphs)."""

    def watch(self, audit: Session) -> Any:
        self.collector = audit.watch_engine(self.engine, regions=None, weight_version=0)
        return self.collector


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    policy = qwen3_05b(args.layers)
    rollout = LogprobsOnlyRollout(policy, max_len=max(16, args.prompt_len or 0) + args.max_new + 8)
    config = JobConfig(
        steps=args.warmup + args.steps,
        prompts=args.prompts,
        group=args.group,
        max_new=args.max_new,
        learning_rate=args.lr,
        updates=args.updates,
        trainer_regions=None,
        seed=0,
        prompt_len=args.prompt_len,
    )
    with kernels.disable():
        with isoaudit.session(f"rl-loop-gpu-{mode}", destination=MemoryDestination(), report=False) as audit:
            if mode != "native":
                audit.control.set(mode)
            figures = run_job(
                audit,
                policy,
                CharTokenizer(),
                rollout,
                config,
                on_step=lambda f: print(
                    f"  [{mode}] step {f.step}: generation {f.generation_s:.3f} s, training {f.training_s:.3f} s, "
                    f"mismatch mean |d| {f.mismatch_mean_abs:.3e}, exact {f.exact_fraction:.4f}, "
                    f"reward {f.reward_mean:.3f}+-{f.reward_std:.3f}, mode {f.mode}",
                    flush=True,
                ),
            )
    graphed = rollout.engine.graphed()
    timed = figures[args.warmup :]
    out = {
        "mode": mode,
        "applied": timed[-1].mode,
        "graphed_decode": graphed,
        "generation_s": statistics.median(f.generation_s for f in timed),
        "training_s": statistics.median(f.training_s for f in timed),
        "step_s": statistics.median(f.generation_s + f.training_s for f in timed),
        "mismatch_mean_abs": [f.mismatch_mean_abs for f in figures],
        "exact_fraction": [f.exact_fraction for f in figures],
        "reward_mean": [f.reward_mean for f in figures],
    }
    rollout.engine.clear_graphs()
    del policy, rollout
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--updates", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--prompt-len", type=int, default=None, help="long context: every prompt brought to this many tokens"
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="remediate in the invariant-fp8 mode (every linear in W8A8 on both sides) instead of invariant",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/rl_loop_gpu.py needs CUDA")
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}; {args.prompts} prompts x group "
        f"{args.group}, {args.max_new} new tokens, prompts of {args.prompt_len or '~16'} tokens, {args.layers} layers, {args.updates} update(s)/step",
        flush=True,
    )
    remediated = "invariant-fp8" if args.fp8 else "invariant"
    rows = {mode: run_mode(mode, args) for mode in ("native", remediated)}
    nat, inv = rows["native"], rows[remediated]
    print("\nphase        native s   remediated s   overhead")
    for phase in ("generation_s", "training_s", "step_s"):
        over = (inv[phase] / nat[phase] - 1) * 100
        print(f"{phase[:-2]:<12} {nat[phase]:8.3f}   {inv[phase]:12.3f}   {over:+7.1f}%")
    for mode, r in rows.items():
        print(
            f"{mode}: applied {r['applied']}, graphed decode {r['graphed_decode']}, mismatch mean |d| per step "
            f"{[f'{x:.3e}' for x in r['mismatch_mean_abs']]}, exact {[f'{x:.4f}' for x in r['exact_fraction']]}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
