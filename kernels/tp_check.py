"""Check, on a real process group, that the tree GEMM gives the bits of TP=1 at this TP degree.

    torchrun --standalone --nproc-per-node 4 -m isoaudit.kernels.tp_check [--small] [--json out.json]

Every rank builds the same inputs from one seed and checks two things against TP=1 computed
locally on one device:

* the row-parallel GEMMs of an 8B-class model (N = 4096; K = 4096 attention ``o_proj``, K = 12288
  and 14336 the MLP ``down_proj`` of Qwen3-8B and Llama-3-8B): the tree GEMM sharded over the group
  (subtree roots all-gathered) must equal TP=1 bitwise; a plain shard-matmul + NCCL all-reduce is
  measured beside it, as the mismatch the tree removes;
* a full forward of a small Qwen3 (random weights) with ``o_proj`` and ``down_proj`` sharded
  row-parallel and every other op on the invariant kernels: the logits must equal TP=1 bitwise.

NCCL on CUDA (one GPU per rank), gloo on the CPU (fp32, the kernels' torch references). Rank 0
prints one JSON line; the exit status is 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist

from . import enable
from .bits import bits_equal
from .tensor_parallel import (
    exit_rank,
    join_torchrun_group,
    leave_group,
    process_group_all_gather,
    process_group_all_reduce,
    shard_row_parallel,
    single_rank_all_gather,
)
from .tree_gemm import tree_gemm, tree_gemm_distributed, tree_plan

ROW_PARALLEL_K = (4096, 12288, 14336)
HIDDEN = 4096


def check_gemms(
    rank: int, world: int, dev: torch.device, tokens: int, n: int, dtype: torch.dtype
) -> list[dict]:
    """The row-parallel GEMM shapes: tree sharded over the group vs TP=1, and the native mismatch."""
    gather, reduce = process_group_all_gather(), process_group_all_reduce()
    rows = []
    for k in ROW_PARALLEL_K:
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(tokens, k, generator=gen).to(dev, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, dtype)
        lo, hi = tree_plan(k, 256, world).k_range(rank)
        ours = tree_gemm_distributed(x[:, lo:hi], w[:, lo:hi], k, 256, world, rank, gather)
        tp1 = tree_gemm(x, w, leaf=256, tp=1)
        native = reduce((x[:, lo:hi] @ w[:, lo:hi].T).contiguous())
        native_tp1 = x @ w.T
        rows.append(
            {
                "k": k,
                "tree_equals_tp1": bits_equal(ours, tp1),
                "native_mismatch_fraction": float((native != native_tp1).float().mean()),
            }
        )
    return rows


def _tiny_qwen3(dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(  # type: ignore[call-arg]  # attn_implementation: a PretrainedConfig keyword
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    return model.to(dev, dtype).eval()  # type: ignore[arg-type]  # transformers types .to as a decorated method


@torch.no_grad()
def check_model(rank: int, world: int, dev: torch.device, dtype: torch.dtype) -> dict:
    """A full forward with o_proj/down_proj row-parallel over the group vs the same model at TP=1."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 24), generator=gen).to(dev)
    with enable():
        ref_model = _tiny_qwen3(dev, dtype)
        shard_row_parallel(ref_model, 0, 1, single_rank_all_gather, leaf=64)
        ref = ref_model(ids).logits
        model = _tiny_qwen3(dev, dtype)
        sharded = shard_row_parallel(model, rank, world, process_group_all_gather(), leaf=64)
        ours = model(ids).logits
    native_model = _tiny_qwen3(dev, dtype)
    shard_row_parallel(
        native_model, rank, world, all_reduce=process_group_all_reduce(), leaf=64, mode="native"
    )
    native_tp1 = _tiny_qwen3(dev, dtype)
    native_mismatch = (native_model(ids).logits != native_tp1(ids).logits).float().mean()
    return {
        "sharded_layers": sharded,
        "logits_equal_tp1": bits_equal(ours, ref),
        "native_logits_mismatch_fraction": float(native_mismatch),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="few tokens and a narrow N (CPU, CI)")
    ap.add_argument("--json", default=None, help="rank 0 writes the result here too")
    args = ap.parse_args(argv)
    rank, world, dev = join_torchrun_group()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokens, n = (4, 64) if args.small else (256, HIDDEN)
    result: dict[str, Any] = {"world": world, "device": str(dev), "dtype": str(dtype)}
    result["gemms"] = check_gemms(rank, world, dev, tokens, n, dtype)
    result["model"] = check_model(rank, world, dev, dtype)
    ok = all(r["tree_equals_tp1"] for r in result["gemms"]) and result["model"]["logits_equal_tp1"]
    flags = torch.tensor([int(ok)], device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank must agree
    result["ok"] = bool(flags.item())
    if rank == 0:
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    leave_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    exit_rank(main())
