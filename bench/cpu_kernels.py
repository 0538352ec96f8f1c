# ruff: noqa: B023  (benchmarked closures run inside their loop iteration)
"""Cost of the CPU invariant kernels (:mod:`kernels.cpu`) against the native CPU ops, same run.

    python bench/cpu_kernels.py [--only gemm,attention] [--threads 1] [--quick] [--json out.json]

Each line: case, shape, dtype, native ms, invariant ms, ratio (invariant / native). Medians of
``torch.utils.benchmark`` timings of the same inputs, both sides on the same intra-op threads
(torch's default unless ``--threads``).
Baselines are what a stock CPU stack runs: ``F.linear``, ``F.rms_norm``, ``F.silu``,
``F.scaled_dot_product_attention`` (causal prefill; batched decode), ``log_softmax`` + gather.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu  # noqa: E402

ROWS: list[dict] = []


def timed(fn: Callable[[], object], min_run_s: float) -> float:
    """Median ms of ``fn`` (after one warm-up call)."""
    fn()
    return (
        benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_s).median
        * 1e3
    )


def record(
    case: str, shape: str, dtype: torch.dtype, native: Callable, ours: Callable, min_run_s: float
) -> None:
    n_ms, o_ms = timed(native, min_run_s), timed(ours, min_run_s)
    row = dict(
        case=case, shape=shape, dtype=str(dtype).removeprefix("torch."), native_ms=n_ms, invariant_ms=o_ms
    )
    row["ratio"] = o_ms / n_ms
    ROWS.append(row)
    print(
        f"{case:<22} {shape:<28} {row['dtype']:<9} {n_ms:10.3f} {o_ms:10.3f} {row['ratio']:8.2f}x", flush=True
    )


def bench_gemm(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    n = k = 512 if quick else 1024
    for dt in dtypes:
        w = (torch.randn(n, k) / k**0.5).to(dt)
        for m in (1, 16, 256) if quick else (1, 16, 256, 2048):
            x = torch.randn(m, k).to(dt)
            record("gemm", f"M={m} N={n} K={k}", dt, lambda: F.linear(x, w), lambda: cpu.linear(x, w), t)


def bench_norm_act(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    rows, d = (512, 1024) if quick else (4096, 1024)
    for dt in dtypes:
        x, w = torch.randn(rows, d).to(dt), torch.rand(d).to(dt) + 0.5
        record(
            "rmsnorm",
            f"T={rows} D={d}",
            dt,
            lambda: F.rms_norm(x, (d,), w, 1e-6),
            lambda: cpu.rms_norm(x, w),
            t,
        )
        h = torch.randn(rows, 3 * d).to(dt)
        record("silu", f"T={rows} D={3 * d}", dt, lambda: F.silu(h), lambda: cpu.silu(h), t)


def bench_logprobs(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    rows, hid, vocab = (64, 256, 8192) if quick else (256, 512, 32768)
    for dt in dtypes:
        h, w = torch.randn(rows, hid).to(dt), (torch.randn(vocab, hid) / hid**0.5).to(dt)
        tok = torch.randint(0, vocab, (rows,))

        def native() -> torch.Tensor:
            z = F.linear(h, w).float()
            return torch.log_softmax(z, -1).gather(1, tok[:, None])[:, 0]

        record(
            "token_logprobs",
            f"T={rows} H={hid} V={vocab}",
            dt,
            native,
            lambda: cpu.token_logprobs(h, w, tok),
            t,
        )
    z = torch.randn(rows, vocab)
    record("log_softmax", f"T={rows} V={vocab}", torch.float32, lambda: torch.log_softmax(z, -1),
           lambda: cpu.log_softmax(z), t)  # fmt: skip


def bench_attention(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    hq, hkv, d = 8, 4, 64
    i32 = dict(dtype=torch.int32)
    for dt in dtypes:
        for length in (256,) if quick else (256, 1024):
            q = torch.randn(length, hq, d).to(dt)
            k, v = (torch.randn(1, length, hkv, d).to(dt) for _ in range(2))
            cu, p0, kl = (
                torch.tensor([0, length], **i32),
                torch.tensor([0], **i32),
                torch.tensor([length], **i32),
            )
            qs, ks, vs = q.transpose(0, 1)[None], k[0].transpose(0, 1)[None], v[0].transpose(0, 1)[None]

            def native() -> torch.Tensor:
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

            record("attention prefill", f"L={length} H={hq}/{hkv} D={d}", dt, native,
                   lambda: cpu.attention(q, k, v, cu, p0, kl), t)  # fmt: skip
        for b, ctx in ((8, 256),) if quick else ((8, 256), (8, 1024), (32, 512)):
            q = torch.randn(b, hq, d).to(dt)
            k, v = (torch.randn(b, ctx, hkv, d).to(dt) for _ in range(2))
            cu = torch.arange(b + 1, **i32)
            p0, kl = torch.full((b,), ctx - 1, **i32), torch.full((b,), ctx, **i32)
            qs, ks, vs = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)

            def native_dec() -> torch.Tensor:
                return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

            record("attention decode", f"B={b} ctx={ctx} H={hq}/{hkv} D={d}", dt, native_dec,
                   lambda: cpu.attention(q, k, v, cu, p0, kl), t)  # fmt: skip


def bench_e2e(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    """The demo's shape of work: a tiny Qwen3 (2 layers, hidden 64, vocab 512) rolls out 16
    requests with the rollout engine (prefill, decode) and the trainer recomputes their logprobs
    with autograd; native ops against ``kernels.enable()``."""
    import transformers

    import kernels
    from kernels import routing
    from kernels.adapters import HFCausalLM
    from kernels.engine import RolloutEngine

    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in torch.randint(4, 24, (16,))]
    new = [8 if quick else 32] * len(prompts)
    for dt in dtypes:
        model = HFCausalLM(transformers.Qwen3ForCausalLM(cfg).to(dt).eval())

        def step(enabled: bool) -> None:
            with kernels.enable() if enabled else kernels.disable():
                outs = RolloutEngine(model, max_len=64).generate(prompts, new, seed=1)
                seqs = [o.prompt + o.tokens for o in outs]
                ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
                for i, s_ in enumerate(seqs):
                    ids[i, : len(s_)] = torch.tensor(s_)
                hidden = model.full_hidden(ids)
                lp = routing.token_logprobs(
                    hidden[:, :-1].reshape(-1, 64), model.lm_head_weight, ids[:, 1:].reshape(-1)
                )
                lp.sum().backward()

        record("e2e rollout+recompute", f"qwen3 2L h64, 16 req x {new[0]}", dt,
               lambda: step(False), lambda: step(True), t)  # fmt: skip


CASES = {
    "gemm": bench_gemm,
    "norm": bench_norm_act,
    "logprobs": bench_logprobs,
    "attention": bench_attention,
    "e2e": bench_e2e,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, help="intra-op threads for both sides (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="small shapes, short timings (a smoke run)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'case':<22} {'shape':<28} {'dtype':<9} {'native ms':>10} {'invar. ms':>10} {'ratio':>9}")
    for name in args.only.split(","):
        CASES[name](dtypes, args.quick, 0.05 if args.quick else 0.3)
    if args.json:
        args.json.write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
