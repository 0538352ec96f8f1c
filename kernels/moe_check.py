"""Expert and sequence parallelism over a real process group, checked against one process.

    torchrun --standalone --nproc-per-node 4 -m isoaudit.kernels.moe_check --json out.json

Every rank builds the same weights and tokens (seeded) and computes the single-process answer
itself; then, over the group (gloo on the CPU, NCCL with one GPU per rank):

* **EP**: each rank routes its own tokens, sends rows to the ranks owning their experts and gets
  the outputs back (:func:`isoaudit.kernels.moe.expert_outputs_distributed`), for two placements and two
  buffer capacities, fp32 and bf16: its tokens' outputs must equal the single-process layer's.
* **SP**: :func:`isoaudit.kernels.sequence_parallel.sp_hidden` of an MoELM with this rank's slice of every
  sequence: its logits slice must equal the full forward's (kernels off: how much differs).
* **SP on HF models**: the same for HF's Qwen3 (dense) and Qwen3-MoE decoders (random weights
  from a seeded config; :func:`isoaudit.kernels.sequence_parallel.sp_hidden` with the engine adapter's ops).
* **TP + SP** (power-of-two worlds): :func:`isoaudit.kernels.sequence_parallel.tree_gemm_reduce_scatter`
  rows must equal the tree GEMM's.
Rank 0 writes the verdicts (``--json``) and exits non-zero when any is false.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from . import dispatch, moe, switch
from . import sequence_parallel as sp
from .bits import bits_equal
from .models.moe_lm import MoELM, MoELMConfig
from .tensor_parallel import exit_rank, join_torchrun_group, leave_group
from .tree_gemm import tree_gemm, tree_plan


def _ep(rank: int, world: int, dev: torch.device, small: bool) -> list[dict]:
    h, i, e, k, t = (64, 32, 8, 4, 40) if small else (1024, 512, 16, 4, 512)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        gate = (torch.randn(e, h, generator=g) * h**-0.5).to(dev, dtype)
        gate_up = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dev, dtype)
        down = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dev, dtype)
        x = torch.randn(t, h, generator=g).to(dev, dtype)
        lo, hi = sp.seq_slices(t, world)[rank]
        with switch.enable():
            want = moe.moe_layer(x, gate, gate_up, down, k)[lo:hi]
            r = moe.route(x[lo:hi], gate, k)
            for name, owners in (
                ("blocks", moe.ExpertParallel(world).owners(e)),
                ("scrambled", [(3 * j + 1) % world for j in range(e)]),
            ):
                local = {j: (gate_up[j], down[j]) for j in range(e) if owners[j] == rank}
                for capacity in (None, 3):
                    y = moe.expert_outputs_distributed(x[lo:hi], r.experts, local, owners, capacity)
                    got = moe.combine(y, r.weights, dtype)
                    out.append(
                        {
                            "dtype": str(dtype).removeprefix("torch."),
                            "placement": name,
                            "capacity": capacity,
                            "equal": bits_equal(got, want),
                        }
                    )
    return out


def _sp(rank: int, world: int, dev: torch.device, small: bool) -> dict:
    torch.manual_seed(0)
    cfg = MoELMConfig(
        vocab=256, hidden=64, layers=3, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2, expert_mlp=32
    )
    if not small:
        cfg = MoELMConfig(layers=4, experts=16, top_k=4)
    model = MoELM(cfg).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    ids = torch.randint(0, cfg.vocab, (3, 37 if small else 301), generator=torch.Generator().manual_seed(1))
    ids = ids.to(dev)
    lo, hi = sp.seq_slices(ids.shape[1], world)[rank]
    res = {}
    for on in (True, False):
        with switch.enable() if on else switch.disable(), torch.no_grad():
            full = dispatch.logits_fp32(model(ids)[:, lo:hi].reshape(-1, cfg.hidden), model.lm_head_weight)
            gather = sp.process_group_seq_gather(ids.shape[1])
            mine = sp.sp_hidden(model, ids, world, [rank], gather)[rank]
            got = dispatch.logits_fp32(mine.reshape(-1, cfg.hidden), model.lm_head_weight)
        res["kernels" if on else "native"] = {
            "equal": bits_equal(got, full),
            "mismatch_fraction": float((got != full).float().mean()),
        }
    return res


def hf_decoder(family: str, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A tiny HF ``qwen3``, ``qwen3_moe`` or ``mixtral`` causal LM with seeded random weights
    (every process builds the same bits; nothing is downloaded)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        cfg: Any = Qwen3Config(**common)
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
    elif family == "mixtral":
        cfg = MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2)
    else:
        raise ValueError(f"family: expected 'qwen3', 'qwen3_moe' or 'mixtral', got {family!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:  # fan-in scaled; HF leaves the router at zero
                    p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.to(dev, dtype).eval()


def _sp_hf(rank: int, world: int, dev: torch.device) -> dict:
    ids = torch.randint(0, 256, (3, 37), generator=torch.Generator().manual_seed(1)).to(dev)
    lo, hi = sp.seq_slices(ids.shape[1], world)[rank]
    res = {}
    for family in ("qwen3", "qwen3_moe"):
        model: Any = hf_decoder(family, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        head = model.lm_head.weight
        with switch.enable(), torch.no_grad():
            full = model.model(input_ids=ids).last_hidden_state[:, lo:hi]
            mine = sp.sp_hidden(model, ids, world, [rank], sp.process_group_seq_gather(ids.shape[1]))[rank]
            got = dispatch.logits_fp32(mine.reshape(-1, mine.shape[-1]), head)
            want = dispatch.logits_fp32(full.reshape(-1, full.shape[-1]), head)
        res[family] = {"equal": bits_equal(got, want)}
    return res


def _tp_sp(rank: int, world: int, dev: torch.device, small: bool) -> dict | None:
    if world & (world - 1):
        return None
    k, n, m = (1024, 48, 50) if small else (4096, 4096, 300)
    g = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(m, k, generator=g).to(dev, dtype)
    w = torch.randn(n, k, generator=g).to(dev, dtype)
    leaf = 64 if small else 256
    impl = None if dev.type == "cuda" else "torch"
    lo_k, hi_k = tree_plan(k, leaf, world).k_range(rank)
    lo, hi = sp.seq_slices(m, world)[rank]
    got = sp.tree_gemm_reduce_scatter(
        x[:, lo_k:hi_k], w[:, lo_k:hi_k], k, world, rank, sp.process_group_all_to_all(), leaf, impl=impl
    )
    want = tree_gemm(x, w, leaf=leaf, impl=impl)[lo:hi]
    return {"k": k, "equal": bits_equal(got, want)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write rank 0's verdicts here")
    ap.add_argument("--small", action="store_true", help="small shapes (the CPU test)")
    args = ap.parse_args(argv)
    import torch.distributed as dist

    rank, world, dev = join_torchrun_group()
    mine: dict[str, Any] = {"ep": _ep(rank, world, dev, args.small), "sp": _sp(rank, world, dev, args.small)}
    mine["sp_hf"] = _sp_hf(rank, world, dev)
    mine["tp_sp"] = _tp_sp(rank, world, dev, args.small)
    every: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(every, mine)
    leave_group()
    if rank:
        return 0
    ok = all(
        all(c["equal"] for c in r["ep"])
        and r["sp"]["kernels"]["equal"]
        and all(c["equal"] for c in r["sp_hf"].values())
        and (r["tp_sp"] is None or r["tp_sp"]["equal"])
        for r in every
    )
    result = {"world": world, "ok": ok, "ranks": every}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0 if ok else 1


if __name__ == "__main__":
    exit_rank(main())
