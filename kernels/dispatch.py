"""The switch every model call goes through: invariant kernels when enabled, native torch otherwise.

Models (our own, the HF adapters, the rollout engine) call these functions instead of torch's, so
one process-wide flag moves the whole forward pass onto the invariant kernels. When enabled, each
op uses its Triton kernel on CUDA; a CPU tensor takes :mod:`isoaudit.kernels.cpu` (invariant by construction,
in bf16 and fp32), unless :func:`set_cpu_impl` asks for the Triton kernels there too (interpreter
under TRITON_INTERPRET=1, else the torch references). When disabled, each op is what a stock stack would do (cuBLAS/bf16
lm_head/SDPA/the usual chunk and recurrent GDN forms), which is what isoaudit's comparator measures
as the native mismatch.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from . import attention as _attn
from . import cpu as _cpu
from . import elementwise as _ew
from . import fp8 as _fp8
from . import fused_logprobs as _fused
from . import gdn as _gdn
from . import gdn_cpu as _gdn_cpu
from . import gemm as _gemm
from . import logprobs as _lp
from . import ops as _ops
from . import rmsnorm as _rms

_ENABLED = False
_FP8 = False  # with _ENABLED: the model's linear layers in invariant W8A8 (the "invariant-fp8" mode)
_CPU_IMPL = os.environ.get("ISOAUDIT_KERNELS_CPU", "cpu")


def is_enabled() -> bool:
    """Whether this process currently routes through the invariant kernels."""
    return _ENABLED


def set_enabled(flag: bool) -> bool:
    """Set the flag; returns the previous value."""
    global _ENABLED
    prev, _ENABLED = _ENABLED, bool(flag)
    return prev


def set_fp8(flag: bool) -> bool:
    """Whether, when enabled, linear layers run the invariant W8A8 FP8 linear
    (:mod:`isoaudit.kernels.fp8`) instead of the bf16 invariant GEMM; returns the previous value."""
    global _FP8
    prev, _FP8 = _FP8, bool(flag)
    return prev


def is_fp8() -> bool:
    """Whether enabled linear layers run in FP8 (meaningful only while :func:`is_enabled`)."""
    return _FP8


def mode() -> str:
    """The remediation mode this process runs: ``native``, ``invariant`` or ``invariant-fp8``."""
    if not _ENABLED:
        return "native"
    return "invariant-fp8" if _FP8 else "invariant"


def set_cpu_impl(impl: str) -> str:
    """What CPU tensors run when enabled: ``"cpu"`` (:mod:`isoaudit.kernels.cpu`, the default) or
    ``"triton"`` (the Triton modules: their interpreter under TRITON_INTERPRET=1, else their torch
    references). Also set by ``ISOAUDIT_KERNELS_CPU``. Returns the previous value."""
    global _CPU_IMPL
    if impl not in ("cpu", "triton"):
        raise ValueError(f"impl must be 'cpu' or 'triton', not {impl!r}")
    prev, _CPU_IMPL = _CPU_IMPL, impl
    return prev


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and _CPU_IMPL == "cpu"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, the batch-invariant GEMM, or (FP8 mode) the invariant W8A8 linear."""
    if _ENABLED:
        if torch.compiler.is_compiling():  # traced: one opaque op (kernels.ops), the same bits
            return _ops.linear(x, weight, bias)
        return linear_on(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_on(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` with the kernels on, whatever the flag says (what the registered op runs)."""
    if _FP8:
        return _fp8.fp8_linear(x, weight, bias)
    if _on_cpu(x):
        return _cpu.linear(x, weight, bias)
    return _gemm.linear(x, weight, bias)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``x W^T`` (MoE router logits): the invariant GEMM's fp32 output (differentiable), or
    natively the model-dtype ``F.linear`` cast to fp32, as HF's MoE routers compute it."""
    if _ENABLED:
        if _on_cpu(x):
            return _cpu.linear(x, weight, None, torch.float32)
        return _gemm.linear(x, weight, None, torch.float32)
    return F.linear(x, weight).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF-style RMSNorm (fp32 statistics, weight applied in the model dtype) or the invariant one."""
    if _ENABLED:
        if torch.compiler.is_compiling():
            return _ops.rms_norm(x, weight, eps)
        return rms_norm_on(x, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(dtype) if weight is None else weight * h.to(dtype)


def rms_norm_on(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:func:`rms_norm` with the kernels on (what the registered op runs)."""
    if _on_cpu(x):
        return _cpu.rms_norm(x, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _rms.rms_norm_autograd(x, weight, eps)
    return _rms.rms_norm(x, weight, eps)  # type: ignore[return-value]  # one tensor without a residual


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU; the invariant one is row-wise (torch's CPU kernels are not batch-invariant)."""
    if _ENABLED:
        if torch.compiler.is_compiling():
            return _ops.silu(x)
        return silu_on(x)
    return F.silu(x)


def silu_on(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu` with the kernels on (what the registered op runs)."""
    if _on_cpu(x):
        return _cpu.silu(x)
    return _ew.silu_autograd(x) if torch.is_grad_enabled() and x.requires_grad else _ew.silu(x)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) of Gated DeltaNet from its (T, H) projections, fp32."""
    if _ENABLED:
        if _on_cpu(a):
            return _cpu.gdn_gates(a, b, a_log, dt_bias)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, a_log, dt_bias)):
            return _ew.gdn_gates_autograd(a, b, a_log, dt_bias)
        return _ew.gdn_gates(a, b, a_log, dt_bias)
    return _ew.gdn_gates(a, b, a_log, dt_bias, impl="torch")


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise the last dim to unit L2 norm (GDN q/k)."""
    if _ENABLED:
        if _on_cpu(x):
            return _cpu.l2_norm(x, eps)
        if torch.is_grad_enabled() and x.requires_grad:
            return _rms.rms_norm_autograd(x, None, eps, l2=True)
        return _rms.rms_norm(x, None, eps, l2=True)  # type: ignore[return-value]  # one tensor without a residual
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    max_q: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries against a KV cache (layout in :mod:`isoaudit.kernels.attention`).
    ``slots=None``: sequence b lives in cache slot b. ``max_q``: the longest query count, if the
    caller knows it (the native prefill pads to it; else it reads it from the device once)."""
    if _ENABLED:
        if slots is None:
            slots = torch.arange(cu_q.numel() - 1, device=q.device)
        if torch.compiler.is_compiling():
            return _ops.attention(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale)
        return attention_on(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.shape[0] == cu_q.numel() - 1:
        return _native_decode(q, k_cache, v_cache, kv_len, slots, scale)
    return _native_prefill(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale, max_q)


def attention_on(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention` with the kernels on (what the registered op runs)."""
    if _on_cpu(q):
        return _cpu.attention(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        return _attn.attention_autograd(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale)
    return _attn.attention(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale)


def _cache_rows(cache: torch.Tensor, slots: torch.Tensor | None, b: int) -> torch.Tensor:
    """The batch's cache rows, (B, Hkv, L, D): a view when sequence b is slot b."""
    rows = (
        cache[:b] if slots is None else cache.index_select(0, slots.to(device=cache.device, dtype=torch.long))
    )
    return rows.transpose(1, 2)


def _native_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor | None,
    scale: float,
    max_q: int | None,
) -> torch.Tensor:
    """Packed prefill as an engine batches it: the sequences' queries padded to the longest, one
    SDPA over their cache rows with a causal-and-length mask (padded query rows see their
    sequence's first keys and are dropped). No loop over sequences; one host read of the
    longest query count unless ``max_q`` is given."""
    dev = q.device
    b, t = cu_q.numel() - 1, q.shape[0]
    cu = cu_q.to(device=dev, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    if max_q is None:
        max_q = int(lens.max())
    seq = torch.repeat_interleave(torch.arange(b, device=dev), lens, output_size=t)
    row = torch.arange(t, device=dev) - cu[seq]
    qp = q.new_zeros(b, max_q, *q.shape[1:])
    qp[seq, row] = q
    k, v = _cache_rows(k_cache, slots, b), _cache_rows(v_cache, slots, b)
    keys = torch.arange(k_cache.shape[1], device=dev)
    pos = q_pos0.to(device=dev, dtype=torch.long)[:, None] + torch.arange(max_q, device=dev)[None, :]
    mask = (keys[None, None, :] <= pos[:, :, None]) & (
        keys[None, None, :] < kv_len.to(device=dev, dtype=torch.long)[:, None, None]
    )
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)[seq, row]


def _native_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """A decode step as an engine runs it: one query per sequence, one batched SDPA over the
    sequences' cache rows with a length mask; no host synchronisation, so it can be captured in a
    CUDA graph (the per-sequence loop synchronised per sequence and layer)."""
    b = q.shape[0]
    k, v = _cache_rows(k_cache, slots, b), _cache_rows(v_cache, slots, b)  # (B, Hkv, L, D)
    keys = torch.arange(k_cache.shape[1], device=q.device)
    mask = (keys[None, :] < kv_len.to(q.device)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token | row) for each row of hidden: fp32 invariant path, or the stock bf16 lm_head.

    Natively, a head whose fp32 logits outgrow one slab of the fused path
    (:func:`~isoaudit.kernels.fused_logprobs.one_slab`) runs under that path's row blocks and
    vocabulary slabs (:func:`~isoaudit.kernels.fused_logprobs.native_chunked_token_logprobs`): the
    memory of a trainer that chunks its head, and the same chunking as the invariant side, so the
    two compare fairly. Its values may differ from the whole head's in the last bits (one
    ``logsumexp`` per slab, combined with ``logaddexp``); smaller heads keep the whole-head
    ``log_softmax``."""
    if _ENABLED:
        if _on_cpu(hidden):
            return _cpu.token_logprobs(hidden, weight, tokens)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _lp.token_logprobs_autograd(hidden, weight, tokens)
        return _lp.token_logprobs(hidden, weight, tokens)
    h = hidden.reshape(-1, hidden.shape[-1])
    if not _fused.one_slab(h.shape[0], weight.shape[0]):
        return _fused.native_chunked_token_logprobs(h, weight, tokens)
    logits = F.linear(h, weight).float()
    return torch.log_softmax(logits, -1).gather(1, tokens.reshape(-1, 1).long())[:, 0]


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Full fp32 logits (for sampling)."""
    if _ENABLED:
        if torch.compiler.is_compiling():
            return _ops.logits_fp32(hidden.detach(), weight.detach())
        return logits_fp32_on(hidden, weight)
    return F.linear(hidden, weight).float()


def logits_fp32_on(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`logits_fp32` with the kernels on (what the registered op runs)."""
    if _on_cpu(hidden):
        return _cpu.lm_head_logits(hidden, weight)
    return _lp.lm_head_logits(hidden, weight)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim: the invariant one, or ``torch.log_softmax``."""
    if _ENABLED:
        if torch.compiler.is_compiling():
            return _ops.log_softmax(logits.detach())
        return log_softmax_on(logits)
    return torch.log_softmax(logits.float(), dim=-1)


def log_softmax_on(logits: torch.Tensor) -> torch.Tensor:
    """:func:`log_softmax` with the kernels on (what the registered op runs)."""
    if _on_cpu(logits):
        return _cpu.log_softmax(logits)
    return _lp.log_softmax(logits)


def gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk: int = _gdn.CHUNK,
) -> torch.Tensor:
    """Gated DeltaNet over whole sequences from a zero state (the trainer's path)."""
    if _ENABLED:
        if _on_cpu(q):
            return _gdn_cpu.gdn_autograd(q, k, v, g, beta, cu_seqlens, chunk)
        return _gdn.gdn_chunk_autograd(q, k, v, g, beta, cu_seqlens, chunk)
    return _gdn.gdn_chunk_reference(
        q, k, v, g, beta, cu_seqlens, None, chunk, solve="triangular", state_at="end"
    )[0]


def gdn_incremental(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: list[int],
    cache: _gdn.GDNCache,
    chunk: int = _gdn.CHUNK,
) -> torch.Tensor:
    """Gated DeltaNet continuing cached states (the engine's path)."""
    if _ENABLED and _on_cpu(q):
        return _gdn_cpu.gdn_incremental(q, k, v, g, beta, cu_seqlens, slots, cache)
    return _gdn.gdn_incremental(q, k, v, g, beta, cu_seqlens, slots, cache, invariant=_ENABLED, chunk=chunk)
