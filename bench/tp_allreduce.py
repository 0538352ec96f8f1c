# ruff: noqa: B023  (benchmarked closures run inside their loop iteration)
"""Time per call of a TP-invariant row-parallel GEMM against the plain one, on a real process group.

    torchrun --standalone --nproc-per-node 2 bench/tp_allreduce.py [--tokens 256,2048] [--json out.json]

For the row-parallel shapes of an 8B-class model (N = 4096; K = 4096, 12288, 14336), each rank
holds its K shard. Native = what Megatron-style TP does: the shard's bf16 cuBLAS matmul, then one
NCCL all-reduce of the bf16 output. Invariant = the tree GEMM: the shard's subtree root in fp32,
an all-gather of the roots, the same pairwise tree on every rank, one rounding. Rank 0 prints the
slowest rank's median ms for each and the ratio (invariant / native). NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isoaudit.kernels.tensor_parallel import (  # noqa: E402
    join_torchrun_group,
    leave_group,
    process_group_all_gather,
    process_group_all_reduce,
)
from isoaudit.kernels.tree_gemm import tree_gemm_distributed, tree_plan  # noqa: E402

K_SHAPES = (4096, 12288, 14336)
N = 4096
LEAF = 256


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_ms(fn, dev: torch.device, iters: int) -> float:
    """Median wall time of ``fn`` over ``iters`` calls, every rank in step; the slowest rank's."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,2048")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rank, world, dev = join_torchrun_group()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gather, reduce = process_group_all_gather(), process_group_all_reduce()
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        for k in K_SHAPES:
            lo, hi = tree_plan(k, LEAF, world).k_range(rank)
            gen = torch.Generator().manual_seed(k)
            x = torch.randn(m, k, generator=gen).to(dev, dtype)[:, lo:hi].contiguous()
            w = (torch.randn(N, k, generator=gen) / k**0.5).to(dev, dtype)[:, lo:hi].contiguous()
            native = median_ms(lambda: reduce(x @ w.T), dev, args.iters)
            ours = median_ms(
                lambda: tree_gemm_distributed(x, w, k, LEAF, world, rank, gather), dev, args.iters
            )
            row = dict(tp=world, tokens=m, k=k, n=N, native_ms=native, invariant_ms=ours, ratio=ours / native)
            rows.append(row)
            if rank == 0:
                print(
                    f"tp={world} M={m:5d} K={k:5d} N={N}  native (matmul + all-reduce) {native:8.3f} ms   "
                    f"invariant (tree + all-gather) {ours:8.3f} ms   {ours / native:5.2f}x",
                    flush=True,
                )
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    leave_group()


if __name__ == "__main__":
    main()
