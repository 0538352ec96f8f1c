"""Route HF transformers models (Llama, Qwen2, Qwen3, Mistral) through :mod:`isoaudit.kernels.dispatch`.

Two pieces: ``patch()``/``unpatch()`` swap, process-wide, ``nn.Linear.forward``, the HF RMSNorm
classes' forward and HF's "sdpa"/"eager" attention entries and SiLU for routed versions (so an unmodified
HF model run as a trainer uses the invariant kernels); :class:`HFCausalLM` runs the same HF modules
as a rollout engine's model (packed tokens, our KV cache) with exactly the same per-token arithmetic.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import dispatch
from . import ops as _ops

_FAMILIES = [
    ("llama", "Llama"),
    ("qwen2", "Qwen2"),
    ("qwen3", "Qwen3"),
    ("mistral", "Mistral"),
    ("qwen3_moe", "Qwen3Moe"),
]
_saved: dict[str, Any] = {}


def _linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return dispatch.linear(input, self.weight, self.bias)


def _rmsnorm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return dispatch.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,  # the rest of HF's attention-interface call, not read
) -> tuple[torch.Tensor, None]:
    """HF attention-interface entry: (B, H, Lq, D) queries against (B, Hkv, Lk, D) keys, causal,
    the queries being the last Lq positions. Padding must be on the right (the mask is not read)."""
    b, hq, lq, d = query.shape
    lk = key.shape[2]
    q = query.transpose(1, 2).reshape(b * lq, hq, d)
    dev = query.device
    cu = torch.arange(b + 1, device=dev, dtype=torch.int32) * lq
    pos0 = torch.full((b,), lk - lq, device=dev, dtype=torch.int32)
    kv_len = torch.full((b,), lk, device=dev, dtype=torch.int32)
    out = dispatch.attention(q, key.transpose(1, 2), value.transpose(1, 2), cu, pos0, kv_len, None, scaling)
    return out.reshape(b, lq, hq, d), None


def _rotary_classes() -> list[type[Any]]:
    return family_classes(_FAMILIES, "RotaryEmbedding")


def _rotary_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The model's own rotary embedding; inside a traced forward with the kernels on, as one
    opaque op (:func:`isoaudit.kernels.ops.rotary`) so the compiled model keeps its bits."""
    cls = type(self)
    if (
        dispatch.is_enabled()
        and torch.compiler.is_compiling()
        and getattr(self, "rope_type", "default") == "default"
    ):
        scaling = float(getattr(self, "attention_scaling", 1.0))
        cos, sin = torch.ops.isoaudit.rotary(
            x.detach(), position_ids, self.inv_freq, scaling, cls.__qualname__
        )
        return cos, sin
    return _saved["rotary_of"][cls](self, x, position_ids)


def _silu_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return dispatch.silu(input)


def _silu_classes() -> list[type[Any]]:
    out: list[type[Any]] = [nn.SiLU]
    try:
        from transformers.activations import SiLUActivation

        out.append(SiLUActivation)
    except Exception:
        pass
    return out


def family_classes(families: list[tuple[str, str]], suffix: str) -> list[type[Any]]:
    """HF's ``<Prefix><suffix>`` class of each (module, prefix) family that this transformers has
    (e.g. ``("qwen3", "Qwen3"), "RMSNorm"`` -> ``Qwen3RMSNorm``); missing families are skipped."""
    out: list[type[Any]] = []
    for mod, prefix in families:
        try:
            m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        except Exception:
            continue
        cls = getattr(m, f"{prefix}{suffix}", None)
        if cls is not None:
            out.append(cls)
    return out


def _rmsnorm_classes() -> list[type[Any]]:
    return family_classes(_FAMILIES, "RMSNorm")


def patch() -> None:
    """Install the routed forwards (idempotent)."""
    if _saved:
        return
    _saved["linear"] = nn.Linear.forward
    nn.Linear.forward = _linear_forward  # type: ignore[method-assign]  # the process-wide patch
    _saved["norms"] = [(cls, cls.forward) for cls in _rmsnorm_classes()]
    for cls, _ in _saved["norms"]:
        cls.forward = _rmsnorm_forward
    _saved["acts"] = [(cls, cls.forward) for cls in _silu_classes()]
    for cls, _ in _saved["acts"]:
        cls.forward = _silu_forward
    _saved["rotary"] = [(cls, cls.forward) for cls in _rotary_classes()]
    _saved["rotary_of"] = dict(_saved["rotary"])
    _ops.ROTARY_FORWARDS.update({cls.__qualname__: fwd for cls, fwd in _saved["rotary"]})
    for cls, _ in _saved["rotary"]:
        cls.forward = _rotary_forward
    try:
        from transformers.modeling_utils import AttentionInterface
    except Exception:  # no transformers, or one without the interface: nothing to patch
        pass
    else:
        gm = AttentionInterface._global_mapping
        _saved["attn"] = {key: gm.get(key) for key in ("sdpa", "eager")}
        gm["sdpa"] = hf_attention
        gm["eager"] = hf_attention


def unpatch() -> None:
    """Restore what :func:`patch` replaced."""
    if not _saved:
        return
    nn.Linear.forward = _saved.pop("linear")  # type: ignore[method-assign]  # undo the patch
    _saved.pop("rotary_of", None)
    for cls, fwd in _saved.pop("norms") + _saved.pop("acts") + _saved.pop("rotary", []):
        cls.forward = fwd
    attn = _saved.pop("attn", None)
    if attn is not None:
        from transformers.modeling_utils import AttentionInterface

        gm = AttentionInterface._global_mapping
        for key, fn in attn.items():
            if fn is None:
                gm.pop(key, None)
            else:
                gm[key] = fn


