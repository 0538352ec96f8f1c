"""Tiny random-weight models with a locally trained tokenizer, for tests and the demo.

Nothing is downloaded: the config is a standard HF Qwen3, Llama, Qwen3-MoE or Mixtral config (so
transformers and vLLM both load the directory), the weights are random from a seed, and the tokenizer
is a byte-level BPE trained in a second on a small built-in corpus and saved as an HF fast tokenizer.

Mixture-of-experts families (routing tests): every layer sparse; router weights are drawn
with standard deviation ``router_scale / sqrt(hidden)`` (router logits of about unit spread):
decisive for most tokens, with close calls left for noise to flip.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal, TypedDict, Unpack

import torch

Family = Literal["qwen3", "llama", "qwen3_moe", "mixtral"]
FAMILIES = ("qwen3", "llama", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")

_WORDS = (
    "the a policy rollout trainer engine token logprob kernel batch sample reward model layer norm "
    "attention residual stream prefix cache step update weight gradient divergence audit region fingerprint "
    "digest sketch mantissa float bits equal differ origin first mismatch ratio clip entropy value "
    "advantage return prompt completion temperature sampling greedy beam vocab embed head mlp gate up down "
    "query key output rotary position sequence packed padded left right one two three four five six seven "
    "eight nine ten zero if then else while for return def class import from is not and or in of to"
).split()

SPECIAL_TOKENS = {"eos": "<|endoftext|>", "pad": "<|pad|>", "bos": "<|begin|>"}


def tiny_corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text: word salad with digits and punctuation, enough to train a BPE."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "?", "!", ":", ","]))
    return lines


def train_tokenizer(vocab_size: int = 512, seed: int = 0) -> Any:
    """A byte-level BPE of at most ``vocab_size`` tokens, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    if vocab_size < 256 + len(specials):
        raise ValueError(
            f"vocab_size: a byte-level BPE needs at least {256 + len(specials)} tokens, got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        model_max_length=4096,
    )


class TinyShape(TypedDict, total=False):
    """The shape options of :func:`tiny_config` beyond size and dtype (its keyword arguments)."""

    heads: int
    kv_heads: int
    intermediate: int | None
    max_positions: int
    num_experts: int
    top_k: int
    expert_intermediate: int


def tiny_config(
    family: Family = "qwen3",
    *,
    num_layers: int = 2,
    hidden: int = 64,
    vocab: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 1024,
    dtype: str = "float32",
    tokenizer: Any = None,
    num_experts: int = 8,
    top_k: int = 2,
    expert_intermediate: int = 64,
) -> Any:
    """A standard HF config of ``family`` at toy size (untied embeddings, rope, GQA); the MoE
    families choose ``top_k`` of ``num_experts`` experts (MLP width ``expert_intermediate``) per
    token in every layer."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    if family in MOE_FAMILIES and not 1 <= top_k <= num_experts <= 65535:
        raise ValueError(
            f"top_k/num_experts: need 1 <= top_k <= num_experts <= 65535, got {top_k}/{num_experts}"
        )
    if not 1 <= num_layers <= 64:
        raise ValueError(f"num_layers: expected 1..64, got {num_layers}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden: {hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    if max_positions < 512:
        raise ValueError(f"max_positions: at least 512 (engines and tests expect it), got {max_positions}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype!r}")
    ids = {}
    if tokenizer is not None:
        ids = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "dtype": dtype,
        **ids,
    }
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            num_experts_per_tok=top_k,
            moe_intermediate_size=expert_intermediate,
            num_experts=num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if family == "mixtral":
        common["intermediate_size"] = expert_intermediate
        return MixtralConfig(**common, num_experts_per_tok=top_k, num_local_experts=num_experts)
    return Qwen3Config(**common) if family == "qwen3" else LlamaConfig(**common)


def make_tiny_model(
    family: Family = "qwen3",
    path: str | Path | None = None,
    *,
    num_layers: int = 2,
    hidden: int = 64,
    vocab: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    router_scale: float = 1.0,
    **config: Unpack[TinyShape],
) -> Path:
    """Save a random ``family`` model and its tokenizer to ``path`` (created); return the path.

    ``dtype`` is the saved weights' dtype and the config's ``dtype`` (``bfloat16`` for engine tests);
    ``router_scale``: the MoE families' router logit spread (see the module's docstring).
    """
    from transformers import AutoModelForCausalLM

    if path is None:
        raise ValueError("path: where to save the model (a directory)")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab, seed=seed)
    cfg = tiny_config(
        family, num_layers=num_layers, hidden=hidden, vocab=vocab, dtype=dtype, tokenizer=tokenizer, **config
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if family in MOE_FAMILIES:
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


def load_tiny_model(
    path: str | Path, *, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"
) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a directory made by :func:`make_tiny_model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(path)
