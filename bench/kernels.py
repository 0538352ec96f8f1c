# ruff: noqa: B023  (benchmarked closures run inside their loop iteration)
"""Benchmark of the invariant kernels against the native baseline measured in the same run.

    python bench/kernels.py [--only gemm,attention] [--timing eager,graph] [--json out.json]
    python bench/kernels.py --only all    # every issue-20 figure, each under its own timing

Each line: case, shape, native ms, invariant ms, ratio (invariant / native). Needs CUDA.
Inputs random, bf16 unless noted. Two timings, each applied to both sides alike:
  * eager: medians of CUDA-event timings of Python calls (triton.testing.do_bench); includes
    launch cost whenever the host is slower than the kernel (small shapes, slow hosts);
  * graph: the same calls replayed from a CUDA graph (triton.testing.do_bench_cudagraph): device
    time only, as a rollout engine that captures its decode step sees it. Calls that cannot be
    captured (they sync with the host) print n/a.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import host_us, qwen3_05b  # noqa: E402
from isoaudit.kernels import gdn as G  # noqa: E402
from isoaudit.kernels import gdn_decode as GD  # noqa: E402
from isoaudit.kernels.attention import attention  # noqa: E402
from isoaudit.kernels.gemm import gemm  # noqa: E402
from isoaudit.kernels.rmsnorm import rms_norm  # noqa: E402

ROWS: list[dict] = []
TIMING = "eager"  # set by main() for each pass


def bench(fn, reps_ms: int = 200) -> float:
    """Median ms of ``fn`` under the current timing mode (NaN where a graph cannot capture it)."""
    import triton

    if TIMING == "eager":
        return float(triton.testing.do_bench(fn, warmup=50, rep=reps_ms, return_mode="median"))
    try:
        fn()  # compile and allocate outside the capture
        torch.cuda.synchronize()
        return float(triton.testing.do_bench_cudagraph(fn, rep=min(reps_ms, 100), return_mode="median"))
    except Exception:  # noqa: BLE001 - a host sync inside fn: not capturable
        torch.cuda.synchronize()
        return float("nan")


def record(case: str, shape: str, native_ms: float, ours_ms: float, target: float | None = None) -> None:
    ratio = ours_ms / native_ms
    row = dict(
        timing=TIMING,
        case=case,
        shape=shape,
        native_ms=native_ms,
        invariant_ms=ours_ms,
        ratio=ratio,
        target=target,
    )
    ROWS.append(row)
    if ratio != ratio:  # NaN: not capturable
        print(f"[{TIMING}] {case:<28} {shape:<34} n/a (needs a host sync)", flush=True)
        return
    tgt = f"  (target <= {target:.2f}x: {'met' if ratio <= target else 'MISSED'})" if target else ""
    print(
        f"[{TIMING}] {case:<28} {shape:<34} native {native_ms:9.4f} ms   invariant {ours_ms:9.4f} ms   "
        f"{ratio:5.2f}x{tgt}",
        flush=True,
    )


def bench_gemm() -> None:
    n = k = 4096
    w = torch.randn(n, k, device="cuda").bfloat16()
    for m in (1, 64, 2048, 8192):
        a = torch.randn(m, k, device="cuda").bfloat16()
        wt = w.T
        record(
            "gemm",
            f"M={m} N={n} K={k}",
            bench(lambda: torch.mm(a, wt)),
            bench(lambda: gemm(a, w)),
            1.25 if m >= 2048 else None,
        )


#: Decode projections of 0.5B-8B models (N, K): Qwen2.5-0.5B (896 hidden, 4864 MLP), Llama-3-8B /
#: Qwen3-8B (4096 hidden; 1024 KV; 14336 / 12288 MLP).
SMALL_M_SHAPES = [
    (896, 896),
    (4864, 896),
    (896, 4864),
    (4096, 4096),
    (1024, 4096),
    (14336, 4096),
    (4096, 14336),
    (12288, 4096),
]
SMALL_MS = (1, 8, 16, 64, 256)
TUNE_MS = (1, 16, 64, 128, 256)  # tune_small's row counts (--tune-ms)


def _weight_copies(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Enough copies of an (n, k) weight to exceed the L2 cache (60 MB on the H200) when cycled,
    as a decode step's layers do: a graph of repeated calls on one weight would time L2, not HBM."""
    copies = max(2, min(64, -(-256 * 2**20 // (n * k * dtype.itemsize))))
    return [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]


def _calls_graph(fns: list) -> tuple[torch.cuda.CUDAGraph, int]:
    """The list of calls captured once in a CUDA graph (repeated to ~64 calls), and its call count."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    reps = max(1, 64 // len(fns))
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    return graph, reps * len(fns)


def _replay_ms(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / calls


def bench_calls(fns: list) -> float:
    """Median ms per call of a list of calls run in turn (eager: Python calls; graph: the list
    captured once in a CUDA graph and replayed)."""
    import triton

    if TIMING == "eager":

        def all_calls() -> None:
            for f in fns:
                f()

        return float(triton.testing.do_bench(all_calls, warmup=20, rep=100, return_mode="median")) / len(fns)
    graph, calls = _calls_graph(fns)
    times = sorted(_replay_ms(graph, calls) for _ in range(15))
    return times[len(times) // 2]


def bench_pair(native: list, ours: list) -> tuple[float, float]:
    """(native, ours) median ms per call, the two measured alike: in graph timing their replays
    alternate (a warm-up of both first), so a clock or power state that drifts between the two
    measurements cannot favour either side (back to back, the second of two equal kernels
    measured up to 20% slower on the H200)."""
    if TIMING == "eager":
        return bench_calls(native), bench_calls(ours)
    graphs = [_calls_graph(native), _calls_graph(ours)]
    for _ in range(3):
        for g in graphs:
            _replay_ms(*g)
    times: list[list[float]] = [[], []]
    for _ in range(15):
        for side, g in enumerate(graphs):
            times[side].append(_replay_ms(*g))
    med = [sorted(t)[len(t) // 2] for t in times]
    return med[0], med[1]


def _unsplit(n: int, k: int):
    """The tile config a split-K weight had before the split (the same-run "before")."""
    from isoaudit.kernels.gemm_policy import GemmConfig, gemm_config

    cfg = gemm_config(n, k, torch.bfloat16, torch.cuda.get_device_capability())
    if not cfg.k_split:
        return None
    return GemmConfig(128, 256, 64, 8, 3, tma=True, shrink_small_m=True)


def bench_gemm_small() -> None:
    """Decode-sized GEMMs on the 0.5B-8B projections, weights cycled through HBM like a model's,
    under the default split policy (what both manifests state); for split-K weights also the
    unsplit kernel (before) and the large-M cost of the split."""
    from isoaudit.kernels.gemm_policy import split_policy

    print(f"split policy: {split_policy().label}", flush=True)
    for n, k in SMALL_M_SHAPES:
        ws = _weight_copies(n, k)
        before = _unsplit(n, k)
        ms = sorted({*SMALL_MS, *((2048, 16384) if before else ())})
        a_full = torch.randn(max(ms), k, device="cuda").bfloat16()
        for m in ms:
            a = a_full[:m]
            cublas = [lambda w=w: torch.mm(a, w.T) for w in ws]
            native, ours = bench_pair(cublas, [lambda w=w: gemm(a, w) for w in ws])
            record("gemm small-M", f"M={m} N={n} K={k}", native, ours, 1.25)
            if before:
                native, unsplit = bench_pair(cublas, [lambda w=w: gemm(a, w, config=before) for w in ws])
                record("gemm small-M unsplit", f"M={m} N={n} K={k}", native, unsplit)


def bench_tune_split() -> None:
    """Split-K span counts for the narrow weights (graph timing): each config's bits at M against
    its own 16384-row result (M-invariance), and time against cuBLAS, from decode M to a trainer's."""
    from dataclasses import replace

    from isoaudit.kernels._triton import cdiv
    from isoaudit.kernels.bits import bits_equal
    from isoaudit.kernels.gemm_policy import gemm_config

    global TIMING
    saved, TIMING = TIMING, "graph"
    for n, k in SMALL_M_SHAPES:
        cfg = gemm_config(n, k, torch.bfloat16, torch.cuda.get_device_capability())
        if not cfg.k_split:
            continue
        ws = _weight_copies(n, k)
        a_full = torch.randn(16384, k, device="cuda").bfloat16()
        for spans in (2, 4, 8):
            span = cdiv(cdiv(k, spans), 128) * 128
            c = replace(cfg, k_split=span)
            want = gemm(a_full, ws[0], config=c)
            line = [f"tune-split N={n} K={k} spans={cdiv(k, span)} span={span}:"]
            for m in (1, 16, 64, 256, 2048, 16384):
                a = a_full[:m]
                same = bits_equal(gemm(a, ws[0], config=c), want[:m])
                base = bench_calls([lambda w=w: torch.mm(a, w.T) for w in ws])
                t = bench_calls([lambda w=w: gemm(a, w, config=c) for w in ws])
                line.append(f"M={m} {t / base:.2f}x{'' if same else ' BITS-DIFFER'}")
            print("  ".join(line), flush=True)
    TIMING = saved


def bench_tune_small() -> None:
    """Tile candidates at small M: bits against the full tile's, and graph time (tuning). Prints
    cuBLAS's and the shipped call's absolute time, so a launch rule can be fitted to the table."""
    from isoaudit.kernels.bits import bits_equal
    from isoaudit.kernels.gemm import _plan
    from isoaudit.kernels.gemm_policy import NARROW_TILES, ROW16_TILE, GemmConfig, gemm_config

    global TIMING
    saved, TIMING = TIMING, "graph"

    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, TMA): the shipped narrow tiles, the 16-row one,
    # neighbours of each, and the full tile passed explicitly (the first)
    cands = [(128, 256, 64, 8, 3, True)] + [(64, bn, bk, 4, st, tma) for bn, bk, st, tma in NARROW_TILES] + [
        (*ROW16_TILE, False), (16, 32, 128, 4, 4, False), (16, 64, 128, 4, 4, False),
        (64, 128, 64, 4, 8, True), (64, 64, 128, 4, 5, True), (64, 128, 128, 4, 4, False),
        (64, 256, 64, 8, 4, True), (64, 128, 128, 8, 4, True), (128, 128, 64, 8, 4, True),
        (128, 128, 128, 8, 3, True), (128, 64, 128, 8, 4, True), (64, 64, 64, 4, 6, False),
        # the full tile with a 4th stage (its output tile stored in halves to fit), or warp-specialised
        (128, 256, 64, 8, 4, True, "split"), (128, 256, 64, 8, 3, True, "ws"),
    ]  # fmt: skip
    best: dict = {}
    for n, k in SMALL_M_SHAPES:
        ws = _weight_copies(n, k)
        a_full = torch.randn(max(2048, *TUNE_MS), k, device="cuda").bfloat16()
        want = gemm(a_full, ws[0])
        split = gemm_config(n, k, torch.bfloat16, torch.cuda.get_device_capability()).k_split
        for m in TUNE_MS:
            a = a_full[:m]
            cublas = [lambda w=w: torch.mm(a, w.T) for w in ws]
            base, dflt = bench_pair(cublas, [lambda w=w: gemm(a, w) for w in ws])
            shipped = _plan(m, n, k, torch.bfloat16, torch.bfloat16, False, a.device, None)[0]
            line = [
                f"tune-small N={n} K={k} M={m}: cublas {base * 1e3:.1f} us, shipped "
                f"{shipped.block_m}x{shipped.block_n}x{shipped.block_k} {dflt * 1e3:.1f} us {dflt / base:.2f}x"
            ]
            for bm, bn, bk, wp, st, tma, *extra in cands:
                if bm < 64 and m > 64:
                    continue
                cfg = GemmConfig(
                    bm, bn, bk, wp, st, tma=tma, k_split=split,
                    split_epilogue="split" in extra, warp_specialize="ws" in extra,
                )  # fmt: skip
                tag = f"{bm}x{bn}x{bk}w{wp}s{st}{'T' if tma else 'P'}{''.join(extra)}"
                try:
                    same = bits_equal(gemm(a, ws[0], config=cfg), want[:m])
                    base_c, t = bench_pair(cublas, [lambda w=w: gemm(a, w, config=cfg) for w in ws])
                except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                    line.append(f"{tag}: {type(e).__name__}")
                    continue
                line.append(f"{tag}: {t * 1e3:.1f} us {t / base_c:.2f}x{'' if same else ' BITS-DIFFER'}")
                if same and t / base_c < best.get((n, k, m), (9e9,))[0]:
                    best[(n, k, m)] = (t / base_c, tag)
            print("  ".join(line), flush=True)
    for key, (r, c) in best.items():
        print(f"tune-small best {key}: {c} {r:.2f}x", flush=True)
    TIMING = saved


def bench_launch() -> None:
    """Host time per call without a sync (what bounds an eager decode step): the calls are queued
    faster than the GPU runs them only if the host is the bottleneck, so time the Python loop."""

    from isoaudit.kernels import _triton

    if TIMING != "eager":
        return

    k = 4096
    w = torch.randn(k, k, device="cuda").bfloat16()
    a = torch.randn(1, k, device="cuda").bfloat16()
    hq, hkv, d, b, n = 32, 8, 128, 8, 4096
    i32 = dict(device="cuda", dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, device="cuda").bfloat16()
    kc = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    vc = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    qs, ks, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    qp, cu = q.reshape(b, hq, d), torch.arange(b + 1, **i32)
    p0, kl = torch.full((b,), n - 1, **i32), torch.full((b,), n, **i32)
    cases = [
        ("host us/call gemm", f"M=1 N=K={k}", lambda: torch.mm(a, w.T), lambda: gemm(a, w)),
        (
            "host us/call attn decode",
            f"B={b} ctx={n} H={hq}/{hkv}",
            lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
            lambda: attention(qp, kc, vc, cu, p0, kl),
        ),
    ]
    for case, shape, native, ours in cases:
        nat = host_us(native)
        _triton.CachedLauncher.enabled = False
        jit = host_us(ours)
        _triton.CachedLauncher.enabled = True
        cached = host_us(ours)
        print(
            f"[host] {case:<26} {shape:<22} native {nat:6.1f} us  Triton launch {jit:6.1f} us  cached {cached:6.1f} us",
            flush=True,
        )
        record(case, shape, nat / 1e3, cached / 1e3, 25.0 / nat)
    # breakdown: gemm's cache entries through CudaLauncher.__call__ (not the direct C launch)
    import importlib

    # the module, by name: the package attribute ``isoaudit.kernels.gemm`` is the function
    gemm_mod = importlib.import_module("isoaudit.kernels.gemm")
    _triton.CachedLauncher.direct = False
    gemm_mod._LAUNCH._cache.clear()
    via_run = host_us(lambda: gemm(a, w))
    _triton.CachedLauncher.direct = True
    gemm_mod._LAUNCH._cache.clear()
    empty = host_us(lambda: torch.empty(1, k, dtype=a.dtype, device=a.device))
    print(
        f"[host] gemm breakdown: cached via CudaLauncher.__call__ {via_run:6.1f} us  torch.empty {empty:6.1f} us",
        flush=True,
    )


def bench_fingerprint() -> None:
    """The fused fingerprint pass against a plain ``x.float().sum(-1)`` over the same tensor (and
    the torch path it replaces, where importable)."""
    from isoaudit.kernels.fingerprint import fingerprint_rows

    for rows, hidden in ((16384, 4096), (1024, 896)):
        x = torch.randn(rows, hidden, device="cuda").bfloat16()
        w = torch.randint(-(2**62), 2**62, (hidden,), device="cuda", dtype=torch.int64) * 2 + 1
        s = torch.where(torch.rand(hidden, 16, device="cuda") < 0.5, 0.25, -0.25)
        masks = torch.tensor([-(1 << (7 - r)) for r in (6, 4, 2, 0)], device="cuda")
        shape = f"rows={rows} hidden={hidden} bf16"
        base = bench(lambda: x.float().sum(-1))
        record(
            "fingerprint (fused) vs sum", shape, base, bench(lambda: fingerprint_rows(x, w, s, masks)), 1.5
        )
        try:
            import isoaudit.collectors.fingerprints as coll
        except ImportError:
            continue
        saved = coll._TRITON
        coll._TRITON = False  # the collector's torch path (it calls the fused pass on CUDA otherwise)
        try:
            record("fingerprint (torch) vs sum", shape, base, bench(lambda: coll.fingerprint_rows(x)))
        finally:
            coll._TRITON = saved


def bench_trainer() -> None:
    """The trainer's forward+backward on the ~0.5B Qwen3-shaped bf16 model over 64 x 256 tokens:
    the loss is the sum of the sampled tokens' logprobs, as an RL trainer's. Wall time per step
    with a sync (eager only: the backward reads the batch's lengths once)."""
    import time

    from isoaudit.kernels import dispatch

    from isoaudit import kernels

    if TIMING != "eager":
        return
    model = qwen3_05b()
    hidden = model.config.hidden_size
    ids = torch.randint(0, model.config.vocab_size, (64, 256), device="cuda")

    def step() -> None:
        h = model.model(input_ids=ids).last_hidden_state
        lp = dispatch.token_logprobs(
            h[:, :-1].reshape(-1, hidden), model.lm_head.weight, ids[:, 1:].reshape(-1)
        )
        lp.sum().backward()
        model.zero_grad(set_to_none=True)

    def timed(reps: int) -> float:
        step()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return sorted(out)[len(out) // 2] * 1e3

    with kernels.disable():
        native = timed(3)
    with kernels.enable():
        ours = timed(3)
        if PROFILE:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    record("trainer fwd+bwd", "Qwen3 24L h896 64x256 tok", native, ours, 1.25)


PROFILE = False


def bench_logprobs() -> None:
    """The trainer's token-logprob head, forward + backward at 32,768 response tokens on the 0.5B
    shapes (hidden 896, vocab 151,936): the fused invariant path against the native head under
    the same chunking (time), and its peak memory against the head that keeps its fp32 logits
    (``bench/logprobs_memory.py`` prints all three paths)."""
    import argparse

    import logprobs_memory as LM

    if TIMING != "eager":
        return
    from isoaudit.kernels.fused_logprobs import _chunks

    args = argparse.Namespace(tokens=32_768, hidden=896, vocab=151_936, reps=5)
    args.chunks = _chunks(args.tokens, args.vocab, None, None)
    fig = {path: LM._cuda_path(path, args) for path in LM.PATHS}
    shape = f"T=32768 H=896 V=151936 {args.chunks[0]}x{args.chunks[1]}"
    record("logprobs fwd+bwd time", shape, fig["native_chunked"]["ms"], fig["fused"]["ms"], 1.05)
    print(
        f"[{TIMING}] logprobs fwd+bwd peak         {shape:<34} kept logits {fig['kept_logits']['peak_gib']:.2f} GiB   "
        f"fused {fig['fused']['peak_gib']:.2f} GiB   {fig['fused']['peak_gib'] / fig['kept_logits']['peak_gib']:.3f} "
        "(target <= 0.40)",
        flush=True,
    )


def bench_engine() -> None:
    """End to end through the reference engine on the ~0.5B model, both sides alike (batched
    attention over the cache, decode replayed from a CUDA graph per batch bucket): decode
    throughput at batch 1/16/64/256 (32-token prompts, 128 new tokens; the decode time is a whole
    generation's minus a prefill-and-one-token generation's) and prefill (16 x 512 tokens). Wall
    time with the sync of the engine's one host read. Also the eager (ungraphed) engine at B=64."""
    import time

    from isoaudit.kernels.adapters import HFCausalLM
    from isoaudit.kernels.engine import RolloutEngine

    from isoaudit import kernels

    if TIMING != "eager":
        return
    hf = qwen3_05b()
    model = HFCausalLM(hf)
    vocab = hf.config.vocab_size

    def wall(eng: RolloutEngine, prompts: list[list[int]], new: int, reps: int = 3) -> float:
        eng.generate(prompts, [new] * len(prompts), seed=0)  # compile, capture
        times = []
        for r in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(prompts, [new] * len(prompts), seed=r)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    new, plen = 128, 32
    for b in (1, 16, 64, 256):
        prompts = torch.randint(0, vocab, (b, plen)).tolist()
        per_token = {}
        for mode in ("native", "invariant"):
            with kernels.enable() if mode == "invariant" else kernels.disable():
                eng = RolloutEngine(model, max_len=plen + new + 8)
                full, first = wall(eng, prompts, new), wall(eng, prompts, 1)
                per_token[mode] = (full - first) / (new - 1) * 1e3  # ms per decode step of b tokens
                print(
                    f"[engine] {mode:<9} B={b:<3}: generate {full * 1e3:8.1f} ms, prefill+1 {first * 1e3:7.1f} ms, "
                    f"decode {b / per_token[mode] * 1e3:9.0f} tok/s",
                    flush=True,
                )
                eng.clear_graphs()
        record(
            "e2e decode, graphs (ms/step)",
            f"0.5B B={b} ctx {plen}+{new}",
            per_token["native"],
            per_token["invariant"],
            1.25,
        )
    prompts = torch.randint(0, vocab, (16, 512)).tolist()
    pre = {}
    for mode in ("native", "invariant"):
        with kernels.enable() if mode == "invariant" else kernels.disable():
            pre[mode] = wall(RolloutEngine(model, max_len=520), prompts, 1) * 1e3
    record("e2e prefill (+1 token)", "0.5B B=16 L=512", pre["native"], pre["invariant"], 1.25)
    b = 64
    prompts = torch.randint(0, vocab, (b, plen)).tolist()
    eager = {}
    for mode in ("native", "invariant"):
        with kernels.enable() if mode == "invariant" else kernels.disable():
            eng = RolloutEngine(model, max_len=plen + new + 8, cuda_graphs=False)
            eager[mode] = (wall(eng, prompts, new, 1) - wall(eng, prompts, 1, 1)) / (new - 1) * 1e3
    record("e2e decode, eager (ms/step)", f"0.5B B={b} ctx {plen}+{new}", eager["native"], eager["invariant"])


def bench_native_attn() -> None:
    """Native decode attention variants over a padded cache (B=64, cache 512, 14/2 heads of 64,
    half the cache filled): the engine's native path is SDPA with a length mask; this checks it
    against expanding the KV heads and against plain batched matmuls (graph timing)."""
    if TIMING != "graph":
        return
    b, n, hq, hkv, d = 64, 512, 14, 2, 64
    g = hq // hkv
    q = torch.randn(b, hq, d, device="cuda").bfloat16()
    k = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    v = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    kvl = torch.full((b,), n // 2, device="cuda")
    keys = torch.arange(n, device="cuda")
    scale = d**-0.5

    def sdpa_gqa() -> torch.Tensor:
        mask = (keys[None, :] < kvl[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(
            q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
        )

    def sdpa_expand() -> torch.Tensor:
        mask = (keys[None, :] < kvl[:, None])[:, None, None, :]
        ke = k.transpose(1, 2).repeat_interleave(g, dim=1)
        ve = v.transpose(1, 2).repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q[:, :, None], ke, ve, attn_mask=mask, scale=scale)

    def matmuls() -> torch.Tensor:
        qg = q.view(b, hkv, g, d)
        s = (qg @ k.permute(0, 2, 3, 1)).float() * scale
        s = s.masked_fill((keys[None, :] >= kvl[:, None])[:, None, None, :], float("-inf"))
        return torch.softmax(s, -1).to(v.dtype) @ v.transpose(1, 2)

    base = bench(sdpa_gqa)
    record("native decode attn: expand", f"B={b} cache={n} H={hq}/{hkv}", base, bench(sdpa_expand))
    record("native decode attn: matmuls", f"B={b} cache={n} H={hq}/{hkv}", base, bench(matmuls))


def bench_tune() -> None:
    """Candidate GEMM tile configurations (each is invariant on its own; one is fixed per shape);
    attention's are ``bench_attention_tune``'s."""
    from isoaudit.kernels.gemm_policy import GemmConfig

    n = k = 4096
    w = torch.randn(n, k, device="cuda").bfloat16()
    for m in (2048, 8192):
        a = torch.randn(m, k, device="cuda").bfloat16()
        base = bench(lambda: torch.mm(a, w.T))
        for c in [
            (256, 128, 64, 8, 3),  # pointer loads, one program per tile
            (128, 256, 64, 8, 3, True),  # TMA + persistent (Hopper)
            (128, 256, 64, 8, 4, True, True),
            (128, 256, 64, 8, 3, True, False, True),  # + warp specialisation
            (128, 256, 64, 8, 3, True, True),
            (128, 128, 64, 8, 4, True),
            (256, 128, 64, 8, 3, True),
            (64, 256, 64, 4, 4, True),
        ]:
            cfg = GemmConfig(*c)
            try:
                t = bench(lambda: gemm(a, w, config=cfg))
                print(f"tune gemm M={m} {c}: {t:.4f} ms  {t / base:.3f}x", flush=True)
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                print(f"tune gemm M={m} {c}: failed {type(e).__name__}", flush=True)


def bench_rmsnorm() -> None:
    d = 4096
    w = torch.randn(d, device="cuda").bfloat16()
    for t in (1, 256, 4096, 16384):
        x = torch.randn(t, d, device="cuda").bfloat16()
        r = torch.randn(t, d, device="cuda").bfloat16()

        def native() -> torch.Tensor:
            h = x.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

        record("rmsnorm (HF torch)", f"T={t} D={d}", bench(native), bench(lambda: rms_norm(x, w)))
        record(
            "rmsnorm (F.rms_norm)",
            f"T={t} D={d}",
            bench(lambda: F.rms_norm(x, (d,), w, 1e-6)),
            bench(lambda: rms_norm(x, w)),
        )

        def native_fused() -> torch.Tensor:
            s = x + r
            h = s.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

        record(
            "rmsnorm+residual (HF)",
            f"T={t} D={d}",
            bench(native_fused),
            bench(lambda: rms_norm(x, w, residual=r)),
        )


ATTN_HEADS = (32, 8, 128)  # query heads, KV heads, head size
ATTN_PREFILL = ((1, 8192), (4, 4096), (16, 1024))  # (sequences, tokens each)
ATTN_DECODE = ((8, 4096), (32, 4096), (64, 2048))  # (sequences, cached tokens each)


def _attn_prefill_case(b: int, n: int, grad: bool = False) -> dict:
    """A causal prefill of ``b`` sequences of ``n`` tokens: SDPA's (B, H, L, D) views, our packed
    queries and (B, L, Hkv, D) cache over the same values, and an output gradient."""
    hq, hkv, d = ATTN_HEADS
    i32 = dict(device="cuda", dtype=torch.int32)
    q = torch.randn(b, n, hq, d, device="cuda").bfloat16()
    k = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    v = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    case = dict(
        shape=f"B={b} L={n} H={hq}/{hkv} D={d}",
        sdpa=(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        ours=(q.reshape(b * n, hq, d), k, v, torch.arange(b + 1, **i32) * n, torch.zeros(b, **i32)),
        kv_len=torch.full((b,), n, **i32),
        b=b,
        n=n,
    )
    if grad:
        case["grad"] = torch.randn(b * n, hq, d, device="cuda").bfloat16()
    return case


def _attn_decode_case(b: int, n: int) -> dict:
    """One decode step of ``b`` sequences over ``n`` cached tokens each."""
    hq, hkv, d = ATTN_HEADS
    i32 = dict(device="cuda", dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, device="cuda").bfloat16()
    k = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    v = torch.randn(b, n, hkv, d, device="cuda").bfloat16()
    return dict(
        shape=f"B={b} ctx={n} H={hq}/{hkv} D={d}",
        sdpa=(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        ours=(q.reshape(b, hq, d), k, v, torch.arange(b + 1, **i32), torch.full((b,), n - 1, **i32)),
        kv_len=torch.full((b,), n, **i32),
        b=b,
        n=n,
    )


def _flash_check(fn, shape: str) -> None:
    """Say so when SDPA's FlashAttention backend refuses ``fn``'s call (the baseline is then
    another backend): the default dispatch picks flash first wherever flash takes the call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fn()
    except RuntimeError as exc:
        print(f"[attention] SDPA flash refused {shape} ({str(exc)[:80]}): baseline is another backend")


def _sdpa_fwd(case: dict, causal: bool):
    fn = lambda: F.scaled_dot_product_attention(*case["sdpa"], is_causal=causal, enable_gqa=True)  # noqa: E731
    _flash_check(fn, case["shape"])
    return fn


def _sdpa_bwd(case: dict):
    """SDPA's (FlashAttention backend's) backward alone: gradients of a kept forward graph."""
    qs, ks, vs = (t.detach().requires_grad_() for t in case["sdpa"])
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    b, n = case["b"], case["n"]
    go = case["grad"].view(b, n, *case["grad"].shape[1:]).transpose(1, 2)
    _flash_check(
        lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), (qs, ks, vs), go
        ),
        case["shape"] + " backward",
    )
    return lambda: torch.autograd.grad(out, (qs, ks, vs), go, retain_graph=True)


def _ours_bwd(case: dict, config=None):
    """Our trainer's backward alone (the two deterministic kernels) for the case's uniform batch."""
    from isoaudit.kernels.attention import _triton_uniform_backward

    q, k, v, cu, p0 = case["ours"]
    b, n, d = case["b"], case["n"], q.shape[-1]
    slots = torch.arange(b, device="cuda", dtype=torch.int32)
    out = attention(q, k, v, cu, p0, case["kv_len"], slots, d**-0.5)
    return lambda: _triton_uniform_backward(q, k, v, out, case["grad"], n, 0, n, slots, d**-0.5, config)


def bench_attention() -> None:
    for b, n in ATTN_PREFILL:
        case = _attn_prefill_case(b, n, grad=True)
        q, k, v, cu, p0 = case["ours"]
        kvl = case["kv_len"]
        ours = bench(lambda: attention(q, k, v, cu, p0, kvl))
        record("attention prefill", case["shape"], bench(_sdpa_fwd(case, True)), ours, 1.15)
        record("attention backward", case["shape"], bench(_sdpa_bwd(case)), bench(_ours_bwd(case)), 1.25)
        del case
    for b, n in ATTN_DECODE:
        case = _attn_decode_case(b, n)
        q, k, v, cu, p0 = case["ours"]
        kvl = case["kv_len"]
        ours = bench(lambda: attention(q, k, v, cu, p0, kvl))
        record("attention decode", case["shape"], bench(_sdpa_fwd(case, False)), ours, 1.15)


def _alone(case: dict, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's first sequence alone under ``cfg``, and its rows of the whole batch's output."""
    q, k, v, cu, p0 = case["ours"]
    rows = q.shape[0] // case["b"]
    one = attention(q[:rows], k[:1], v[:1], cu[:2], p0[:1], case["kv_len"][:1], config=cfg)
    return one, attention(q, k, v, cu, p0, case["kv_len"], config=cfg)[:rows]


def _tune_phase(phase: str, cases: list[dict], causal: bool) -> dict:
    """Time each launch candidate of ``phase`` on ``cases`` against SDPA (same run), check its bits
    against the shipped configuration and batch 1 against batch N; returns the best candidate's
    fields (lowest worst-case ratio among those with the shipped bits)."""
    from isoaudit.kernels.attention import CONFIG, LAUNCH_CANDIDATES
    from isoaudit.kernels.bits import bits_equal

    base = [bench(_sdpa_fwd(c, causal), 100) for c in cases]
    want = [attention(*c["ours"], c["kv_len"], config=CONFIG) for c in cases]
    best: tuple[float, dict] = (float("inf"), {})
    for fields in LAUNCH_CANDIDATES[phase]:
        cfg = CONFIG._replace(**fields)
        try:
            same = all(
                bits_equal(attention(*c["ours"], c["kv_len"], config=cfg), w)
                for c, w in zip(cases, want, strict=True)
            )
            invariant = bits_equal(*_alone(next(c for c in cases if c["b"] > 1), cfg))
            ratios = [
                bench(lambda: attention(*c["ours"], c["kv_len"], config=cfg), 100) / t
                for c, t in zip(cases, base, strict=True)
            ]
        except Exception as exc:  # noqa: BLE001 - a candidate that does not build here (shared memory, WS)
            print(f"[tune] {phase:<8} {fields}: failed {exc!r}"[:300], flush=True)
            continue
        print(
            f"[tune] {phase:<8} {fields}: " + " ".join(f"{r:.3f}x" for r in ratios)
            + f"  worst {max(ratios):.3f}x  bits {'same' if same else 'DIFFER'}"
            + f"  batch1=batchN {'yes' if invariant else 'NO'}",
            flush=True,
        )  # fmt: skip
        if same and invariant and max(ratios) < best[0]:
            best = (max(ratios), fields)
    print(f"[tune] BEST {phase}: {best[1]}  worst ratio {best[0]:.3f}x vs SDPA", flush=True)
    return best[1]


def _tune_backward() -> dict:
    """The backward's candidates against SDPA's backward; the best one's fields (any bits: a
    candidate that changes them states a new backward arithmetic, printed as such)."""
    from isoaudit.kernels.attention import CONFIG, LAUNCH_CANDIDATES
    from isoaudit.kernels.bits import bits_equal

    cases = [_attn_prefill_case(b, n, grad=True) for b, n in ATTN_PREFILL]
    base = [bench(_sdpa_bwd(c), 100) for c in cases]
    want = [_ours_bwd(c)() for c in cases]
    best: tuple[float, dict] = (float("inf"), {})
    for fields in LAUNCH_CANDIDATES["backward"]:
        cfg = CONFIG._replace(**fields)
        try:
            got = [_ours_bwd(c, cfg)() for c in cases]
            same = all(
                bits_equal(a, w) for g, ws in zip(got, want, strict=True) for a, w in zip(g, ws, strict=True)
            )
            ratios = [bench(_ours_bwd(c, cfg), 100) / t for c, t in zip(cases, base, strict=True)]
        except Exception as exc:  # noqa: BLE001
            print(f"[tune] backward {fields}: failed {exc!r}"[:300], flush=True)
            continue
        print(
            f"[tune] backward {fields}: " + " ".join(f"{r:.3f}x" for r in ratios)
            + f"  worst {max(ratios):.3f}x  bits {'same' if same else 'new arithmetic'}",
            flush=True,
        )  # fmt: skip
        if max(ratios) < best[0]:
            best = (max(ratios), fields)
    print(f"[tune] BEST backward: {best[1]}  worst ratio {best[0]:.3f}x vs SDPA", flush=True)
    return best[1]


def _tune_arithmetic(picked: dict, dec: list[dict]) -> None:
    """Each (split, block_n) with the picked launch fields: ratios to SDPA and whether prefill,
    chunked prefill and decode give one set of bits."""
    from isoaudit.kernels.attention import ARITHMETIC_CANDIDATES, CONFIG, attention_modes
    from isoaudit.kernels.bits import bits_equal

    pre = [_attn_prefill_case(b, n) for b, n in ATTN_PREFILL]
    sdpa = [bench(_sdpa_fwd(c, True), 100) for c in pre] + [bench(_sdpa_fwd(c, False), 100) for c in dec]
    hq, hkv, d = ATTN_HEADS
    for split, block_n in ARITHMETIC_CANDIDATES:
        cfg = CONFIG._replace(**picked, split=split, block_n=block_n)
        try:
            n = 2 * split + 100
            torch.manual_seed(0)
            q = torch.randn(n, hq, d, device="cuda").bfloat16()
            k, v = (torch.randn(1, n + 64, hkv, d, device="cuda").bfloat16() for _ in range(2))
            at = sorted(set(range(0, n, 7)) | {split - 1, split, 2 * split - 1, 2 * split, n - 1})
            outs = attention_modes(q, k, v, [1, 63, 200], at, cfg)
            modes = all(bits_equal(o, outs[0]) for o in outs[1:])
            ratios = [
                bench(lambda: attention(*c["ours"], c["kv_len"], config=cfg), 100) / t
                for c, t in zip(pre + dec, sdpa, strict=True)
            ]
        except Exception as exc:  # noqa: BLE001
            print(f"[tune] arithmetic split={split} block_n={block_n}: failed {exc!r}"[:300], flush=True)
            continue
        print(
            f"[tune] arithmetic split={split} block_n={block_n}: prefill "
            + " ".join(f"{r:.3f}x" for r in ratios[: len(pre)]) + "  decode "
            + " ".join(f"{r:.3f}x" for r in ratios[len(pre) :])
            + f"  worst {max(ratios):.3f}x  prefill=chunked=decode {'yes' if modes else 'NO'}",
            flush=True,
        )  # fmt: skip


def bench_attention_tune() -> None:
    """The attention tuning table on the bench's shapes, one bounded pass (~4 min on an H100/H200):
    per phase (prefill, decode, backward) each launch candidate's ratio to SDPA's FlashAttention
    backend timed in the same run, its bits against the shipped configuration and batch 1 against
    batch N; then each arithmetic candidate (split, block_n) with the best launch fields: ratios
    and whether prefill, chunked prefill and decode give one set of bits. Prints the best
    candidate per phase and the resulting ``AttnConfig``. ``ATTN_TUNE_PHASES`` (default
    ``prefill,decode,backward,arithmetic``) runs a subset, e.g. to split the pass in two."""
    from isoaudit.kernels.attention import CONFIG

    phases = os.environ.get("ATTN_TUNE_PHASES", "prefill,decode,backward,arithmetic").split(",")
    pre = [_attn_prefill_case(b, n) for b, n in ATTN_PREFILL]
    dec = [_attn_decode_case(b, n) for b, n in ATTN_DECODE]
    picked = _tune_phase("prefill", pre, True) if "prefill" in phases else {}
    picked |= _tune_phase("decode", dec, False) if "decode" in phases else {}
    del pre
    if "backward" in phases:
        picked |= _tune_backward()
    if "arithmetic" in phases:
        _tune_arithmetic(picked, dec)
    print(
        f"[tune] PICKED (split={CONFIG.split} block_n={CONFIG.block_n}): AttnConfig(**{picked})", flush=True
    )


def _gdn_inputs(b: int, n: int, h: int, d: int, grad: bool = False):
    t = b * n
    q = F.normalize(torch.randn(t, h, d, device="cuda"), dim=-1).bfloat16() * d**-0.5
    k = F.normalize(torch.randn(t, h, d, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(t, h, d, device="cuda").bfloat16()
    g = -torch.rand(t, h, device="cuda") * 0.1
    beta = torch.rand(t, h, device="cuda")
    xs = [x.requires_grad_(grad) for x in (q, k, v, g, beta)]
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * n
    return xs, cu


def bench_gdn() -> None:
    h, d = 16, 128
    for b, n in ((4, 2048), (1, 8192)):
        xs, cu = _gdn_inputs(b, n, h, d, grad=True)
        gout = torch.randn(b * n, h, d, device="cuda")

        def native_fb() -> None:
            o, _ = G.gdn_chunk_reference(*xs, cu, None, G.CHUNK, solve="triangular", state_at="end")
            torch.autograd.grad(o, xs, gout)

        def ours_fb() -> None:
            o = G.gdn_chunk_autograd(*xs, cu)
            torch.autograd.grad(o, xs, gout)

        shape = f"B={b} T={n} H={h} dk=dv={d}"
        record("cpr-gdn trainer fwd+bwd", shape, bench(native_fb, 500), bench(ours_fb, 500), 1.4)
        with torch.no_grad():
            ys = [x.detach() for x in xs]
            record(
                "cpr-gdn prefill",
                shape,
                bench(
                    lambda: G.gdn_chunk_reference(*ys, cu, None, G.CHUNK, solve="triangular", state_at="end")
                ),
                bench(lambda: G.gdn_chunk(*ys, cu)),
                1.6,
            )
    with torch.no_grad():
        for b in (1, 16, 64):
            steps = 2 * G.CHUNK
            xs, _ = _gdn_inputs(b, steps, h, d)
            xs = [x.view(b, steps, *x.shape[1:]) for x in xs]
            slots = torch.arange(b, device="cuda")
            href = torch.zeros(b, h, d, d, device="cuda")
            cache = G.GDNCache.empty(b, h, d, d, torch.bfloat16, torch.device("cuda"))

            def native_dec() -> None:
                for s in range(steps):
                    G.gdn_recurrent_step(*(x[:, s] for x in xs), href)

            def ours_dec() -> None:
                for s in range(steps):
                    GD.gdn_decode_step(*(x[:, s] for x in xs), slots, cache)

            record(
                "cpr-gdn decode (per token)",
                f"B={b} H={h} dk=dv={d}",
                bench(native_dec) / steps,
                bench(ours_dec) / steps,
                1.3,
            )


def _lift_fla_guard(exc: Exception) -> bool:
    """Lift fla's Triton-version guard on its gated backward (fla #640) if ``exc`` is that guard;
    True when lifted."""
    if "#640" not in str(exc):
        return False
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return True


def _fla_ungated_bound(xs, cu, gout, dims, shape: str, ours_fb) -> None:
    """Where fla refuses its gated backward: its ungated delta rule (``chunk_delta_rule``, the same
    kernels without the gate's terms) fwd+bwd on the same inputs, a lower bound on the gated cost,
    so the ratio against it is an upper bound on the ratio against the gated one."""
    from fla.ops.delta_rule import chunk_delta_rule

    b, n, h, d = dims
    q4, k4, v4 = (x.view(b, n, h, d) for x in xs[:3])
    beta4 = xs[4].view(b, n, h)

    def fla_ungated_fb() -> tuple[torch.Tensor, ...]:
        o = chunk_delta_rule(q4, k4, v4, beta4, scale=1.0)[0]
        return torch.autograd.grad(o.reshape(gout.shape), (xs[0], xs[1], xs[2], xs[4]), gout)

    record(
        "cpr-gdn fwd+bwd vs fla ungated (bound)", shape, bench(fla_ungated_fb, 300), bench(ours_fb, 300), 1.4
    )


def bench_gdn_tune() -> None:
    """CPR GDN prefill under other launch configurations: each must give the default's bits
    (they change no bit by design) and the time of each is printed."""

    h, d = 16, 128
    configs = [
        G.GDNConfig(),
        G.GDNConfig(prep_warps=8, out_warps=8),
        G.GDNConfig(state_bv=16),
        G.GDNConfig(state_bv=64),
        G.GDNConfig(prep_nb=128, out_bv=128),
        G.GDNConfig(prep_nb=128, out_bv=128, state_bv=16),
        G.GDNConfig(state_warps=2, state_bv=16),
        G.GDNConfig(prep_warps=8, prep_nb=128, state_warps=2, state_bv=16, out_warps=8, out_bv=128),
        G.GDNConfig(state_warps=8),
        G.GDNConfig(out_bv=32),
        G.GDNConfig(prep_nb=32),
    ]
    base = G.CONFIG
    with torch.no_grad():
        for b, n in ((4, 2048), (1, 8192)):
            xs, cu = _gdn_inputs(b, n, h, d)
            want = None
            for cfg in configs:
                G.CONFIG = cfg
                try:
                    try:
                        got = G.gdn_chunk(*xs, cu)[0]
                    except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
                        print(
                            f"[{TIMING}] gdn tune {dataclasses.astuple(cfg)}: failed: {exc!r}"[:400],
                            flush=True,
                        )
                        continue
                    same = (
                        True
                        if want is None
                        else bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))
                    )
                    want = got if want is None else want
                    ms = bench(lambda: G.gdn_chunk(*xs, cu))
                    print(f"[{TIMING}] gdn tune B={b} T={n} {dataclasses.astuple(cfg)}: {ms:.4f} ms, "
                          f"bits equal to the default: {same}", flush=True)  # fmt: skip
                finally:
                    G.CONFIG = base


def bench_gdn_backward_tune() -> None:
    """The CPR GDN backward (trainer fwd+bwd) under other ``BackwardConfig`` launch parameters:
    the time of each and its gradients' largest relative L2 distance from the default's (block
    widths move the fp32 sums' order, so they agree to rounding, not bit for bit). Each variant
    is a fresh compile; a variant the compiler or the GPU refuses is printed and skipped."""
    from isoaudit.kernels import gdn_backward as GB

    variants = [
        {},
        dict(state_bv=16),
        dict(state_warps=8),
        dict(state_bv=16, state_warps=2),
        dict(query_key_warps=8),
        dict(wy_warps=8),
        dict(bv=32),
        dict(value_bv=128),
        dict(low_precision=False),
    ]
    base = GB.BACKWARD_CONFIG
    h, d = 16, 128
    for b, n in ((4, 2048), (1, 8192)):
        xs, cu = _gdn_inputs(b, n, h, d, grad=True)
        gout = torch.randn(b * n, h, d, device="cuda")

        def fwd_bwd() -> tuple[torch.Tensor, ...]:
            return torch.autograd.grad(G.gdn_chunk_autograd(*xs, cu), xs, gout)

        want = [x.float() for x in fwd_bwd()]
        for var in variants:
            GB.BACKWARD_CONFIG = dataclasses.replace(base, **var)
            try:
                got = fwd_bwd()
                rel = max(float((a.float() - w).norm() / w.norm()) for a, w in zip(got, want, strict=True))
                ms = bench(fwd_bwd, 300)
                print(f"[{TIMING}] gdn backward tune B={b} T={n} {var or 'default'}: {ms:.3f} ms, "
                      f"largest grad rel L2 from the default {rel:.1e}", flush=True)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
                print(f"[{TIMING}] gdn backward tune {var}: failed: {exc!r}"[:300], flush=True)
            finally:
                GB.BACKWARD_CONFIG = base


def bench_fla() -> None:
    """CPR GDN against flash-linear-attention (``fla``, the library users run), where it imports:
    prefill (``chunk_gated_delta_rule``) and trainer fwd+bwd (decode: :func:`bench_fla_decode`). Same
    inputs (q pre-scaled, so fla's scale is 1; log-decay g; beta); fla's output is checked
    against ours by relative L2."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001
        print(f"[{TIMING}] fla not importable: {exc!r}", flush=True)
        return
    h, d = 16, 128
    for b, n in ((4, 2048), (1, 8192)):
        xs, cu = _gdn_inputs(b, n, h, d, grad=True)
        q4, k4, v4 = (x.view(b, n, h, d) for x in xs[:3])
        g4, beta4 = xs[3].view(b, n, h), xs[4].view(b, n, h)
        shape = f"B={b} T={n} H={h} dk=dv={d}"
        with torch.no_grad():
            ours = G.gdn_chunk(*(x.detach() for x in xs), cu)[0]  # (output, end states)
            theirs = chunk_gated_delta_rule(
                q4.detach(), k4.detach(), v4.detach(), g4.detach(), beta4.detach(), scale=1.0
            )[0].reshape(ours.shape)
            rel = float((ours.float() - theirs.float()).norm() / theirs.float().norm())
            print(f"[{TIMING}] fla vs cpr-gdn output rel L2 {shape}: {rel:.2e}", flush=True)
            if TIMING == "eager" and os.environ.get("ISOAUDIT_BENCH_FP64") != "0":
                # the accuracy of both against the fp64 recurrence, once (slow: a Python loop)
                ref = G.gdn_recurrent(*(x.detach() for x in xs), cu, dtype=torch.float64)[0]
                errs = [float((y.double() - ref).norm() / ref.norm()) for y in (ours, theirs)]
                print(f"[{TIMING}] rel L2 to the fp64 recurrence {shape}: cpr-gdn {errs[0]:.2e}, "
                      f"fla {errs[1]:.2e}", flush=True)  # fmt: skip
            record(
                "cpr-gdn prefill vs fla",
                shape,
                bench(lambda: chunk_gated_delta_rule(q4, k4, v4, g4, beta4, scale=1.0)),
                bench(lambda: G.gdn_chunk(*xs, cu)),
                1.6,
            )
        gout = torch.randn(b * n, h, d, device="cuda")

        def fla_fb() -> tuple[torch.Tensor, ...]:
            o = chunk_gated_delta_rule(q4, k4, v4, g4, beta4, scale=1.0)[0]
            return torch.autograd.grad(o.reshape(gout.shape), xs, gout)

        def ours_fb() -> tuple[torch.Tensor, ...]:
            o = G.gdn_chunk_autograd(*xs, cu)
            return torch.autograd.grad(o, xs, gout)

        case = "cpr-gdn fwd+bwd vs fla"
        try:
            fla_fb()
        except RuntimeError as exc:  # fla refuses its gated backward with Triton < 3.7.1 on Hopper (#640)
            # Lifting the guard is opt-in: on the H200 with Triton 3.6 fla's backward then hit an
            # illegal memory access, which ends the process.
            if os.environ.get("ISOAUDIT_BENCH_FLA_LIFT_GUARD") != "1" or not _lift_fla_guard(exc):
                print(f"[{TIMING}] fla backward failed: {exc!r}"[:300], flush=True)
                _fla_ungated_bound(xs, cu, gout, (b, n, h, d), shape, ours_fb)
                continue
            # Time it anyway with the guard lifted: the same kernels fla runs on a fixed Triton
            # (its bug is in the values of one kernel, not in the work), so the time is fla's cost;
            # its gradients are not trusted here, and their distance from ours is printed.
            case = "cpr-gdn fwd+bwd vs fla (fla guard lifted, #640)"
            print(
                f"[{TIMING}] fla refused its backward ({str(exc)[:90]}...); timing it with the guard lifted",
                flush=True,
            )
        rels = [
            float((a.float() - b_.float()).norm() / b_.float().norm())
            for a, b_ in zip(fla_fb(), ours_fb(), strict=True)
        ]
        print(f"[{TIMING}] fla vs cpr-gdn gradient rel L2 (q, k, v, g, beta) {shape}: "
              + " ".join(f"{r:.1e}" for r in rels), flush=True)  # fmt: skip
        record(case, shape, bench(fla_fb, 300), bench(ours_fb, 300), 1.4)


def _with_slack(x: torch.Tensor, slack_bytes: int = 1 << 20) -> torch.Tensor:
    """A contiguous copy of ``x`` followed by ``slack_bytes`` of its own allocation."""
    buf = torch.zeros(x.numel() + slack_bytes // x.element_size(), dtype=x.dtype, device=x.device)
    return buf[: x.numel()].view(x.shape).copy_(x)


def _fla_step():
    """fla's ``fused_recurrent_gated_delta_rule``, or None (printed) where fla does not import."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as exc:  # noqa: BLE001
        print(f"[{TIMING}] fla not importable: {exc!r}", flush=True)
        return None
    return fused_recurrent_gated_delta_rule


def _fla_decode_calls(fla_step, b: int, h: int, d: int, steps: int = 16) -> list:
    """fla's decode steps at batch ``b``, one call a token, its inputs made contiguous (with slack
    after each: on the H200 fla's step hit illegal memory accesses at B=64 in some processes and
    not others, where its tensors end a CUDA allocation, it seems) outside the timed calls."""
    xs, _ = _gdn_inputs(b, steps, h, d)
    xs = [x.view(b, steps, *x.shape[1:]) for x in xs]
    per_step = [[_with_slack(x[:, s_ : s_ + 1]) for x in xs] for s_ in range(steps)]
    state = _with_slack(torch.zeros(b, h, d, d, device="cuda"))
    return [
        lambda q_=q_, k_=k_, v_=v_, g_=g_, b_=b_: fla_step(
            q_, k_, v_, g_, b_, scale=1.0, initial_state=state, output_final_state=True
        )
        for q_, k_, v_, g_, b_ in per_step
    ]


def _ours_decode_calls(b: int, h: int, d: int, launch=None, steps: int = 16) -> list:
    """CPR GDN decode steps at batch ``b``, one call a token (``launch``: the table's unless
    given); replays walk the open chunk through all its rows and boundaries."""
    xs, _ = _gdn_inputs(b, steps, h, d)
    xs = [x.view(b, steps, *x.shape[1:]) for x in xs]
    slots = torch.arange(b, device="cuda")
    cache = G.GDNCache.empty(b, h, d, d, torch.bfloat16, torch.device("cuda"))
    return [
        lambda s_=s_: GD.gdn_decode_step(*(x[:, s_] for x in xs), slots, cache, launch=launch)
        for s_ in range(steps)
    ]


def bench_fla_decode() -> None:
    """CPR GDN decode per token (the table's launch) against fla's
    ``fused_recurrent_gated_delta_rule`` one step at a time, the two measured alike
    (:func:`bench_pair`). Run last: fla's step once ended the process with an illegal memory
    access (:func:`_fla_decode_calls`)."""
    fla_step = _fla_step()
    if fla_step is None:
        return
    h, d = 16, 128
    with torch.no_grad():
        for b in (1, 16, 64):
            ours = _ours_decode_calls(b, h, d)
            native, mine = bench_pair(_fla_decode_calls(fla_step, b, h, d), ours)
            record("cpr-gdn decode vs fla (per token)", f"B={b} H={h} dk=dv={d}", native, mine, 1.2)


def _decode_bits_equal_chunk(b: int, h: int, d: int, launch, steps: int = 70) -> bool:
    """``steps`` decode steps of ``b`` sequences from an empty cache under ``launch`` (across a
    chunk boundary) against the chunk form on the same tokens, bit for bit."""
    xs, cu = _gdn_inputs(b, steps, h, d)
    want = G.gdn_chunk(*xs, cu)[0]
    seq = [x.view(b, steps, *x.shape[1:]) for x in xs]
    slots = torch.arange(b, device="cuda", dtype=torch.int32)
    cache = G.GDNCache.empty(b, h, d, d, torch.bfloat16, torch.device("cuda"))
    got = torch.stack(
        [GD.gdn_decode_step(*(x[:, s_] for x in seq), slots, cache, launch=launch) for s_ in range(steps)], 1
    )
    return bool(torch.equal(got.reshape(want.shape).view(torch.int32), want.view(torch.int32)))


def bench_fla_decode_tune() -> None:
    """Every candidate decode launch (``gdn_decode.DECODE_CANDIDATES``) at B = 1, 4, 16, 64: its
    bits against the chunk form's (70 steps from an empty cache, then 16 more per timing) and its
    time per token; then, after all of ours (fla's step once ended the process), fla's step
    against the best candidate and against the table's launch, each pair measured alike
    (:func:`bench_pair`). Judged under graph timing, as a captured decode step runs."""
    h, d = 16, 128
    batches = (1, 4, 16, 64)
    ours: dict[int, dict] = {}
    with torch.no_grad():
        for b in batches:
            ours[b] = {}
            for launch in GD.DECODE_CANDIDATES:
                try:
                    same = _decode_bits_equal_chunk(b, h, d, launch)
                    ms = bench_calls(_ours_decode_calls(b, h, d, launch))
                except Exception as exc:  # noqa: BLE001 - a launch the compiler refuses
                    print(f"[{TIMING}] gdn decode tune B={b} {launch}: failed: {exc!r}"[:300], flush=True)
                    continue
                print(f"[{TIMING}] gdn decode tune B={b} {launch}: {ms * 1e3:8.2f} us/token, "
                      f"bits equal to the chunk form: {same}", flush=True)  # fmt: skip
                if same:
                    ours[b][launch] = ms
        fla_step = _fla_step()
        if fla_step is None:
            return
        for b in batches:
            if not ours[b]:
                continue
            best = min(ours[b], key=ours[b].get)
            table = GD.decode_launch(b)
            for name, launch in (("best", best), ("table", table)):
                native, mine = bench_pair(
                    _fla_decode_calls(fla_step, b, h, d), _ours_decode_calls(b, h, d, launch)
                )
                record(f"cpr-gdn decode vs fla, {name} {launch.bv}/{launch.warps}/{launch.stages}",
                       f"B={b} H={h} dk=dv={d}", native, mine, 1.2)  # fmt: skip
                if best == table:
                    break


def bench_tree() -> None:
    """The TP-invariant tree GEMM against a shard matmul at TP 1 and 2, ranks simulated on this GPU:
    per rank, native = its K shard's cuBLAS matmul plus, at TP 2, the bf16 add
    an all-reduce performs; invariant = its subtree's root and the add of the two roots with the
    one rounding (the all-gather's arithmetic), at TP 1 the whole ``tree_gemm``. Communication
    itself is not timed (one GPU). Plans are (leaf, max_tp), shared by both sides: the default
    (256, 8) and wide plans (one leaf per group) for jobs whose largest TP is 2, 4 or 8; "register"
    forces every call through the register kernel (the path all plans took before)."""
    from isoaudit.kernels import tree_gemm as tree_fn
    from isoaudit.kernels.tree_gemm import WIDE, reduce_roots, subtree_root, tree_plan

    tg = sys.modules["isoaudit.kernels.tree_gemm"]
    n = 4096
    plans = [  # (label, leaf, max_tp, GEMM_PATH)
        ("leaf=256 max_tp=8 register", 256, 8, False),
        ("leaf=256 max_tp=8", 256, 8, True),
        ("wide max_tp=2", WIDE, 2, True),
        ("wide max_tp=4", WIDE, 4, True),
        ("wide max_tp=8 register", WIDE, 8, False),
        ("wide max_tp=8", WIDE, 8, True),
    ]
    for m in (256, 2048):
        for k in (4096, 14336):
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
            for tp in (1, 2):
                shard = k // tp
                xs, ws = x[:, :shard].contiguous(), w[:, :shard].contiguous()
                other = torch.randn(m, n, device="cuda").bfloat16()

                def native() -> torch.Tensor:
                    y = xs @ ws.T
                    return y if tp == 1 else y + other

                base = bench(native)
                for label, leaf, max_tp, gemm_path in plans:
                    plan = tree_plan(k, leaf, tp, max_tp)
                    lo, hi = plan.k_range(0)
                    xl, wl = x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous()
                    peer = torch.randn(m, n, device="cuda")

                    def ours() -> torch.Tensor:
                        if tp == 1:
                            return tree_fn(xl, wl, leaf=leaf, tp=1, max_tp=max_tp)
                        return reduce_roots([subtree_root(xl, wl, plan, 0), peer], torch.bfloat16)

                    tg.GEMM_PATH = gemm_path
                    try:
                        record(f"tree gemm tp={tp} {label}", f"M={m} N={n} K={k}", base, bench(ours), 1.5)
                    except Exception as exc:  # noqa: BLE001 - a plan the kernel refuses
                        print(f"[{TIMING}] tree gemm tp={tp} {label} M={m} K={k}: {exc!r}"[:200], flush=True)
                    finally:
                        tg.GEMM_PATH = True


def bench_moe() -> None:
    """The MoE layer (router + experts + combine) with the kernels on, against the same HF Qwen3-MoE
    block on its native grouped-GEMM experts (``torch._grouped_mm``), same weights.
    Rows: the fast path (fused router epilogue, counting sort, SiLU*up in the gate-up GEMM's
    epilogue), the same with SiLU*up as its own launch (``ISOAUDIT_MOE_GLU=0``), and the host-table
    path (``ISOAUDIT_MOE_FAST=0``); each line also gives the GPU kernels one forward launches and
    whether its output equals the host-table path's bit for bit."""
    import os

    from torch.profiler import ProfilerActivity, profile

    from bench.moe import sparse_block
    from isoaudit import kernels

    def launches(fn) -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)

    variants = [("moe layer", {}), ("moe layer, GLU 8 warps", {"ISOAUDIT_MOE_GLU_WARPS": "8"})]
    variants.append(("moe layer, GLU launch", {"ISOAUDIT_MOE_GLU": "0"}))
    variants.append(("moe layer, host tables", {"ISOAUDIT_MOE_FAST": "0"}))
    for h, i, e, k, t in [(2048, 768, 128, 8, t) for t in (128, 1024, 4096)] + [(1024, 512, 16, 4, 2048)]:
        block = sparse_block(h, i, e, k, torch.bfloat16, "cuda")
        x = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16)
        shape = f"T={t} H={h} E={e} k={k} I={i}"
        with torch.no_grad():
            block.experts.config._experts_implementation = "grouped_mm"
            with kernels.disable():
                native = bench(lambda: block(x))
                n_native = launches(lambda: block(x))
            outs = []
            for case, env in variants:
                saved = {name: os.environ.get(name) for name in env}
                os.environ.update(env)
                try:
                    with kernels.enable():
                        ours = bench(lambda: block(x))
                        n_ours = launches(lambda: block(x))
                        outs.append(block(x))
                finally:
                    for name, v in saved.items():
                        if v is None:
                            os.environ.pop(name, None)
                        else:
                            os.environ[name] = v
                record(case, shape, native, ours, target=1.4 if not env else None)
                print(f"    kernels per forward: native {n_native}, invariant {n_ours}", flush=True)
            same = [bool(torch.equal(o.view(torch.int16), outs[-1].view(torch.int16))) for o in outs[:-1]]
            print(f"    bitwise equal to the host-table path: {same}", flush=True)


#: FP8 shapes: decode (M <= 256) and prefill (M >= 2048) on the 0.5B (Qwen2.5-0.5B: 896 hidden,
#: 4864 MLP, q+k+v = 1152) and 8B (Llama-3-8B: 4096 hidden, q+k+v = 6144, 14336 MLP) projections.
FP8_SHAPES = [
    (1152, 896),
    (896, 896),
    (9728, 896),
    (896, 4864),
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
]
FP8_MS = (1, 64, 256, 2048, 4096)
#: The sweep's row counts: each of the tile table's rows (M <= 64, <= 256, larger) gets several.
FP8_TUNE_MS = (1, 16, 64, 128, 256, 2048, 4096)
#: The sweep stops starting new (shape, M) cases after this many seconds (it prints what it skipped).
FP8_TUNE_BUDGET_S = float(os.environ.get("ISOAUDIT_FP8_TUNE_BUDGET_S", "220"))


def _fp8_operands(n: int, k: int, m_max: int):
    """Weight copies (bf16 masters, block-FP8, row-wise FP8 for ``torch._scaled_mm``) cycled past L2,
    and activations in each form."""
    from isoaudit.kernels.fp8_quant import FP8, quantize_act, quantize_weight

    ws = _weight_copies(n, k)
    blocks = [quantize_weight(w) for w in ws]
    rowwise = []
    for w in ws:
        s = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        rowwise.append(((w.float() / s).clamp(-448, 448).to(FP8), s.reshape(1, n)))
    x = torch.randn(m_max, k, device="cuda").bfloat16()
    xq, xs = quantize_act(x)
    sx = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    xr = (x.float() / sx).clamp(-448, 448).to(FP8)
    return ws, blocks, rowwise, x, (xq, xs), (xr, sx)


def _scaled_mm_fn(xr, sx, wr, sw):
    return lambda: torch._scaled_mm(xr, wr.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def _fp8_policy_search(cases: list[dict], table_rows: tuple[int, ...], sms: int):
    """The tile table that fits the measured ``cases`` best: per row (the M bounds of
    ``table_rows``), the ordered list of at most 3 candidate tiles whose picks (:func:`pick_tile`'s
    fill rule) minimise the worst, then the mean, ratio to the fastest candidate of each case."""
    import itertools

    from isoaudit.kernels import fp8 as F8

    rows, lo = [], 0
    for max_m in table_rows:
        mine = [c for c in cases if c["m"] > lo and (max_m == 0 or c["m"] <= max_m)]
        lo = max_m
        if not mine:
            continue
        best_cost, best_list = None, None
        cands = [t for t in F8.TILE_CANDIDATES if all(t in c["times"] for c in mine)]
        for r in (1, 2, 3):
            for lst in itertools.permutations(cands, r):
                ratios = []
                for c in mine:
                    t = F8.pick_tile(c["m"], c["n"], c["k"], sms, table=((0, lst),))
                    ratios.append(c["times"][t] / c["best_inv"])
                cost = (max(ratios), sum(ratios) / len(ratios), r)
                if best_cost is None or cost < best_cost:
                    best_cost, best_list = cost, lst
        rows.append((max_m, best_list))
    return tuple(rows)


def bench_fp8_tune() -> None:
    """One bounded sweep of the invariant W8A8 GEMM's tiles (graph timing, pre-quantized operands,
    weights cycled past L2): per (shape, M), every tile of ``TILE_CANDIDATES`` with the weight's
    split against ``torch._scaled_mm`` (row-wise scales) and the block-FP8 baseline (the fastest
    candidate with or without the split: free to change split with M); every candidate's rows at M
    checked against the first candidate's 4096-row result (bits across tiles; bf16 out, the timed
    kernels: the fp32-out proof is ``tests/kernels/test_fp8_tiles.py``'s). Ends with
    the shipped table's picks, the table that fits the measurements (``TILE_TABLE`` literal) and its
    picks against both targets (<= 1.3x ``_scaled_mm``, <= 1.2x the baseline)."""
    import time

    from isoaudit.kernels import fp8 as F8
    from isoaudit.kernels.bits import bits_equal

    global TIMING
    saved, TIMING = TIMING, "graph"
    t_start = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases: list[dict] = []
    skipped: list[str] = []
    bits_bad: list[str] = []
    for n, k in FP8_SHAPES:
        if time.perf_counter() - t_start > FP8_TUNE_BUDGET_S:
            skipped.append(f"N={n} K={k} (all M)")
            continue
        ws, blocks, rowwise, x, (xq, xs), (xr, sx) = _fp8_operands(n, k, max(FP8_TUNE_MS))
        split = F8.weight_split(n, k)
        q0, s0 = blocks[0]
        want = F8.w8a8_gemm(xq, xs, q0, s0, config=F8.TILE_CANDIDATES[0].with_split(split))
        for m in FP8_TUNE_MS:
            if time.perf_counter() - t_start > FP8_TUNE_BUDGET_S:
                skipped.append(f"N={n} K={k} M={m}")
                continue
            try:
                t_smm = bench_calls([_scaled_mm_fn(xr[:m], sx[:m], wr, sw) for wr, sw in rowwise])
            except Exception as e:  # noqa: BLE001 - a shape _scaled_mm refuses: no ratio to it
                print(f"    _scaled_mm N={n} K={k} M={m}: {e!r}"[:200], flush=True)
                t_smm = float("nan")
            times: dict = {}
            free: dict = {}
            for tile in F8.TILE_CANDIDATES:
                for ks in sorted({split, 0}):
                    cfg = tile.with_split(ks)
                    try:
                        if ks == split:
                            y = F8.w8a8_gemm(xq[:m], xs[:m], q0, s0, config=cfg)
                            if not bits_equal(y, want[:m]):
                                bits_bad.append(f"{tile.tag} N={n} K={k} M={m}")
                        t = bench_calls(
                            [
                                lambda q=q, s=s: F8.w8a8_gemm(xq[:m], xs[:m], q, s, config=cfg)
                                for q, s in blocks
                            ]
                        )
                    except Exception as e:  # noqa: BLE001 - out of shared memory, no compile, ...
                        print(
                            f"    {tile.tag} k{ks} N={n} K={k} M={m}: {type(e).__name__}: {e}"[:200],
                            flush=True,
                        )
                        continue
                    free[(tile, ks)] = t
                    if ks == split:
                        times[tile] = t
            if not times:
                continue
            best_inv = min(times.values())
            base = min(free.values())
            pick = F8.pick_tile(m, n, k, sms)
            case = dict(n=n, k=k, m=m, smm=t_smm, base=base, best_inv=best_inv, times=times, pick=pick)
            cases.append(case)
            order = sorted(times, key=times.get)
            print(
                f"fp8-tune N={n} K={k} M={m}: scaled_mm {t_smm * 1e3:.1f}us  block-fp8 {base * 1e3:.1f}us  "
                + "  ".join(f"{t.tag} {times[t] / t_smm:.2f}x" for t in order)
                + f"  | shipped {pick.tag} {times.get(pick, float('nan')) / t_smm:.2f}x smm"
                f" {times.get(pick, float('nan')) / base:.2f}x base",
                flush=True,
            )
    TIMING = saved
    bounds = tuple(row[0] for row in F8.TILE_TABLE)
    best = _fp8_policy_search(cases, bounds, sms)
    print(
        f"\nfp8-tune bits across tiles: {'all equal' if not bits_bad else 'DIFFER: ' + ', '.join(bits_bad)}"
    )
    if skipped:
        print(f"fp8-tune over its {FP8_TUNE_BUDGET_S:.0f} s budget, not measured: {', '.join(skipped)}")
    print(f"fp8-tune ({sms} SMs) recommended table (paste into kernels/fp8.py):\nTILE_TABLE = (")
    for max_m, tiles in best:
        print(f"    ({max_m}, ({''.join(t.source + ', ' for t in tiles)})),")
    print(")")
    if len(best) != len(F8.TILE_TABLE):
        print("    (rows without measurements dropped: keep the shipped rows for them)")
        return
    met = 0
    for c in cases:
        shipped = c["times"].get(c["pick"], float("nan"))
        rec = F8.pick_tile(c["m"], c["n"], c["k"], sms, table=best)
        t = c["times"][rec]
        ok = not t / c["smm"] > 1.3 and t / c["base"] <= 1.2  # no _scaled_mm time: the baseline alone
        met += ok
        print(
            f"  N={c['n']:>5} K={c['k']:>5} M={c['m']:>4}: shipped {c['pick'].tag:<14} "
            f"{shipped / c['smm']:.2f}x smm {shipped / c['base']:.2f}x base | recommended {rec.tag:<14} "
            f"{t / c['smm']:.2f}x smm {t / c['base']:.2f}x base {'met' if ok else 'MISSED'}",
            flush=True,
        )
    print(f"fp8-tune: recommended table meets both targets in {met} of {len(cases)} cases")


def bench_fp8() -> None:
    """The invariant W8A8 GEMM (its shipped tile policy: the tile of ``TILE_TABLE`` for each M, the
    weight's split) against the FP8 GEMMs a user would pick, each measured in this run on the same
    weights cycled past L2: ``torch._scaled_mm`` (cuBLASLt/CUTLASS FP8, row-wise scales), the
    M-tuned block-FP8 Triton baseline (the fastest of ``TILE_CANDIDATES`` with or without the split,
    per M: the same arithmetic, free to change tile and split with M), and bf16 cuBLAS
    (``F.linear`` on the bf16 masters). GEMM rows take pre-quantized operands; "linear" adds the
    per-token-group activation quantization (bf16 in, bf16 out). Every candidate's rows at M are
    checked against its own 4096-row result (bits), and the policy's against its 4096-row result."""
    from isoaudit.kernels import fp8 as F8
    from isoaudit.kernels.bits import bits_equal

    for n, k in FP8_SHAPES:
        ws, blocks, rowwise, x, (xq, xs), (xr, sx) = _fp8_operands(n, k, max(FP8_MS))
        split = F8.weight_split(n, k)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        cands = {}
        for tile in F8.TILE_CANDIDATES:
            for ks in sorted({0, split}):
                cands[f"{tile.tag}k{ks}"] = tile.with_split(ks)
        wants = {tag: F8.w8a8_gemm(xq, xs, *blocks[0], config=cfg) for tag, cfg in cands.items()}
        want = F8.w8a8_gemm(xq, xs, *blocks[0])
        cross = [t for t, cfg in cands.items() if cfg.k_split == split and not bits_equal(wants[t], want)]
        print(
            f"    N={n} K={k}: every tile with the weight's split gives the policy's 4096-row bits: "
            f"{'yes' if not cross else 'NO: ' + ', '.join(cross)}",
            flush=True,
        )
        totals = dict.fromkeys(cands, 0.0)
        for m in FP8_MS:
            shape = f"M={m} N={n} K={k}"
            assert bits_equal(F8.w8a8_gemm(xq[:m], xs[:m], *blocks[0]), want[:m]), shape
            ours = [lambda q=q, s=s: F8.w8a8_gemm(xq[:m], xs[:m], q, s) for q, s in blocks]
            smm = [_scaled_mm_fn(xr[:m], sx[:m], wr, sw) for wr, sw in rowwise]
            try:
                t_smm, t_ours = bench_pair(smm, ours)
                record("fp8 gemm vs _scaled_mm", shape, t_smm, t_ours, 1.3)
            except Exception as e:  # noqa: BLE001 - a shape _scaled_mm refuses
                print(f"[{TIMING}] fp8 gemm vs _scaled_mm {shape}: {e!r}"[:200], flush=True)
                t_ours = bench_calls(ours)
            best, best_tag, bad = float("inf"), "", []
            for tag, cfg in cands.items():
                if not bits_equal(F8.w8a8_gemm(xq[:m], xs[:m], *blocks[0], config=cfg), wants[tag][:m]):
                    bad.append(tag)
                t = bench_calls(
                    [lambda q=q, s=s: F8.w8a8_gemm(xq[:m], xs[:m], q, s, config=cfg) for q, s in blocks]
                )
                totals[tag] += t / t_ours
                if t < best:
                    best, best_tag = t, tag
            record("fp8 gemm vs block-fp8 best", shape, best, t_ours, 1.2)
            print(
                f"    policy tile {F8.pick_tile(m, n, k, sms).tag}k{split}; block-fp8 baseline: {best_tag}"
                f"{'; BITS DIFFER at M: ' + ','.join(bad) if bad else ''}",
                flush=True,
            )
            lin = [lambda w=w: F8.fp8_linear(x[:m], w) for w in ws]
            t_bf16, t_lin = bench_pair([lambda w=w: F.linear(x[:m], w) for w in ws], lin)
            record("fp8 linear vs bf16 cuBLAS", shape, t_bf16, t_lin)
        ranked = sorted(totals.items(), key=lambda kv: kv[1])[:3]
        print(
            f"    N={n} K={k}: best single tiles over all M (mean time / the policy's): "
            + ", ".join(f"{t} {v / len(FP8_MS):.2f}" for t, v in ranked),
            flush=True,
        )


def bench_fp8_host() -> None:
    """Host microseconds per call at M = 1 (cached launches, no sync; eager only): the invariant
    linear with the activation quantizer fused into the GEMM (``fuse_quant=True``: one launch;
    not the default, see ``fp8.FUSE_MAX_M``), the same linear with the quantizer kernel then the
    GEMM (``fuse_quant=False``: the default path, same run), the GEMM alone on pre-quantized
    operands, ``F.linear`` and ``torch._scaled_mm``. The fused and unfused results are checked
    equal bit for bit first."""
    from isoaudit.kernels import fp8 as F8
    from isoaudit.kernels.bits import bits_equal

    for n, k in ((896, 896), (4096, 4096)):
        ws, blocks, rowwise, x, (xq, xs), (xr, sx) = _fp8_operands(n, k, 1)
        w, (wr, sw) = ws[0], rowwise[0]
        same = bits_equal(F8.fp8_linear(x, w, fuse_quant=True), F8.fp8_linear(x, w, fuse_quant=False))
        nat = host_us(lambda: F.linear(x, w))
        smm = host_us(_scaled_mm_fn(xr, sx, wr, sw))
        fused = host_us(lambda: F8.fp8_linear(x, w, fuse_quant=True))
        unfused = host_us(lambda: F8.fp8_linear(x, w, fuse_quant=False))
        gemm_only = host_us(lambda: F8.w8a8_gemm(xq, xs, *blocks[0]))
        print(
            f"[host] fp8 linear M=1 N={n} K={k}: F.linear {nat:.1f} us  _scaled_mm {smm:.1f} us  "
            f"invariant linear, fused quant (one launch) {fused:.1f} us  unfused (quant + GEMM) "
            f"{unfused:.1f} us  (GEMM alone {gemm_only:.1f} us)  target <= 25 us: "
            f"{'met' if fused <= 25.0 else 'MISSED'}; fused bits == unfused: {'yes' if same else 'NO'}",
            flush=True,
        )
        record("host us/call fp8 linear", f"M=1 N={n} K={k}", nat / 1e3, fused / 1e3, 25.0 / nat)
        record("host us/call fp8 unfused", f"M=1 N={n} K={k}", nat / 1e3, unfused / 1e3)


#: ``fp8_fused``'s row counts: decode to prefill sizes.
FP8_FUSED_MS = (1, 16, 64, 128, 256, 512, 2048)
FP8_FUSED_SHAPES = [(1152, 896), (4864, 896), (896, 4864), (4096, 4096), (28672, 4096), (4096, 14336)]


def bench_fp8_fused() -> None:
    """Device time (use @graph) of the invariant linear with the activation quantizer fused into
    the GEMM (``fuse_quant=True``) against the quantizer kernel then the GEMM, per M (what a
    ``FUSE_MAX_M`` above 0 would trade: the fused GEMM quantizes each row block once per column tile),
    weights cycled past L2, bf16 in and out; each pair checked equal bit for bit."""
    from isoaudit.kernels import fp8 as F8
    from isoaudit.kernels.bits import bits_equal

    print(f"    FUSE_MAX_M = {F8.FUSE_MAX_M}", flush=True)
    for n, k in FP8_FUSED_SHAPES:
        ws = _weight_copies(n, k)
        x = torch.randn(max(FP8_FUSED_MS), k, device="cuda").bfloat16()
        for m in FP8_FUSED_MS:
            shape = f"M={m} N={n} K={k}"
            same = bits_equal(
                F8.fp8_linear(x[:m], ws[0], fuse_quant=True), F8.fp8_linear(x[:m], ws[0], fuse_quant=False)
            )
            fused = [lambda w=w: F8.fp8_linear(x[:m], w, fuse_quant=True) for w in ws]
            unfused = [lambda w=w: F8.fp8_linear(x[:m], w, fuse_quant=False) for w in ws]
            t_unfused, t_fused = bench_pair(unfused, fused)
            record("fp8 fused vs unfused quant", shape, t_unfused, t_fused)
            if not same:
                print(f"    {shape}: FUSED BITS DIFFER from quantize + GEMM", flush=True)


#: ``fp8_moe``'s MoE (a 64-expert top-8 layer, hidden 2048, expert intermediate 768) and its token
#: counts: decode (1 to 16 tokens, 8 to 128 routed rows) and prefill (2048 tokens, 16384 rows).
FP8_MOE = (2048, 768, 64, 8)
FP8_MOE_TOKENS = (1, 4, 16, 128, 2048)


def bench_fp8_moe() -> None:
    """The ``invariant-fp8`` mode's MoE experts (gate-up, SiLU * up, down, every (token, slot) row
    back in routing order; bf16 in and out) through the FP8 grouped GEMM's host-sync-free path
    (``fp8_grouped.expert_outputs_fast``: sort, gather-quantize, two grouped launches) against
    (a) the per-expert loop of ``fp8_linear`` (what the mode runs with ``ISOAUDIT_MOE_GROUPED=0``;
    here with each expert's rows found beforehand, so the loop is capturable) and (b) a loop of
    ``torch._scaled_mm`` per expert with row-wise scales (activations per token, weights per output
    row, quantized by torch ops in the loop: what a user would write). Same weights, same routing;
    the grouped result is checked against (a) bit for bit. Use ``@graph`` for device time;
    ``@eager`` adds the host's (the loops launch about 8 kernels per routed expert). Host us per
    call of the grouped path is printed too."""
    from isoaudit.kernels import fp8 as F8
    from isoaudit.kernels import fp8_grouped as FG
    from isoaudit.kernels.bits import bits_equal
    from isoaudit.kernels.elementwise import silu
    from isoaudit.kernels.fp8_quant import FP8

    h, inter, n_exp, top_k = FP8_MOE
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(n_exp, 2 * inter, h, device="cuda", generator=g) / h**0.5).bfloat16()
    down = (torch.randn(n_exp, h, inter, device="cuda", generator=g) / inter**0.5).bfloat16()
    gu_views, dn_views = list(gate_up.unbind(0)), list(down.unbind(0))  # fp8_weight's cache keys
    FG.fp8_experts(gate_up)  # the grouped path's E4M3 copies, made before any timing
    FG.fp8_experts(down)

    def rowwise(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = a.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        return (a.float() / s).clamp(-448, 448).to(FP8), s

    w_rows = []
    for e in range(n_exp):
        (gq, gs), (dq, ds) = rowwise(gu_views[e]), rowwise(dn_views[e])
        w_rows.append((gq, gs.reshape(1, -1), dq, ds.reshape(1, -1)))
    for t in FP8_MOE_TOKENS:
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        flat = torch.rand(t, n_exp, device="cuda", generator=g).topk(top_k, dim=1).indices.reshape(-1)
        s = t * top_k
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=n_exp).tolist()
        plan, lo = [], 0
        for e, c in enumerate(counts):
            if c:
                rows = order[lo : lo + c]
                plan.append((e, rows, rows // top_k))
            lo += c

        def ours() -> torch.Tensor:
            return FG.expert_outputs_fast(x, flat, top_k, gate_up, down)

        def per_expert() -> torch.Tensor:
            out = torch.empty(s, h, dtype=x.dtype, device="cuda")
            for e, rows, tok in plan:
                gu = F8.fp8_linear(x[tok], gu_views[e])
                out[rows] = F8.fp8_linear(silu(gu[:, :inter]) * gu[:, inter:], dn_views[e])
            return out

        def scaled_mm() -> torch.Tensor:
            out = torch.empty(s, h, dtype=x.dtype, device="cuda")
            for e, rows, tok in plan:
                gq, gs, dq, ds = w_rows[e]
                xq, xs = rowwise(x[tok])
                gu = torch._scaled_mm(xq, gq.t(), scale_a=xs, scale_b=gs, out_dtype=torch.bfloat16)
                hq, hs = rowwise(F.silu(gu[:, :inter]) * gu[:, inter:])
                out[rows] = torch._scaled_mm(hq, dq.t(), scale_a=hs, scale_b=ds, out_dtype=torch.bfloat16)
            return out

        shape = f"T={t} rows={s} E={n_exp} k={top_k} H={h} I={inter}"
        same = bits_equal(ours(), per_expert())
        print(
            f"    {shape}: {len(plan)} experts routed; grouped bits == per-expert fp8_linear: "
            f"{'yes' if same else 'NO'}; host us/call grouped {host_us(ours, 50):.1f}",
            flush=True,
        )
        t_loop, t_ours = bench_pair([per_expert], [ours])
        record("fp8 moe vs fp8_linear loop", shape, t_loop, t_ours)
        try:
            t_smm, t_ours = bench_pair([scaled_mm], [ours])
            record("fp8 moe vs _scaled_mm loop", shape, t_smm, t_ours)
        except Exception as e:  # noqa: BLE001 - a shape _scaled_mm refuses
            torch.cuda.synchronize()
            print(f"[{TIMING}] fp8 moe vs _scaled_mm loop {shape}: {e!r}"[:200], flush=True)


#: ``--only all``: every figure this bench reports, each under the timing it is judged by (device
#: time in graph replay for the kernels a decode step captures, wall time for the host, the
#: trainer, the engine and the library comparisons), in one run.
ALL = (
    "launch@eager,gemm_small@graph,tree@graph,engine@eager,trainer@eager,gemm@graph,attention@eager,"
    "fla@eager,fla_decode@graph,gdn@eager,rmsnorm@eager,fingerprint@eager,moe@eager,logprobs@eager"
)


def _passes(only: str, timings: str) -> list[tuple[str, str]]:
    """(bench, timing) pairs in order: ``name@timing`` runs under that timing, a plain name under
    each of ``--timing``; ``all`` is :data:`ALL`."""
    passes = []
    entries = [e for part in only.split(",") for e in (ALL.split(",") if part == "all" else [part])]
    for entry in entries:
        name, _, timing = entry.partition("@")
        for t in [timing] if timing else timings.split(","):
            if t not in ("eager", "graph"):
                sys.exit(f"--timing: eager or graph, not {t!r}")
            if f"bench_{name}" not in globals():
                sys.exit(f"--only: no bench named {name!r}")
            passes.append((name, t))
    return passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--only",
        default="launch,gemm,gemm_small,rmsnorm,attention,gdn,fingerprint,moe,fla,fla_decode",
        help="benches, each optionally @eager or @graph; 'all': every issue-20 figure in one run",
    )
    ap.add_argument("--timing", default="eager", help="eager, graph, or eager,graph")
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=None, help="gemm_small's (N, K) weights, e.g. 896x4864,1024x4096")
    ap.add_argument("--ms", default=None, help="gemm_small's row counts, e.g. 1,256,512,1024")
    ap.add_argument("--tune-ms", default=None, help="tune_small's row counts, e.g. 128,256,512")
    ap.add_argument("--profile", action="store_true", help="profile the invariant trainer step")
    args = ap.parse_args()
    global TIMING, PROFILE, TUNE_MS, SMALL_MS
    PROFILE = args.profile
    if args.ms:
        SMALL_MS = tuple(int(v) for v in args.ms.split(","))
    if args.tune_ms:
        TUNE_MS = tuple(int(v) for v in args.tune_ms.split(","))
    if args.shapes:
        SMALL_M_SHAPES[:] = [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs CUDA")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    import time

    for name, TIMING in _passes(args.only, args.timing):
        t0 = time.perf_counter()
        globals()[f"bench_{name}"]()
        print(f"({name} @{TIMING}: {time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1))
    print("\nsummary (invariant/native):")
    for r in ROWS:
        print(f"  [{r['timing']}] {r['case']:<28} {r['shape']:<34} {r['ratio']:.3f}x")


if __name__ == "__main__":
    main()
