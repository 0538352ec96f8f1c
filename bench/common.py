"""What the GPU benches share: the ~0.5B Qwen3-shaped model they time, and host time per call."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def qwen3_05b_config(layers: int = 24, max_positions: int = 2048) -> Any:
    """Qwen2.5-0.5B's shape in the Qwen3 architecture (~0.49B parameters at 24 layers): hidden 896,
    14/2 heads of 64, MLP 4864, vocab 151,936, tied embeddings, SDPA attention."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_positions,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip


def qwen3_05b(layers: int = 24) -> torch.nn.Module:
    """A random :func:`qwen3_05b_config` model (seed 0), in bf16 on CUDA."""
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(qwen3_05b_config(layers)).to("cuda", torch.bfloat16)


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Host microseconds per call of ``fn`` without a sync (the best of 5 loops of ``calls``, after
    20 warm-up calls): what bounds an eager decode step when the GPU is not the bottleneck."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best
