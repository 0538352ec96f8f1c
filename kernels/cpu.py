"""Batch-invariant kernels for CPU tensors, in bf16, fp16 and fp32, without Triton.

Torch's CPU ops do not promise batch invariance: BLAS picks its kernel and blocking from M, SDPA
tiles by the query count, and elementwise kernels evaluate a vector body and a scalar tail with
different code. Everything here is built from three pieces whose bits are fixed *by construction*,
whatever the shape, the thread count or how torch vectorises a call:

1. **Exact products through fp64 BLAS** (:func:`exact_matmul`). Each row of an operand is scaled by
   a power of two and rounded to integers of ``bits`` bits (two slices for fp32 inputs), with
   ``bits`` chosen from K so that every partial sum of K products stays below 2^53. Every sum is
   then exact in fp64, so any BLAS, in any order, blocking or thread split, returns the same
   integers; they are scaled back (exactly) and rounded once. A row's result depends on that row
   of each operand and on K only. (16-bit inputs with an exponent within ``bits - 8`` of their
   row's maximum are represented exactly; smaller ones are rounded to that row's grid.)
2. **Fixed trees** (:func:`tree_sum`): sums over a model dimension (hidden size, vocab) as
   ``log2 n`` elementwise adds of fixed halves, so the order depends on ``n`` only.
3. **Transcendentals from IEEE ops** (:func:`exp`, :func:`exp2`, :func:`log`): range reduction
   and a polynomial written as separate torch multiplies and adds, and powers of two built from
   their bits. IEEE +, -, *, / and sqrt are correctly rounded, so every element has the same bits
   wherever it sits in a tensor.

Attention follows the same rules per query row (see :func:`attention`): scores as exact integer
dot products, a softmax over the keys up to the row's position, its weights quantised to a fixed
grid and summed exactly, the values summed exactly in fixed 256-key tiles at absolute positions,
the tiles added in ascending order, one division. Prefill, chunked prefill and decode give the same
bits. Gradients (the trainer backprops) reuse the backward passes of the Triton modules: correct,
not invariant (the contract is the forward's bits).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

# Named imports: the package's attributes ``gemm`` and ``attention`` are functions, not these modules.
from .attention import CONFIG as _ATTN_CONFIG
from .attention import LOG2E, _check_heads
from .attention import _Attention as _AttentionBackward
from .elementwise import _Gates as _GatesBackward
from .elementwise import _Silu as _SiluBackward
from .gemm import _Linear as _LinearBackward
from .logprobs import _TokenLogprobs as _TokenLogprobsBackward
from .rmsnorm import _RMSNorm as _RMSNormBackward

__all__ = [
    "attention",
    "exact_matmul",
    "exp",
    "exp2",
    "gdn_gates",
    "gemm",
    "l2_norm",
    "linear",
    "lm_head_logits",
    "log",
    "log_softmax",
    "logsumexp_rows",
    "rms_norm",
    "silu",
    "token_logprobs",
    "tree_sum",
]

MANTISSA = 53  # fp64 represents every integer of magnitude <= 2^53 exactly
KEY_TILE = 256  # attention: values summed exactly per tile of absolute key positions
PROB_BITS = 23  # attention weights on a 2^-23 grid; PROB_BITS + VALUE_BITS + log2(KEY_TILE) <= 53
VALUE_BITS = 22
QUERY_BLOCK_ELEMS = 1 << 22  # attention score elements per query block (bounds memory)
WEIGHT_CACHE_BYTES = 1 << 30  # integer forms of weights kept between calls


# ---------------------------------------------------------------------------------------------
# Building blocks


def _grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 from the exponent bits (exact; e clamped to the normal range)."""
    return ((e.to(torch.int64) + 1023).clamp(1, 2046) << 52).view(torch.float64)


def _pow2_f32(n: torch.Tensor) -> torch.Tensor:
    """2^n as float32 from the exponent bits, for int32 n in [-126, 127] (the callers' ranges)."""
    return ((n + 127) << 23).view(torch.float32)