#: The class attribute of a module a collector watches (its class swapped for one whose forward
#: reports regions: ``isoaudit.collectors.hooks``): such a module must run itself, as must one
#: with hooks, for its regions to be seen.
REGIONS_ATTRIBUTE = "isoaudit_regions"


def observed(module: nn.Module) -> bool:
    """Does something watch ``module``'s own forward (its hooks, or a collector's watched class)?"""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or hasattr(type(module), REGIONS_ATTRIBUTE)
    )


def _norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm as the engine runs it: the module itself when the kernels are on (patched to
    the invariant kernel, the trainer's op); natively the fused ``F.rms_norm``, as a rollout
    engine's fused norm kernel is (HF's module is seven separate ops); a module a collector hooked
    runs itself, so its hooks see it."""
    if dispatch.is_enabled() or observed(module):
        return module(x)
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class HFCausalLM:
    """An HF Llama/Qwen3 decoder run as a rollout engine's model: packed tokens of many sequences,
    a KV cache per layer of shape (slots, max_len, Hkv, D). Uses the model's own modules, so with
    the kernels enabled every op is the one the patched trainer runs."""

    def __init__(self, model: Any) -> None:  # an HF causal LM: its submodules are read by name
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self._consts: dict[tuple, torch.Tensor] = {}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def new_cache(self, slots: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        w = self.lm_head_weight
        shape = (slots, max_len, self.kv_heads, self.head_dim)
        return [
            (
                torch.zeros(shape, dtype=w.dtype, device=w.device),
                torch.zeros(shape, dtype=w.dtype, device=w.device),
            )
            for _ in self.inner.layers
        ]

    @torch.no_grad()
    def step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cu: torch.Tensor,
        slots: list[int],
        cache: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Run new tokens (packed; ``cu`` B+1 offsets; ``positions`` absolute) and return the final
        normed hidden states (T, hidden). The batch's layout is computed on the device; the host
        reads at most the longest query count, once (the native prefill pads to it)."""
        t = ids.shape[0]
        dev = ids.device
        cu = cu.to(dev)
        lens = cu[1:] - cu[:-1]
        slots_t = torch.tensor(slots, device=dev)
        slot_of_tok = torch.repeat_interleave(slots_t, lens, output_size=t)
        q_pos0 = positions[cu[:-1].long().clamp(max=max(t - 1, 0))] if t else positions[:0]
        kv_len = q_pos0 + lens.to(q_pos0.dtype)
        max_q = None if dispatch.is_enabled() or t == len(slots) else int(lens.max())
        return self._layers(ids, positions, slot_of_tok, cu, q_pos0, kv_len, slots_t, max_q, cache)

    @torch.no_grad()
    def decode(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """One token per cache slot (row i continues slot i at ``positions[i]``): the engine's
        decode step, free of host reads so it can be captured in a CUDA graph. Per token it is
        exactly :meth:`step`'s arithmetic."""
        b = ids.shape[0]
        rows = self._rows(b, ids.device)
        return self._layers(
            ids, positions, rows, self._offsets(b, ids.device), positions, positions + 1, None, None, cache
        )

    def decode_capturable(self) -> bool:
        """Whether :meth:`decode` may be captured in a CUDA graph in the current mode: on CUDA (a
        dense decoder's step reads nothing on the host in either mode)."""
        return self.lm_head_weight.is_cuda

    def decoded(self, positions: np.ndarray, live: np.ndarray) -> None:
        """Called by the engine after each decode step (eager or replayed) with row i's absolute
        position and whether it was a request's real token: nothing to file for a dense decoder."""

    def _rows(self, b: int, dev: torch.device) -> torch.Tensor:
        key = ("rows", b, dev)
        if key not in self._consts:
            self._consts[key] = torch.arange(b, device=dev)
        return self._consts[key]

    def _offsets(self, b: int, dev: torch.device) -> torch.Tensor:
        key = ("cu", b, dev)
        if key not in self._consts:
            self._consts[key] = torch.arange(b + 1, device=dev, dtype=torch.int32)
        return self._consts[key]

    def _layers(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slot_of_tok: torch.Tensor,
        cu: torch.Tensor,
        q_pos0: torch.Tensor,
        kv_len: torch.Tensor,
        slots: torch.Tensor | None,
        max_q: int | None,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        t = ids.shape[0]
        d = self.head_dim
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x[None], positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            res = x
            h = _norm(layer.input_layernorm, x)
            q = attn.q_proj(h).view(t, -1, d)
            k = attn.k_proj(h).view(t, -1, d)
            v = attn.v_proj(h).view(t, -1, d)
            if hasattr(attn, "q_norm"):
                q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            kc, vc = cache[li]
            kc[slot_of_tok, positions] = k
            vc[slot_of_tok, positions] = v
            o = dispatch.attention(q, kc, vc, cu, q_pos0, kv_len, slots, attn.scaling, max_q=max_q)
            x = res + attn.o_proj(o.reshape(t, -1))
            res = x
            x = res + layer.mlp(_norm(layer.post_attention_layernorm, x))
        return _norm(self.inner.norm, x)

    def full_hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The trainer's path: the HF model's own forward over whole (right-padded) sequences."""
        return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
