"""Tiny random-weight mixture-of-experts models (HF Qwen3-MoE and Mixtral) for routing tests.

The same recipe as :mod:`collectors.tiny_models` (standard HF config, random weights from a seed, the
locally trained byte-level BPE), so transformers and vLLM both load the directory and nothing is
downloaded. Router weights are drawn with standard deviation ``router_scale / sqrt(hidden)`` (router
logits of about unit spread): decisive for most tokens, with close calls left for noise to flip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from collectors.tiny_models import train_tokenizer

MoEFamily = Literal["qwen3_moe", "mixtral"]


def tiny_moe_config(
    family: MoEFamily = "qwen3_moe",
    *,
    num_layers: int = 2,
    hidden: int = 128,
    vocab: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    expert_intermediate: int = 64,
    max_positions: int = 1024,
    dtype: str = "float32",
    tokenizer: Any = None,
) -> Any:
    """A standard HF ``family`` config at toy size: every layer sparse, ``num_experts`` experts of
    which ``top_k`` are chosen per token (head_dim 32: vLLM's CPU attention needs a multiple of 32)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    if family not in ("qwen3_moe", "mixtral"):
        raise ValueError(f"family: expected 'qwen3_moe' or 'mixtral', got {family!r}")
    if not 1 <= top_k <= num_experts <= 65535:
        raise ValueError(
            f"top_k/num_experts: need 1 <= top_k <= num_experts <= 65535, got {top_k}/{num_experts}"
        )
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden: {hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    ids = {}
    if tokenizer is not None:
        ids = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "num_experts_per_tok": top_k,
        "dtype": dtype,
        **ids,
    }
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=expert_intermediate,
            num_experts=num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    return MixtralConfig(**common, intermediate_size=expert_intermediate, num_local_experts=num_experts)


def make_tiny_moe(
    family: MoEFamily = "qwen3_moe",
    path: str | Path | None = None,
    *,
    seed: int = 0,
    dtype: str = "float32",
    router_scale: float = 1.0,
    **config: Any,
) -> Path:
    """Save a random ``family`` MoE model and its tokenizer to ``path`` (created); return the path."""
    from transformers import AutoModelForCausalLM

    if path is None:
        raise ValueError("path: where to save the model (a directory)")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(config.get("vocab", 512), seed=seed)
    cfg = tiny_moe_config(family, dtype=dtype, tokenizer=tokenizer, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, router_scale / cfg.hidden_size**0.5)
                elif param.dim() == 3:  # fused expert weights start at zero in HF's init
                    param.normal_(0.0, 0.02)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