def _times_pow2(p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """p 2^n (exact) by adding n to p's exponent field; the caller keeps the result normal."""
    return (p.view(torch.int32) + (n.to(torch.int32) << 23)).view(torch.float32)


def sum_bits(k: int) -> int:
    """Bits per integer slice such that k products of two slices sum exactly in fp64."""
    return (MANTISSA - (max(k, 1) - 1).bit_length()) // 2


def slices_for(*dtypes: torch.dtype) -> int:
    """One slice carries a 16-bit float exactly (near its row's maximum); fp32 needs two."""
    return 2 if any(d.itemsize >= 4 for d in dtypes) else 1


MIN_EXPONENT = -100  # rows whose maximum is below 2^-100 (zero rows included) use this scale


def row_exponent(x: torch.Tensor) -> torch.Tensor:
    """e (int32) per row (last dim) with max |x| < 2^e (frexp is exact, so this is too), at least
    MIN_EXPONENT (a zero row gets 0), so every scale 2^(bits - e) is a normal fp32 and scaling by
    it is exact."""
    return torch.frexp(x.abs().amax(-1).float())[1].clamp_(min=MIN_EXPONENT)


def split_rows(
    x: torch.Tensor, bits: int, slices: int, right: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Row exponents e and integer slices (float64) with x ~= 2^(e-bits) (X_0 + X_1 2^-bits), as
    the operands of :func:`exact_matmul`: ``[X_0]``, or for two slices ``[X_0, cat(X_0, X_1)]``
    (``right``: ``[X_0, cat(X_1, X_0)]``), so one product of the second operands is both cross
    terms."""
    e = row_exponent(x)
    t = x.float() * _pow2_f32(bits - e)[..., None]  # |t| < 2^bits <= 2^24: exact in fp32
    hi = torch.round(t)
    if slices == 1:
        return [hi.double()], e
    lo = torch.round((t - hi) * 2.0**bits)  # t - hi is exact (|t - hi| <= 1/2)
    return [hi.double(), torch.cat([lo, hi] if right else [hi, lo], -1).double()], e


def exact_matmul(a: list[torch.Tensor], b: list[torch.Tensor], bits: int) -> torch.Tensor:
    """``sum_k A[..., m, k] B[..., n, k]`` of integer slices (fp64) from :func:`split_rows` (b with
    ``right``), every partial sum exact, so the result does not depend on how the BLAS orders,
    blocks or threads it. Two slices: hi x hi, then both cross terms in one product (each exact);
    the lo x lo term (2^-2bits of the result) is dropped."""
    g = a[0] @ b[0].transpose(-1, -2)
    if len(a) == 2:
        g = g + (a[1] @ b[1].transpose(-1, -2)) * 2.0**-bits
    return g


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` (default the last) by a fixed tree: zero-padded to a power of two p (adding
    0 is exact), then each level adds the upper half to the lower (element j + p/2 onto j).
    Elementwise adds of contiguous halves only, so the order depends on the dim's size alone."""
    dim = dim % x.ndim
    n = x.shape[dim]
    if n == 0:
        return x.new_zeros(x.shape[:dim] + x.shape[dim + 1 :])
    p = 1 << (n - 1).bit_length()
    if p != n:
        x = F.pad(x, (0, 0) * (x.ndim - 1 - dim) + (0, p - n))
    while p > 1:
        p //= 2
        x = x.narrow(dim, 0, p) + x.narrow(dim, p, p)
    return x.select(dim, 0)


def _horner(r: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    p = r * coeffs[0]
    p.add_(coeffs[1])
    for c in coeffs[2:]:
        p.mul_(r).add_(c)  # one rounding each: never contracted into an FMA
    return p


_EXP = tuple(1.0 / math.factorial(k) for k in range(7, -1, -1))  # e^r, |r| <= ln2/2
_EXP2 = tuple(math.log(2.0) ** k / math.factorial(k) for k in range(7, -1, -1))  # 2^f, |f| <= 1/2
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # Cody-Waite split: n * _LN2_HI is exact in fp32


def _edges(x: torch.Tensor, p: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """0 below ``lo``, inf above ``hi``, NaN for NaN; ``p`` elsewhere."""
    return torch.where(x < lo, 0.0, torch.where(x > hi, float("inf"), torch.where(x == x, p, x)))


def exp2(x: torch.Tensor) -> torch.Tensor:
    """2^x in fp32 (about 1 ulp): a polynomial in the exact remainder f = x - round(x), its
    exponent field raised by round(x). 0 below 2^-125 (and for -inf)."""
    x = x.float()
    xc = x.clamp(-126.0, 128.0)
    n = torch.round(xc)
    p = _times_pow2(_horner(xc - n, _EXP2), n)  # 2^f in [0.70, 1.42]: normal for n >= -125
    return _edges(x, p, -125.0, 128.0)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in fp32 (about 1 ulp): Cody-Waite reduction by ln 2, a degree-7 polynomial, 2^n.
    0 below e^-86.6 (about 2^-125)."""
    x = x.float()
    xc = x.clamp(-87.0, 88.5)
    n = torch.round(xc * 1.4426950408889634)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = _times_pow2(_horner(r, _EXP), n)  # e^r in [0.70, 1.42]: normal for n >= -125
    return _edges(x, p, -86.6, 88.72)


_LOG_TERMS = tuple(1.0 / (2 * k + 1) for k in range(11, -1, -1))


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in fp64 (to ~1e-16) of positive x: exact frexp, then 2 atanh((m-1)/(m+1))."""
    m, e = torch.frexp(x.to(torch.float64))
    small = m < 0.7071067811865476
    m = torch.where(small, m * 2.0, m)
    e = e - small.to(e.dtype)
    u = (m - 1.0) / (m + 1.0)
    return e.to(torch.float64) * math.log(2.0) + 2.0 * u * _horner(u * u, _LOG_TERMS)


# ---------------------------------------------------------------------------------------------
# GEMM

_WEIGHTS: OrderedDict[tuple[int, int, int], tuple] = OrderedDict()
_weights_bytes = 0


def _forget(key: tuple[int, int, int]) -> None:
    global _weights_bytes
    hit = _WEIGHTS.pop(key, None)
    if hit is not None:
        _weights_bytes -= hit[-1]


def _same_values(w: torch.Tensor, seen: torch.Tensor) -> bool:
    """Bitwise equality, fast: numpy compares the bytes as int64 words (torch.equal is ~5x slower)."""
    if w.shape != seen.shape or w.dtype != seen.dtype:
        return False
    if not w.is_contiguous() or (w.numel() * w.element_size()) % 8 or w.data_ptr() % 8:
        return torch.equal(w, seen)
    a, b = (t.reshape(-1).view(torch.uint8).view(torch.int64).numpy() for t in (w.detach(), seen))
    return bool(np.array_equal(a, b))


def _split_weight(w: torch.Tensor, bits: int, slices: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    parts, e = split_rows(w.detach(), bits, slices, right=True)
    return parts, _pow2_f32(e - bits)


def _weight_parts(w: torch.Tensor, bits: int, slices: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A weight's integer slices, kept (LRU, bounded bytes) while the weight holds the same values:
    the decode step's small-M GEMMs would otherwise spend most of their time converting it. The
    check compares the values with a kept copy (``param.data.copy_`` bumps no version counter).
    Returns the operands and the rows' scales 2^(e - bits)."""
    global _weights_bytes
    if w.is_inference() or w.requires_grad and torch.is_grad_enabled():
        return _split_weight(w, bits, slices)
    key = (id(w), bits, slices)
    hit = _WEIGHTS.get(key)
    if hit is not None:
        ref, seen, parts, e, size = hit
        if ref() is w and _same_values(w, seen):
            with contextlib.suppress(KeyError):  # another thread may have evicted it meanwhile
                _WEIGHTS.move_to_end(key)
            return parts, e
        _forget(key)
    parts, e = _split_weight(w, bits, slices)
    size = sum(p.numel() * 8 for p in parts) + w.numel() * w.element_size()
    if size <= WEIGHT_CACHE_BYTES:
        while _WEIGHTS and _weights_bytes + size > WEIGHT_CACHE_BYTES:
            _forget(next(iter(_WEIGHTS)))

        def drop(_: object, key: tuple[int, int, int] = key) -> None:  # w was collected
            _forget(key)

        ref = weakref.ref(w, drop)
        _WEIGHTS[key] = (ref, w.detach().clone(), parts, e, size)
        _weights_bytes += size
    return parts, e


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for x (..., K), weight (N, K): exact integer products (fp32
    inputs: two slices), scaled back and rounded once to fp32, bias added in fp32, rounded to
    ``out_dtype`` (default x's). Each output depends on its row of x, its row of weight and K."""
    n, k = weight.shape
    a = x.reshape(math.prod(x.shape[:-1]), k)
    if k == 0 or a.shape[0] == 0:
        y = torch.zeros(a.shape[0], n, dtype=torch.float32)
    else:
        slices = slices_for(x.dtype, weight.dtype)
        bits = sum_bits(k)
        wp, w_scale = _weight_parts(weight, bits, slices)
        ap, ae = split_rows(a.detach(), bits, slices)
        # Rounding to fp32 commutes with the exact power-of-two scales that follow.
        y = exact_matmul(ap, wp, bits).float() * _pow2_f32(ae - bits)[:, None] * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], n)


class _Linear(_LinearBackward):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return gemm(x, weight, bias, out_dtype)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear`` semantics on the invariant GEMM; differentiable (backward in torch)."""
    if _grad(x, weight, bias):
        return _Linear.apply(x, weight, bias, out_dtype)
    return gemm(x, weight, bias, out_dtype)


# ---------------------------------------------------------------------------------------------
# Norms and elementwise


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float, l2: bool) -> torch.Tensor:
    xf = x.float()
    ss = tree_sum(xf * xf)[..., None]
    inv = 1.0 / torch.sqrt(ss + eps) if l2 else 1.0 / torch.sqrt(ss / x.shape[-1] + eps)
    y = (xf * inv).to(x.dtype)
    if weight is not None:
        y = (y.float() * weight.float()).to(torch.promote_types(x.dtype, weight.dtype))
    return y


class _RMSNorm(_RMSNormBackward):
    @staticmethod
    def forward(ctx, x, weight, eps, l2):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.l2 = eps, l2
        return _rms(x, weight, eps, l2)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, l2: bool = False
) -> torch.Tensor:
    """RMSNorm with the kernel's arithmetic (fp32 sum of squares, ``1/sqrt(mean + eps)``, round,
    times the weight in fp32, round); the sum is a fixed tree over the hidden size."""
    if _grad(x, weight):
        return _RMSNorm.apply(x, weight, eps, l2)
    return _rms(x, weight, eps, l2)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit L2 norm over the last dim (GDN q/k), same construction."""
    return rms_norm(x, None, eps, l2=True)


def _silu_fp32(xf: torch.Tensor) -> torch.Tensor:
    return xf / (1.0 + exp(-xf))


_TABLES: dict[torch.dtype, torch.Tensor] = {}


def _table(dtype: torch.dtype) -> torch.Tensor:
    """SiLU of every 16-bit pattern of ``dtype``, at index (pattern as int16) + 2^15."""
    t = _TABLES.get(dtype)
    if t is None:
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        t = _TABLES[dtype] = _silu_fp32(every.float()).to(dtype)
    return t


def _silu(x: torch.Tensor) -> torch.Tensor:
    """16-bit inputs look their value up in a table of the fp32 formula (the same bits in 3
    passes instead of ~25); fp32 inputs evaluate it."""
    if x.dtype.itemsize == 2:
        idx = x.contiguous().view(torch.int16).to(torch.int32).add_(2**15)
        return _table(x.dtype).index_select(0, idx.view(-1)).view(x.shape)
    return _silu_fp32(x.float()).to(x.dtype)


class _Silu(_SiluBackward):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _silu(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + e^-x)`` in fp32, rounded once to x's dtype."""
    return _Silu.apply(x) if _grad(x) else _silu(x)


def _gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    z = a.float() + dt_bias.float()
    softplus = torch.where(z > 20.0, z, log(1.0 + exp(torch.clamp(z, max=20.0))).float())
    return -exp(a_log.float()) * softplus, 1.0 / (1.0 + exp(-b.float()))


class _Gates(_GatesBackward):
    @staticmethod
    def forward(ctx, a, b, a_log, dt_bias):
        ctx.save_for_backward(a, b, a_log, dt_bias)
        return _gates(a, b, a_log, dt_bias)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, fp32."""
    if _grad(a, b, a_log, dt_bias):
        return _Gates.apply(a, b, a_log, dt_bias)
    return _gates(a, b, a_log, dt_bias)


# ---------------------------------------------------------------------------------------------
# fp32 lm_head, log-softmax, token logprobs


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits from the invariant GEMM."""
    return gemm(hidden, weight, out_dtype=torch.float32)


def logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    """Per-row ``max + log(sum exp(z - max))`` of fp32 logits (T, V): exact max, the invariant
    exp, a fixed tree over V, the log in fp64, rounded once to fp32."""
    z = z.float()
    m = z.amax(-1)
    s = tree_sum(exp(z - m[:, None]))
    return (m.double() + log(s)).float()


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Invariant fp32 log-softmax over the last dim."""
    z = logits.float().reshape(-1, logits.shape[-1])
    return (z - logsumexp_rows(z)[:, None]).reshape(logits.shape)


def _token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    z = lm_head_logits(hidden.reshape(-1, hidden.shape[-1]), weight)
    return z.gather(1, tokens.reshape(-1, 1).long())[:, 0] - logsumexp_rows(z)


class _TokenLogprobs(_TokenLogprobsBackward):
    @staticmethod
    def forward(ctx, hidden, weight, tokens):
        z = lm_head_logits(hidden.reshape(-1, hidden.shape[-1]), weight)
        lse = logsumexp_rows(z)
        ctx.save_for_backward(hidden, weight, tokens, z, lse)  # the backward reads the logits
        return z.gather(1, tokens.reshape(-1, 1).long())[:, 0] - lse


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token | row) per row of ``hidden``: fp32 lm_head, log-softmax, gather."""
    if _grad(hidden, weight):
        return _TokenLogprobs.apply(hidden, weight, tokens)
    return _token_logprobs(hidden, weight, tokens)


# ---------------------------------------------------------------------------------------------
# Attention


class _Keys:
    """A call's keys and values, (B, Hkv, L, D), split once for all its query blocks."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, q_dtype: torch.dtype) -> None:
        d = k.shape[-1]
        self.bits, self.slices = sum_bits(d), slices_for(q_dtype, k.dtype)
        kp, ke = split_rows(k, self.bits, self.slices, right=True)
        self.k = [t.permute(0, 2, 1, 3).contiguous() for t in kp]
        self.k_scale = _pow2_f32(ke - self.bits).permute(0, 2, 1)  # (B, Hkv, L)
        vp, ve = split_rows(v, VALUE_BITS, 1)
        self.v = vp[0].permute(0, 2, 1, 3).contiguous()
        ve = ve.permute(0, 2, 1)
        self.v_scale = _pow2_f32(ve.clamp(max=127))  # key j's values are 2^(e_j - VALUE_BITS) V_j
        self.v_top = torch.cummax(ve, -1).values  # E for a row at position p: v_top[..., p]


def _attend(q: torch.Tensor, keys: _Keys, pos: torch.Tensor, c: float) -> torch.Tensor:
    """One query block: q (B, Hkv, R, D) rows at absolute positions ``pos`` (B, 1, R) against the
    keys up to the block's last position (any further key is masked for every row). fp64 out."""
    lk = int(pos.max()) + 1
    qp, qe = split_rows(q, keys.bits, keys.slices)
    g = exact_matmul(qp, [t[:, :, :lk] for t in keys.k], keys.bits)
    # Rounding to fp32 commutes with the exact power-of-two scales that follow.
    s = g.float() * _pow2_f32(qe - keys.bits)[..., None] * keys.k_scale[..., None, :lk]
    s = s.masked_fill_(torch.arange(lk) > pos[..., None], float("-inf"))
    m = s.amax(-1, keepdim=True)  # finite: every row sees its own key
    p = exp2((s - m) * c)  # in [0, 1], exactly 1 at the max, 0 where masked
    den = torch.round(p * 2.0**PROB_BITS).sum(-1, dtype=torch.float64)  # integers: exact
    # The weights carry key j's value scale relative to the largest over the keys this row sees
    # (E, a cummax: causal by position); each is an integer of at most PROB_BITS bits.
    top = keys.v_top.gather(-1, pos.expand(*keys.v_top.shape[:2], -1))  # (B, Hkv, R)
    w = torch.round(p * _pow2_f32(PROB_BITS - top)[..., None] * keys.v_scale[..., None, :lk]).double()
    acc = torch.zeros(*q.shape[:-1], q.shape[-1], dtype=torch.float64)
    for t0 in range(0, lk, KEY_TILE):  # each tile exact; tiles added in ascending order
        acc = acc + w[..., t0 : t0 + KEY_TILE] @ keys.v[:, :, t0 : min(lk, t0 + KEY_TILE)]
    return acc * pow2_f64(top - VALUE_BITS)[..., None] / den[..., None]


def _attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = _check_heads(hq, hkv, _ATTN_CONFIG)
    out = torch.empty_like(q)
    nb = cu_q.numel() - 1
    if nb == 0 or t == 0:
        return out
    c = (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    cu, lens = cu_q.long(), (cu_q[1:] - cu_q[:-1]).long()
    lq = int(lens.max())
    lk = int((q_pos0.long() + lens).max())  # keys any row can see
    i = torch.arange(lq)
    valid = i[None, :] < lens[:, None]  # (B, lq)
    tok = torch.where(valid, cu[:-1, None] + i[None, :], 0)
    pos = torch.where(valid, q_pos0.long()[:, None] + i[None, :], 0)
    sl = slots.long()
    k, v = k_cache[sl, :lk], v_cache[sl, :lk]  # (B, lk, Hkv, D)
    if bool((kv_len < lk).any()):  # past a cache's length: zeros
        live = (torch.arange(lk)[None, :] < kv_len.long()[:, None])[..., None, None]
        k, v = torch.where(live, k, 0), torch.where(live, v, 0)
    keys = _Keys(k, v, q.dtype)
    qq = q[tok].view(nb, lq, hkv, g, d).permute(0, 2, 1, 3, 4)  # (B, Hkv, lq, G, D)
    step = max(1, QUERY_BLOCK_ELEMS // max(1, nb * hq * lk))
    res = torch.empty(nb, hkv, lq, g, d, dtype=torch.float64)
    for i0 in range(0, lq, step):  # rows are independent: blocking changes no bit
        i1 = min(lq, i0 + step)
        rows = qq[:, :, i0:i1].reshape(nb, hkv, (i1 - i0) * g, d)
        rpos = pos[:, None, i0:i1, None].expand(-1, -1, -1, g).reshape(nb, 1, (i1 - i0) * g)
        res[:, :, i0:i1] = _attend(rows, keys, rpos, c).view(nb, hkv, i1 - i0, g, d)
    o = res.permute(0, 2, 1, 3, 4).reshape(nb, lq, hq, d).to(q.dtype)
    out[tok[valid]] = o[valid]
    return out


class _Attention(_AttentionBackward):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, q_pos0, kv_len, slots, scale):
        out = _attention(q, k, v, cu_q, q_pos0, kv_len, slots, scale)
        ctx.save_for_backward(q, k, v, cu_q, q_pos0, kv_len, slots, out)
        ctx.scale = scale
        return out


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries against a KV cache, layout as :mod:`isoaudit.kernels.attention`.

    Per query row at absolute position p (keys 0..p; cached keys past ``kv_len`` count as zeros):
    scores ``q.k`` as exact integer dot products rounded once to fp32; ``w_j = 2^((s_j - max) c)``
    by :func:`exp2` (c = scale log2 e); the denominator ``sum_j round(w_j 2^23)`` exact; the
    numerator ``sum_j round(w_j 2^(23 + e_j - E)) V_j`` with V_j key j's values on a 2^22 grid of
    their own scale e_j (E: the largest e_j over keys 0..p), exact within each 256-key tile at
    absolute positions, the tiles added in ascending order in fp64; one division, one rounding.
    Nothing depends on which other rows, keys past p, or sequences are in the call."""
    if slots is None:
        slots = torch.arange(cu_q.numel() - 1, dtype=torch.int32)
    if _grad(q, k_cache, v_cache):
        s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return _Attention.apply(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, s)
    return _attention(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale)
