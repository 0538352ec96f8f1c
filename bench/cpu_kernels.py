# ruff: noqa: B023  (benchmarked closures run inside their loop iteration)
"""Cost of the CPU invariant kernels (:mod:`isoaudit.kernels.cpu`) against the native CPU ops, same run.

    python -m bench.cpu_kernels [--only gemm,attention,gdn] [--threads 1] [--rounds 3] [--quick] [--json out.json]

Each line: case, shape, dtype, native ms, invariant ms, ratio (invariant / native). Medians of
``torch.utils.benchmark`` timings of the same inputs, both sides on the same intra-op threads
(torch's default unless ``--threads``); with ``--rounds N`` the sides are timed alternately N
times and each keeps its fastest median.
Baselines are what a stock CPU stack runs: ``F.linear``, ``F.rms_norm``, ``F.silu``,
``F.scaled_dot_product_attention`` (causal prefill; batched decode), ``log_softmax`` + gather,
transformers' torch Gated DeltaNet of Qwen3-Next (and flash-linear-attention's torch references,
when fla is on the path: ``pip install --no-deps --target DIR fla-core`` and ``PYTHONPATH=DIR``;
fla's own package import needs its Triton kernels, so only its ``naive.py`` is loaded).
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

from isoaudit.kernels import cpu  # noqa: E402

ROWS: list[dict] = []


def timed(fn: Callable[[], object], min_run_s: float) -> float:
    """Median ms of ``fn`` (after one warm-up call)."""
    fn()
    return (
        benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_s).median
        * 1e3
    )


ROUNDS = 1  # --rounds: native and invariant timed alternately this many times, the fastest kept


def record(
    case: str, shape: str, dtype: torch.dtype, native: Callable, ours: Callable, min_run_s: float
) -> None:
    n_ms, o_ms = float("inf"), float("inf")
    for _ in range(ROUNDS):  # alternating, so a burst of load on a shared machine hits both sides
        n_ms, o_ms = min(n_ms, timed(native, min_run_s)), min(o_ms, timed(ours, min_run_s))
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


def _rl_step(model: torch.nn.Module, prompts: list[list[int]], new: list[int], enabled: bool) -> None:
    """One RL step of the demo's shape: the rollout engine samples ``new`` tokens per prompt, then
    the trainer recomputes their logprobs with autograd; kernels on (``enabled``) or off."""
    from isoaudit.kernels import dispatch
    from isoaudit.kernels.engine import RolloutEngine

    from isoaudit import kernels

    with kernels.enable() if enabled else kernels.disable():
        outs = RolloutEngine(model, max_len=64).generate(prompts, new, seed=1)
        seqs = [o.prompt + o.tokens for o in outs]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for i, s_ in enumerate(seqs):
            ids[i, : len(s_)] = torch.tensor(s_)
        hidden = model.full_hidden(ids)
        width = hidden.shape[-1]
        lp = dispatch.token_logprobs(
            hidden[:, :-1].reshape(-1, width), model.lm_head_weight, ids[:, 1:].reshape(-1)
        )
        lp.sum().backward()


def bench_e2e(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    """The demo's shape of work: a tiny Qwen3 (2 layers, hidden 64, vocab 512) rolls out 16
    requests with the rollout engine (prefill, decode) and the trainer recomputes their logprobs
    with autograd; native ops against ``isoaudit.kernels.enable()``."""
    import transformers
    from isoaudit.kernels.adapters import HFCausalLM

    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in torch.randint(4, 24, (16,))]
    new = [8 if quick else 32] * len(prompts)
    for dt in dtypes:
        model = HFCausalLM(transformers.Qwen3ForCausalLM(cfg).to(dt).eval())

        record("e2e rollout+recompute", f"qwen3 2L h64, 16 req x {new[0]}", dt,
               lambda: _rl_step(model, prompts, new, False), lambda: _rl_step(model, prompts, new, True), t)  # fmt: skip


def _fla_naive():
    """flash-linear-attention's torch reference module (``fla/ops/gated_delta_rule/naive.py``) when
    fla is on the path, loaded by file: fla's package import needs its Triton kernels."""
    import importlib.util

    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "gated_delta_rule" / "naive.py"
    if not path.exists():
        return None
    mod_spec = importlib.util.spec_from_file_location("fla_gdn_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except ImportError:  # einops missing
        return None
    return mod


def _gdn_inputs(b: int, n: int, h: int, d: int, dt: torch.dtype) -> list[torch.Tensor]:
    """(B, L, H, d) q, k (unit L2 rows, q scaled by d^-1/2 as the models do), v; g, beta (B, L, H)."""
    q = F.normalize(torch.randn(b, n, h, d), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(b, n, h, d), dim=-1)
    v = torch.randn(b, n, h, d)
    return [q.to(dt), k.to(dt), v.to(dt), -torch.rand(b, n, h) * 0.3, torch.rand(b, n, h)]


def bench_gdn(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    """Gated DeltaNet, Qwen3-Next's head shape (dk = dv = 128), invariant (:mod:`isoaudit.kernels.gdn_cpu`)
    against what a user runs on a CPU: transformers' torch fallbacks of Qwen3-Next
    (``torch_chunk_gated_delta_rule`` for a prefill, ``torch_recurrent_gated_delta_rule`` for a
    decode step), flash-linear-attention's torch references when fla is on the path, and
    kernels' own native forms (``routing`` with the kernels off). Prefill: B sequences of L tokens
    from a zero state; decode: one token for each of B cached states; trainer: the forward and
    backward of B x L (kernels' native chunk form against the invariant forward, same backward)."""
    from isoaudit.kernels import gdn_cpu
    from isoaudit.kernels.gdn import GDNCache, gdn_chunk_reference, gdn_recurrent_step
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    fla = _fla_naive()
    h, d = 8, 128
    for dt in dtypes:
        for b, n in ((1, 128),) if quick else ((1, 512), (4, 128)):
            x = _gdn_inputs(b, n, h, d, dt)
            packed = [y.reshape(b * n, *y.shape[2:]) for y in x]
            cu = torch.arange(b + 1, dtype=torch.int32) * n
            shape = f"B={b} L={n} H={h} d={d}"

            def ours() -> torch.Tensor:
                return gdn_cpu.gdn(*packed, cu)[0]

            record("gdn prefill vs HF", shape, dt, lambda: qn.torch_chunk_gated_delta_rule(*x), ours, t)
            record("gdn prefill vs ref", shape, dt, lambda: gdn_chunk_reference(*packed, cu, None, 64,
                   solve="triangular", state_at="end"), ours, t)  # fmt: skip
            if fla is not None:
                # fla's reference takes (q, k, v, g, beta) and scales q itself, as HF's does.
                record("gdn prefill vs fla", shape, dt, lambda: fla.naive_chunk_gated_delta_rule(*x), ours, t)
        for b in (8,) if quick else (8, 32):
            x = [y[:, 0] for y in _gdn_inputs(b, 1, h, d, dt)]  # (B, H, ...)
            state = torch.randn(b, h, d, d) * 0.05
            cache = GDNCache.empty(b, h, d, d, dt, torch.device("cpu"))
            cache.h.copy_(state)
            cu, slots = torch.arange(b + 1, dtype=torch.int32), list(range(b))
            shape = f"B={b} H={h} d={d}"
            seq = [y[:, None] for y in x]  # (B, 1, H, ...) for the (B, T, H, d) references

            def ours_dec() -> torch.Tensor:
                return gdn_cpu.gdn_incremental(*x, cu, slots, cache)

            record("gdn decode vs HF", shape, dt, lambda: qn.torch_recurrent_gated_delta_rule(
                *seq, initial_state=state, output_final_state=True), ours_dec, t)  # fmt: skip
            record("gdn decode vs ref", shape, dt, lambda: gdn_recurrent_step(*x, state.clone()), ours_dec, t)
            if fla is not None:
                record("gdn decode vs fla", shape, dt, lambda: fla.naive_recurrent_gated_delta_rule(
                    *seq[:3], seq[4], seq[3], initial_state=state, output_final_state=True), ours_dec, t)  # fmt: skip
        b, n = (2, 64) if quick else (4, 128)
        x = _gdn_inputs(b, n, h, d, dt)
        packed = [y.reshape(b * n, *y.shape[2:]) for y in x]
        cu = torch.arange(b + 1, dtype=torch.int32) * n
        gout = torch.randn(b * n, h, d)

        def train(fn: Callable) -> Callable[[], None]:
            def run() -> None:
                ins = [y.detach().requires_grad_(True) for y in packed]
                (fn(*ins) * gout).sum().backward()

            return run

        shape = f"B={b} L={n} H={h} d={d}"
        ours_train = train(lambda *a: gdn_cpu.gdn_autograd(*a, cu))
        hf_train = train(lambda *a: qn.torch_chunk_gated_delta_rule(*(y.view(b, n, *y.shape[1:]) for y in a))[0]
                         .reshape(b * n, h, d))  # fmt: skip
        record("gdn trainer vs HF", shape, dt, hf_train, ours_train, t)
        ref_train = train(lambda *a: gdn_chunk_reference(*a, cu, None, 64, solve="triangular")[0])
        record("gdn trainer vs ref", shape, dt, ref_train, ours_train, t)
    bench_e2e_gdn(dtypes, quick, t)


def bench_e2e_gdn(dtypes: list[torch.dtype], quick: bool, t: float) -> None:
    """The demo's shape of work on the hybrid GDN + attention LM (:mod:`isoaudit.kernels.models.gdn_lm`, one
    GDN and one attention layer, hidden 128, 2 heads of 64, vocab 512): 16 requests rolled out by
    the engine, their logprobs recomputed by the trainer with autograd; native against kernels on."""
    from isoaudit.kernels.models.gdn_lm import GDNLM, GDNLMConfig

    cfg = GDNLMConfig(vocab=512, hidden=128, layers=("gdn", "attn"), heads=2, kv_heads=1, head_dim=64,
                      gdn_heads=2, gdn_head_dim=64, mlp=256)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in torch.randint(4, 24, (16,))]
    new = [8 if quick else 32] * len(prompts)
    for dt in dtypes:
        torch.manual_seed(0)
        model = GDNLM(cfg).to(dt).eval()

        record("e2e gdn-lm", f"gdn+attn h128, 16 req x {new[0]}", dt,
               lambda: _rl_step(model, prompts, new, False), lambda: _rl_step(model, prompts, new, True), t)  # fmt: skip


CASES = {
    "gemm": bench_gemm,
    "norm": bench_norm_act,
    "logprobs": bench_logprobs,
    "attention": bench_attention,
    "gdn": bench_gdn,
    "e2e": bench_e2e,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, help="intra-op threads for both sides (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="small shapes, short timings (a smoke run)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument(
        "--rounds", type=int, default=1, help="alternate the two sides this many times, keep the fastest"
    )
    args = ap.parse_args()
    global ROUNDS
    ROUNDS = max(1, args.rounds)
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
