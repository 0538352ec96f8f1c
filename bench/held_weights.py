"""Cost of the held-weight digest per weight sync, against a plain pass over the same weights in the
same run: a sum of every tensor (one read) and a copy of every tensor (one read, one write).

Weights: the parameter shapes of a Qwen2.5-style decoder (``--layers``, ``--hidden``,
``--intermediate``, ``--vocab``, ``--kv-heads``), bf16, on ``--device``. Rounds interleave the three
passes; medians are reported, with the digest's ratio to each baseline.

``--vllm`` adds the engine side on the tiny local Qwen3 in this process: one in-place weight sync
(``isoaudit.collectors.vllm.load_weights``) with a collector attached (held digests on, per tensor, under the
trainer's names) against the same sync with none attached.

    python bench/held_weights.py                       # CPU, ~0.1B parameters
    python bench/held_weights.py --layers 24 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isoaudit.collectors.held_weights import tensor_digests  # noqa: E402


def decoder_weights(args: argparse.Namespace) -> list[tuple[str, torch.Tensor]]:
    h, i, v = args.hidden, args.intermediate, args.vocab
    kv = args.kv_heads * (h // args.heads)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (v, h)),
        ("lm_head.weight", (v, h)),
    ]
    for n in range(args.layers):
        p = f"model.layers.{n}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    return [
        (name, torch.randn(shape, generator=gen).to(dtype=torch.bfloat16, device=args.device))
        for name, shape in shapes
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Any, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def weights_bench(args: argparse.Namespace) -> dict[str, Any]:
    weights = decoder_weights(args)
    params = sum(t.numel() for _, t in weights)
    passes = {
        "digest": lambda: tensor_digests(weights),  # ends with the digests on the host
        "sum": lambda: torch.stack([t.sum(dtype=torch.float32) for _, t in weights]).cpu(),
        "copy": lambda: [t.clone() for _, t in weights],
    }
    for fn in passes.values():
        fn()  # warm-up: caches, allocator
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(args.rounds):
        for name, fn in passes.items():
            times[name].append(timed(fn, args.device))
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "device": args.device,
        "tensors": len(weights),
        "parameters": params,
        "bytes": params * 2,
        "median_ms": median,
        "digest_vs_sum": median["digest"] / median["sum"],
        "digest_vs_copy": median["digest"] / median["copy"],
        "digest_GBps": params * 2 / median["digest"] / 1e6,
    }


def vllm_bench(rounds: int) -> dict[str, Any]:
    import os
    import tempfile

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import isoaudit.collectors.vllm as cv
    from isoaudit.collectors.sinks import MemorySink
    from isoaudit.collectors.tiny_models import make_tiny_model
    from isoaudit.collectors.vllm.weights import engine_digests
    from safetensors.torch import load_file
    from vllm import LLM

    path = make_tiny_model(
        "qwen3",
        Path(tempfile.mkdtemp()) / "qwen3",
        num_layers=2,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab=512,
        seed=7,
        dtype="bfloat16",
    )
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        kv_cache_memory_bytes=32 << 20,
        logprobs_mode="processed_logprobs",
        gpu_memory_utilization=0.3,
    )
    weights = load_file(str(path / "model.safetensors"))
    plain, attached, digest_only = [], [], []
    for r in range(rounds + 1):
        t = timed(lambda r=r: cv.load_weights(llm, weights, f"p{r}", digest=False), "cpu")
        handle = cv.attach(llm, run="bench-held", sink=MemorySink(validate=False))
        a = timed(lambda r=r: cv.load_weights(llm, weights, f"a{r}", digest=False), "cpu")
        d = timed(lambda h=handle: engine_digests(h.link), "cpu")
        handle.detach()
        if r:  # round 0 warms up
            plain.append(t)
            attached.append(a)
            digest_only.append(d)
    llm.llm_engine.engine_core.shutdown()
    med = {
        "sync_without_collector": statistics.median(plain),
        "sync_with_held_digests": statistics.median(attached),
        "digest_rpc_alone": statistics.median(digest_only),
    }
    return {"median_ms": med, "sync_ratio": med["sync_with_held_digests"] / med["sync_without_collector"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vllm", action="store_true", help="also the engine-side sync on the tiny model")
    args = parser.parse_args()
    out: dict[str, Any] = {"weights": weights_bench(args)}
    w = out["weights"]
    print(
        f"held-weight digest, {w['tensors']} tensors, {w['parameters'] / 1e6:.1f}M bf16 params on {w['device']}: "
        f"digest {w['median_ms']['digest']:.1f} ms, sum {w['median_ms']['sum']:.1f} ms, copy {w['median_ms']['copy']:.1f} ms "
        f"-> {w['digest_vs_sum']:.2f}x a sum, {w['digest_vs_copy']:.2f}x a copy ({w['digest_GBps']:.2f} GB/s)"
    )
    if args.vllm:
        out["vllm"] = vllm_bench(args.rounds)
        v = out["vllm"]["median_ms"]
        print(
            f"vLLM (tiny Qwen3, in-process) sync: {v['sync_without_collector']:.1f} ms without a collector, "
            f"{v['sync_with_held_digests']:.1f} ms with held digests ({out['vllm']['sync_ratio']:.2f}x); "
            f"the digest RPC alone {v['digest_rpc_alone']:.1f} ms"
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
