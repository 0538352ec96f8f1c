"""MoE layer cost: the invariant layer (router + experts + combine, isoaudit.kernels.moe) against HF's
Qwen3-MoE sparse block on its grouped-GEMM experts (``torch._grouped_mm``), the same module and
weights, measured in the same run; HF's eager experts loop is shown beside.

    python bench/moe.py [--quick]

Prints one line per shape: median ms of each and the ratio invariant / grouped-GEMM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the package, not bench/kernels.py

from isoaudit import kernels  # noqa: E402


def sparse_block(h: int, i: int, e: int, k: int, dtype: torch.dtype, dev: str) -> torch.nn.Module:
    """HF's Qwen3-MoE sparse block (hidden ``h``, expert MLP ``i``, ``e`` experts, top-``k``), seeded."""
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k, norm_topk_prob=True
    )
    torch.manual_seed(0)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return block.to(dev, dtype).eval()


def _time(fn, x: torch.Tensor, dev: str, reps: int) -> float:
    for _ in range(2):
        fn(x)
    out = []
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        if dev == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def run(quick: bool) -> list[dict]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        shapes = [(2048, 768, 128, 8, t) for t in (128, 1024, 4096)] + [(1024, 512, 16, 4, 2048)]
        reps = 10 if quick else 30
    else:
        shapes = [(256, 128, 16, 4, t) for t in (16, 256)]
        reps = 3 if quick else 7
    rows = []
    for h, i, e, k, t in shapes:
        block = sparse_block(h, i, e, k, torch.bfloat16, dev)
        x = torch.randn(1, t, h, device=dev, dtype=torch.bfloat16)
        times = {}
        with torch.no_grad():
            for impl in ("grouped_mm", "eager"):
                block.experts.config._experts_implementation = impl
                with kernels.disable():
                    times[impl] = _time(block, x, dev, reps)
            with kernels.enable():
                times["invariant"] = _time(block, x, dev, reps)
        row = {
            "device": dev,
            "hidden": h,
            "expert_mlp": i,
            "experts": e,
            "top_k": k,
            "tokens": t,
            **{f"{name}_ms": round(v, 3) for name, v in times.items()},
            "ratio_vs_grouped_mm": round(times["invariant"] / times["grouped_mm"], 2),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    run(ap.parse_args().quick)
