"""A small hybrid language model with Gated DeltaNet and attention layers (Qwen3-Next-like,
without the short convolution and output gate), written against :mod:`isoaudit.kernels.dispatch` so one
switch moves it onto the invariant kernels. It runs as a trainer (``forward``: whole sequences,
autograd) and as a rollout engine's model (``step``: packed new tokens against a cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import dispatch
from ..gdn import CHUNK, GDNCache


@dataclass(frozen=True)
class GDNLMConfig:
    vocab: int = 1024
    hidden: int = 256
    layers: tuple[str, ...] = ("gdn", "attn", "gdn", "attn")
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    gdn_heads: int = 4
    gdn_head_dim: int = 64
    mlp: int = 512
    eps: float = 1e-6
    rope_theta: float = 10000.0
    chunk: int = CHUNK


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps)


def _lin(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: GDNLMConfig) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            _lin(cfg.hidden, cfg.mlp),
            _lin(cfg.hidden, cfg.mlp),
            _lin(cfg.mlp, cfg.hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = dispatch.silu(dispatch.linear(x, self.gate.weight)) * dispatch.linear(x, self.up.weight)
        return dispatch.linear(a, self.down.weight)


_ROPE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_ROPE_LEN = 8192


def _rope_table(
    d: int, theta: float, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions [0, 8192), computed once: indexing a fixed table keeps every
    position's values independent of the batch (a CPU cos over a batch-shaped tensor is not)."""
    key = (d, theta, dtype, str(device))
    if key not in _ROPE:
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        f = torch.arange(_ROPE_LEN, device=device, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((f, f), -1)
        _ROPE[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
    return _ROPE[key]


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on (T, H, D) at absolute positions; elementwise, hence invariant."""
    d = x.shape[-1]
    cos_t, sin_t = _rope_table(d, theta, x.dtype, x.device)
    cos, sin = cos_t[positions][:, None, :], sin_t[positions][:, None, :]
    h = d // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return (x * cos) + (rot * sin)


class Attention(nn.Module):
    def __init__(self, cfg: GDNLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q, self.k = _lin(cfg.hidden, cfg.heads * d), _lin(cfg.hidden, cfg.kv_heads * d)
        self.v, self.o = _lin(cfg.hidden, cfg.kv_heads * d), _lin(cfg.heads * d, cfg.hidden)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.eps), RMSNorm(d, cfg.eps)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        t, d = x.shape[0], self.cfg.head_dim
        q = self.q_norm(dispatch.linear(x, self.q.weight).view(t, -1, d))
        k = self.k_norm(dispatch.linear(x, self.k.weight).view(t, -1, d))
        v = dispatch.linear(x, self.v.weight).view(t, -1, d)
        return _rope(q, positions, self.cfg.rope_theta), _rope(k, positions, self.cfg.rope_theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cu: torch.Tensor,
        slots: list[int] | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, positions)
        t, dev = x.shape[0], x.device
        lens = cu[1:] - cu[:-1]
        if cache is None:  # trainer: B equal-length (right-padded) sequences, keys in place
            b = cu.numel() - 1
            n = t // b
            kc, vc = k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:])
            pos0 = torch.zeros(b, device=dev, dtype=torch.int32)
            o = dispatch.attention(q, kc, vc, cu, pos0, lens, None, self.cfg.head_dim**-0.5)
        else:
            kc, vc = cache
            sl = torch.tensor(slots, device=dev)
            slot_of_tok = torch.repeat_interleave(sl, lens.long())
            kc[slot_of_tok, positions] = k
            vc[slot_of_tok, positions] = v
            pos0 = positions[cu[:-1].long()]
            o = dispatch.attention(q, kc, vc, cu, pos0, pos0 + lens, sl, self.cfg.head_dim**-0.5)
        return dispatch.linear(o.reshape(t, -1), self.o.weight)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: GDNLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.gdn_heads, cfg.gdn_head_dim
        self.q, self.k, self.v = _lin(cfg.hidden, h * d), _lin(cfg.hidden, h * d), _lin(cfg.hidden, h * d)
        self.a, self.b = _lin(cfg.hidden, h), _lin(cfg.hidden, h)
        self.o = _lin(h * d, cfg.hidden)
        self.A_log = nn.Parameter(torch.log(torch.empty(h).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.o_norm = RMSNorm(d, cfg.eps)

    def inputs(self, x: torch.Tensor):
        t, d = x.shape[0], self.cfg.gdn_head_dim
        q = dispatch.l2_norm(dispatch.linear(x, self.q.weight).view(t, -1, d)) * (d**-0.5)
        k = dispatch.l2_norm(dispatch.linear(x, self.k.weight).view(t, -1, d))
        v = dispatch.linear(x, self.v.weight).view(t, -1, d)
        g, beta = dispatch.gdn_gates(
            dispatch.linear(x, self.a.weight), dispatch.linear(x, self.b.weight), self.A_log, self.dt_bias
        )
        return q, k, v, g, beta

    def forward(
        self, x: torch.Tensor, cu: torch.Tensor, slots: list[int] | None, cache: GDNCache | None
    ) -> torch.Tensor:
        q, k, v, g, beta = self.inputs(x)
        if cache is None:
            o = dispatch.gdn(q, k, v, g, beta, cu, self.cfg.chunk)
        else:
            assert slots is not None, "a cached step names its sequences' cache slots"
            o = dispatch.gdn_incremental(q, k, v, g, beta, cu, slots, cache, self.cfg.chunk)
        o = self.o_norm(o.to(x.dtype))
        return dispatch.linear(o.reshape(x.shape[0], -1), self.o.weight)


class Block(nn.Module):
    def __init__(self, cfg: GDNLMConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm1, self.norm2 = RMSNorm(cfg.hidden, cfg.eps), RMSNorm(cfg.hidden, cfg.eps)
        self.mixer = GatedDeltaNet(cfg) if kind == "gdn" else Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, cu, slots, cache):
        h = self.norm1(x)
        if self.kind == "gdn":
            h = self.mixer(h, cu, slots, cache)
        else:
            h = self.mixer(h, positions, cu, slots, cache)
        x = x + h
        return x + self.mlp(self.norm2(x))


class GDNLM(nn.Module):
    """Embedding, hybrid blocks, final norm, untied lm_head."""

    def __init__(self, cfg: GDNLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, kind) for kind in cfg.layers)
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = _lin(cfg.hidden, cfg.vocab)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Trainer: (B, L) right-padded ids -> final hidden states (B, L, hidden)."""
        b, n = input_ids.shape
        dev = input_ids.device
        x = self.embed(input_ids.reshape(-1))
        positions = torch.arange(n, device=dev).repeat(b)
        cu = torch.arange(b + 1, device=dev, dtype=torch.int32) * n
        for blk in self.blocks:
            x = blk(x, positions, cu, None, None)
        return self.norm(x).view(b, n, -1)

    def full_hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self(input_ids)

    def new_cache(self, slots: int, max_len: int) -> list:
        w, cfg = self.lm_head.weight, self.cfg
        caches: list = []
        for kind in cfg.layers:
            if kind == "gdn":
                caches.append(
                    GDNCache.empty(
                        slots, cfg.gdn_heads, cfg.gdn_head_dim, cfg.gdn_head_dim, w.dtype, w.device, cfg.chunk
                    )
                )
            else:
                shape = (slots, max_len, cfg.kv_heads, cfg.head_dim)
                caches.append(
                    (
                        torch.zeros(shape, dtype=w.dtype, device=w.device),
                        torch.zeros(shape, dtype=w.dtype, device=w.device),
                    )
                )
        return caches

    @torch.no_grad()
    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, slots: list[int], cache: list
    ) -> torch.Tensor:
        """Engine: packed new tokens of several sequences continue their caches."""
        x = self.embed(ids)
        for blk, c in zip(self.blocks, cache, strict=True):
            x = blk(x, positions, cu, slots, c)
        return self.norm(x)
