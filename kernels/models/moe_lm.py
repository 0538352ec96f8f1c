"""A small mixture-of-experts language model (Qwen3-MoE-like: attention with q/k norms, sparse
SwiGLU experts with top-k routing, optionally some dense layers), written against
:mod:`isoaudit.kernels.dispatch` and :func:`isoaudit.kernels.moe.moe_layer`, so one switch moves it onto the
invariant kernels. It runs as a trainer (``forward``: whole sequences, autograd) and as a rollout
engine's model (``step``: packed new tokens against a KV cache); both tag their tokens, so
:func:`isoaudit.kernels.moe.trace_routing` lines the two sides' routing up token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import moe
from .gdn_lm import MLP, Attention, RMSNorm


@dataclass(frozen=True)
class MoELMConfig:
    vocab: int = 1024
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 8
    top_k: int = 2
    expert_mlp: int = 256  # each expert's intermediate size
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts
    mlp: int = 512  # the dense layers' intermediate size
    eps: float = 1e-6
    rope_theta: float = 10000.0


class Router(nn.Module):
    def __init__(self, cfg: MoELMConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden).normal_(0, cfg.hidden**-0.5))


class Experts(nn.Module):
    """Expert weights as 3-D tensors in HF's layout: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)."""

    def __init__(self, cfg: MoELMConfig) -> None:
        super().__init__()
        e, h, i = cfg.experts, cfg.hidden, cfg.expert_mlp
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h).normal_(0, h**-0.5))
        self.down_proj = nn.Parameter(torch.empty(e, h, i).normal_(0, i**-0.5))


class SparseMoE(nn.Module):
    def __init__(self, cfg: MoELMConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.gate, self.experts = Router(cfg), Experts(cfg)
        self.ep = moe.SINGLE  # expert placement / capacity (simulated expert parallelism)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe.moe_layer(
            x,
            self.gate.weight,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            self.cfg.top_k,
            self.cfg.norm_topk_prob,
            layer=self.layer,
            ep=self.ep,
        )


class Block(nn.Module):
    def __init__(self, cfg: MoELMConfig, layer: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden, cfg.eps), RMSNorm(cfg.hidden, cfg.eps)
        self.mixer = Attention(cfg)  # type: ignore[arg-type]  # reads the same fields as GDNLMConfig
        self.mlp: nn.Module = MLP(cfg) if layer in cfg.dense_layers else SparseMoE(cfg, layer)  # type: ignore[arg-type]  # MLP reads the same fields

    def forward(self, x, positions, cu, slots, cache):
        x = x + self.mixer(self.norm1(x), positions, cu, slots, cache)
        return x + self.mlp(self.norm2(x))


class MoELM(nn.Module):
    """Embedding, attention + MoE blocks, final norm, untied lm_head."""

    def __init__(self, cfg: MoELMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def set_expert_parallel(self, ep: moe.ExpertParallel) -> None:
        """Place every MoE layer's experts (and size their buffers) as ``ep`` says."""
        for blk in self.blocks:
            if isinstance(blk.mlp, SparseMoE):
                blk.mlp.ep = ep

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Trainer: (B, L) right-padded ids -> final hidden states (B, L, hidden). Tokens are
        tagged (batch row, position)."""
        b, n = input_ids.shape
        dev = input_ids.device
        x = self.embed(input_ids.reshape(-1))
        positions = torch.arange(n, device=dev).repeat(b)
        cu = torch.arange(b + 1, device=dev, dtype=torch.int32) * n
        rows = torch.arange(b, device=dev).repeat_interleave(n)
        with moe.tokens(rows, positions):
            for blk in self.blocks:
                x = blk(x, positions, cu, None, None)
        return self.norm(x).view(b, n, -1)

    def full_hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self(input_ids)

    def new_cache(self, slots: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        w, cfg = self.lm_head.weight, self.cfg
        shape = (slots, max_len, cfg.kv_heads, cfg.head_dim)
        return [
            (
                torch.zeros(shape, dtype=w.dtype, device=w.device),
                torch.zeros(shape, dtype=w.dtype, device=w.device),
            )
            for _ in range(cfg.layers)
        ]

    @torch.no_grad()
    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, slots: list[int], cache: list
    ) -> torch.Tensor:
        """Engine: packed new tokens of several sequences continue their caches. Tokens are
        tagged (slot, position)."""
        x = self.embed(ids)
        sl = torch.tensor(slots, device=ids.device).repeat_interleave((cu[1:] - cu[:-1]).long())
        with moe.tokens(sl, positions):
            for blk, c in zip(self.blocks, cache, strict=True):
                x = blk(x, positions, cu, slots, c)
        return self.norm(x)
