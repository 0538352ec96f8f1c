"""The GRPO recipe (:func:`isoaudit.collectors.rl.job.run_job`) on a GPU, native against remediated.

    python bench/rl_loop_gpu.py [--steps 3] [--prompts 16] [--group 4] [--max-new 256] [--json out.json]
    python bench/rl_loop_gpu.py --fp8    # remediated = ``invariant-fp8``: FP8 rollouts, FP8 recompute
    python bench/rl_loop_gpu.py --prompt-len 8192 --prompts 2 --group 4 --max-new 1024   # long context
    python bench/rl_loop_gpu.py --prompt-len 8192 --micro-batch 2 ...   # samples per backward
    python bench/rl_loop_gpu.py --device cpu --layers 1 ...   # a tiny model on the CPU (structure, not figures)

A random Qwen3-shaped ~0.5B bf16 policy (24 layers, hidden 896, 14/2 heads of 64, MLP 4,864,
vocab 151,936, tied embeddings: 0.60B parameters), the reference engine over its own copy of the
weights, the trainer's recompute, one GRPO update per step, the weight sync; both collectors attached
through a session (logprobs only: fingerprinting is the audit's cost, not remediation's). The run
is made twice from the same initial weights: natively (cuBLAS, SDPA/flash, the stock bf16 head;
the engine batched over its cache with CUDA-graph decode) and remediated (the session's control set
to ``invariant``: both sides on :mod:`kernels`, the same CUDA-graph decode). Printed per phase
(generation, training, full step): native s, remediated s, overhead %; and the mismatch each run's
loop saw (the trainer's recompute against the engine's logprobs). The first ``--warmup`` steps
(compilation, graph capture) are left out of the timings. Each side's peak GPU memory (the
allocator's, over its whole run) is printed beside its times. Needs CUDA for figures; ``--device
cpu`` runs the same loop with a tiny random Qwen3 (hidden 32, vocab 2,048) to check its structure.

Both sides' heads are chunked alike: the invariant head is fused over row blocks and vocabulary
slabs (:mod:`isoaudit.kernels.fused_logprobs`), the native one takes the same blocks and slabs once
its fp32 logits outgrow one slab; HF's own logits are kept for one position (no collector here
fingerprints), and the entropies are built a block of rows at a time. With ``--prompt-len`` each
update runs in micro-batches of ``--micro-batch`` samples (default: as many as fit in
:data:`LONG_MICRO_TOKENS` tokens, at least one), their gradients accumulated, on both sides.

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
from isoaudit.kernels import fused_logprobs  # noqa: E402

import isoaudit  # noqa: E402
from isoaudit import kernels  # noqa: E402

#: Tokens per micro-batch of a long-context update by default: the backward's activations of a
#: 0.5B model's 24 layers at that length stay well inside one 80 GB GPU.
LONG_MICRO_TOKENS = 16_384


def micro_batch(args: argparse.Namespace) -> int | None:
    """Samples per forward and backward of an update: ``--micro-batch``, else with ``--prompt-len``
    as many as :data:`LONG_MICRO_TOKENS` holds (at least one), else the whole batch (None)."""
    if args.micro_batch is not None or args.prompt_len is None:
        return args.micro_batch
    return max(1, LONG_MICRO_TOKENS // (args.prompt_len + args.max_new))


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


def make_policy(args: argparse.Namespace) -> torch.nn.Module:
    """The ~0.5B bf16 policy on CUDA; a tiny fp32 one on the CPU."""
    if args.device == "cuda":
        return qwen3_05b(args.layers)
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    policy = make_policy(args)
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
        micro_batch=micro_batch(args),
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
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
    }
    rollout.engine.clear_graphs()
    del policy, rollout
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
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
        "--micro-batch",
        type=int,
        default=None,
        help="samples per forward and backward of an update (default: the whole batch; with --prompt-len, "
        f"as many as {LONG_MICRO_TOKENS} tokens hold)",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="remediate in the invariant-fp8 mode (every linear in W8A8 on both sides) instead of invariant",
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/rl_loop_gpu.py needs CUDA (--device cpu: a tiny model, structure only)")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (tiny model)"
    print(
        f"device: {where}  torch {torch.__version__}; {args.prompts} prompts x group "
        f"{args.group}, {args.max_new} new tokens, prompts of {args.prompt_len or '~16'} tokens, {args.layers} layers, {args.updates} update(s)/step",
        flush=True,
    )
    print(
        f"update micro-batch: {micro_batch(args) or 'whole batch'} sample(s); both heads in blocks of "
        f"{fused_logprobs.ROWS} rows and slabs within {fused_logprobs.SLAB_BYTES >> 20} MiB of fp32 logits "
        "(native: once its logits outgrow one slab)",
        flush=True,
    )
    remediated = "invariant-fp8" if args.fp8 else "invariant"
    rows = {mode: run_mode(mode, args) for mode in ("native", remediated)}
    nat, inv = rows["native"], rows[remediated]
    print("\nphase        native s   remediated s   ratio    overhead")
    for phase in ("generation_s", "training_s", "step_s"):
        ratio = inv[phase] / nat[phase]
        print(
            f"{phase[:-2]:<12} {nat[phase]:8.3f}   {inv[phase]:12.3f}   {ratio:5.3f}x   {(ratio - 1) * 100:+7.1f}%"
        )
    if args.device == "cuda":
        ratio = inv["peak_gib"] / nat["peak_gib"]
        print(f"{'peak GiB':<12} {nat['peak_gib']:8.2f}   {inv['peak_gib']:12.2f}   {ratio:5.3f}x")
    for mode, r in rows.items():
        print(
            f"{mode}: applied {r['applied']}, graphed decode {r['graphed_decode']}, mismatch mean |d| per step "
            f"{[f'{x:.3e}' for x in r['mismatch_mean_abs']]}, exact {[f'{x:.4f}' for x in r['exact_fraction']]}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
