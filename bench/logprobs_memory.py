"""The trainer's token-logprob head, forward + backward: peak memory and time of the fused
invariant path (one pass over vocabulary slabs per row block) against the head that keeps its fp32
logits (the invariant path before fusion) and against the native head given the same chunking,
all measured in the same run.

    python bench/logprobs_memory.py                      # CUDA: 32,768 tokens, hidden 896, vocab 151,936
    python bench/logprobs_memory.py --device cpu         # small shapes on the CPU (structure, not figures)
    python bench/logprobs_memory.py --tokens 65536 --json out.json

Inputs: hidden rows (bf16 on CUDA, fp32 on the CPU) that need a gradient, the lm_head weight (needs a
gradient), random tokens; the loss is the sum of the token logprobs times a random upstream
gradient. Peak memory is what the step allocates above its inputs (CUDA: the allocator's peak;
CPU: the resident-set peak of a fresh process per path). Time is the median wall time of a
synchronised step. Targets: fused peak <= 40% of the kept-logits peak; fused time <= 1.05x the
native chunked path's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATHS = ("kept_logits", "fused", "native_chunked")


def _inputs(tokens: int, hidden: int, vocab: int, device: str) -> tuple[torch.Tensor, ...]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(tokens, hidden, device=device, generator=g) / 4).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) / 30).to(dtype).requires_grad_()
    tok = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    up = torch.randn(tokens, device=device, generator=g)
    return h, w, tok, up


def _step(
    path: str, h: torch.Tensor, w: torch.Tensor, tok: torch.Tensor, up: torch.Tensor, chunks: tuple[int, int]
) -> None:
    from isoaudit.kernels.fused_logprobs import fused_token_logprobs, native_chunked_token_logprobs
    from isoaudit.kernels.logprobs import _TokenLogprobs

    if path == "kept_logits":
        out = _TokenLogprobs.apply(h, w, tok)
    elif path == "fused":
        out = fused_token_logprobs(h, w, tok, rows=chunks[0], slab=chunks[1])
    else:
        out = native_chunked_token_logprobs(h, w, tok, rows=chunks[0], slab=chunks[1])
    (out * up).sum().backward()
    h.grad = w.grad = None


def _cuda_path(path: str, args: argparse.Namespace) -> dict[str, float]:
    h, w, tok, up = _inputs(args.tokens, args.hidden, args.vocab, "cuda")
    _step(path, h, w, tok, up, args.chunks)  # compile, warm the allocator
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(path, h, w, tok, up, args.chunks)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        _step(path, h, w, tok, up, args.chunks)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"peak_gib": peak / 2**30, "ms": sorted(times)[len(times) // 2] * 1e3}


def _cpu_child(path: str, args: dict[str, Any], queue: Any) -> None:
    h, w, tok, up = _inputs(args["tokens"], args["hidden"], args["vocab"], "cpu")
    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    _step(path, h, w, tok, up, tuple(args["chunks"]))
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    queue.put({"peak_gib": peak_kib / 2**20, "ms": seconds * 1e3})


def _cpu_path(path: str, args: argparse.Namespace) -> dict[str, float]:
    """One path in a fresh process, so its resident-set peak is its own (the first call: the CPU
    path has nothing to compile)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_cpu_child, args=(path, vars(args), queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=None, help="response tokens (CUDA 32768, CPU 2048)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (CUDA 896, CPU 64)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (CUDA 151936, CPU 32768)")
    ap.add_argument("--rows", type=int, default=None, help="rows per block (CUDA 4096, CPU 256)")
    ap.add_argument(
        "--slab",
        type=int,
        default=None,
        help="vocabulary columns per slab (a multiple of 1024; default: "
        "the widest within 256 MiB of fp32 logits on CUDA, 4,096 on the CPU)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    args.tokens = args.tokens or (32_768 if cuda else 2048)
    args.hidden = args.hidden or (896 if cuda else 64)
    args.vocab = args.vocab or (151_936 if cuda else 32_768)
    from isoaudit.kernels.fused_logprobs import _chunks

    rows, slab = _chunks(
        args.tokens, args.vocab, args.rows or (None if cuda else 256), args.slab or (None if cuda else 4096)
    )
    args.chunks = (rows, slab)  # both chunked paths take the same
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"device: {where}  torch {torch.__version__}  tokens {args.tokens}  hidden {args.hidden}  "
        f"vocab {args.vocab}  blocks of {rows} rows, slabs of {slab} columns",
        flush=True,
    )
    figures = {}
    for path in PATHS:
        figures[path] = _cuda_path(path, args) if cuda else _cpu_path(path, args)
        f = figures[path]
        print(f"  {path:<15} peak {f['peak_gib']:8.3f} GiB   {f['ms']:10.2f} ms", flush=True)
    mem = figures["fused"]["peak_gib"] / figures["kept_logits"]["peak_gib"]
    speed = figures["fused"]["ms"] / figures["native_chunked"]["ms"]
    kept = figures["fused"]["ms"] / figures["kept_logits"]["ms"]
    print(f"fused peak / kept-logits peak: {mem:.3f}  (target <= 0.40: {'met' if mem <= 0.40 else 'MISSED'})")
    print(
        f"fused time / native chunked time: {speed:.3f}x  (target <= 1.05x: {'met' if speed <= 1.05 else 'MISSED'})"
    )
    print(f"fused time / kept-logits time: {kept:.3f}x")
    if not cuda:
        print("(CPU: structure only; the targets are judged on the GPU)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
