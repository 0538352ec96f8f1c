"""The CPU invariant kernels (kernels/cpu.py), in bf16 and fp32, without Triton: batch- and
row-offset invariance of every op, prefill/chunked-prefill/decode invariance of attention, and the
end-to-end proof (trainer with autograd vs the rollout engine) on HF Qwen3 and Llama."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from isoaudit.kernels import cpu, dispatch
from isoaudit.kernels.attention import _math_attention
from isoaudit.kernels.gemm import gemm

from isoaudit import kernels

from .conftest import bits_equal
from .test_e2e import _hf, _report, _requests, run_pair

DTYPES = [torch.bfloat16, torch.float32]
I32 = dict(dtype=torch.int32)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a loaded 2-core runner, OpenMP's spinning second thread makes every
    small op slow. The bits do not depend on it (``test_thread_count_changes_no_bit``)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _prefixes_and_offsets(fn, x: torch.Tensor, ms: list[int]) -> None:
    """fn(x[:m]) == fn(x)[:m], fn(x[o:o+n]) == fn(x)[o:o+n], and row permutations, bitwise."""
    full = fn(x)
    for m in ms:
        assert bits_equal(fn(x[:m]), full[:m]), f"m={m}"
    for o, n in ((1, 1), (3, 5), (7, 33), (x.shape[0] - 2, 2)):
        assert bits_equal(fn(x[o : o + n]), full[o : o + n]), f"offset {o}, {n} rows"
    perm = torch.randperm(x.shape[0])
    assert bits_equal(fn(x[perm]), full[perm])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("nk", [(70, 96), (256, 1000), (33, 3000), (512, 64)])
def test_gemm_batch_and_offset_invariant(dtype: torch.dtype, nk: tuple[int, int]) -> None:
    torch.manual_seed(0)
    n, k = nk
    a = torch.randn(300, k).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype)
    _prefixes_and_offsets(lambda x: cpu.gemm(x, w, b), a, [1, 2, 3, 16, 63, 64, 65, 129, 256, 299])
    # fp32 output (the lm_head), and a 3-D input (batch, seq, hidden) row for row
    full32 = cpu.gemm(a, w, out_dtype=torch.float32)
    assert bits_equal(cpu.gemm(a[:5], w, out_dtype=torch.float32), full32[:5])
    assert bits_equal(cpu.gemm(a.view(3, 100, k), w, b), cpu.gemm(a, w, b).view(3, 100, n))
    # accuracy: no worse than the native GEMM against an fp64 reference (plus the output rounding)
    ref = a.double() @ w.double().T + b.double()
    ours = (cpu.gemm(a, w, b).double() - ref).abs().max()
    native = (F.linear(a, w, b).double() - ref).abs().max()
    assert ours <= native * 1.01 + 1e-6


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 80),
    n=st.integers(1, 70),
    k=st.integers(1, 600),
    split=st.integers(0, 80),
    fp32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemm_any_shape(m: int, n: int, k: int, split: int, fp32: bool, seed: int) -> None:
    """Any (M, N, K): the rows computed in two calls at any split equal the rows of one call."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if fp32 else torch.bfloat16
    a = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 8).to(dt)
    w = torch.randn(n, k, generator=g).to(dt)
    s = min(split, m)
    assert bits_equal(torch.cat([cpu.gemm(a[:s], w), cpu.gemm(a[s:], w)]), cpu.gemm(a, w))


def test_gemm_weight_cache_follows_in_place_updates() -> None:
    """The engine's weight sync and the optimizer update weights in place: never a stale result."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    before = cpu.gemm(x, w)
    with torch.no_grad():
        w.mul_(2)
    assert bits_equal(cpu.gemm(x, w), cpu.gemm(x, w.clone()))
    assert not bits_equal(cpu.gemm(x, w), before)
    w.data.copy_(w / 4)  # through .data: no version bump
    assert bits_equal(cpu.gemm(x, w), cpu.gemm(x, w.clone()))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_rmsnorm_silu_gates_invariant(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, w = (torch.randn(200, 333) * 3).to(dtype), (torch.rand(333) + 0.5).to(dtype)
    _prefixes_and_offsets(lambda t: cpu.rms_norm(t, w, 1e-6), x, [1, 2, 17, 199])
    _prefixes_and_offsets(lambda t: cpu.l2_norm(t), x, [1, 5, 100])
    _prefixes_and_offsets(cpu.silu, x, [1, 2, 17, 199])
    flat = x.flatten()  # SiLU is elementwise: any offset in a flat tensor too
    for o in (1, 5, 13, 31):
        assert bits_equal(cpu.silu(flat[o : o + 1000]), cpu.silu(flat)[o : o + 1000])
    a, b = torch.randn(50, 8).to(dtype), torch.randn(50, 8).to(dtype)
    alog, dtb = torch.randn(8), torch.randn(8)
    g_full, beta_full = cpu.gdn_gates(a, b, alog, dtb)
    g3, beta3 = cpu.gdn_gates(a[3:9], b[3:9], alog, dtb)
    assert bits_equal(g3, g_full[3:9]) and bits_equal(beta3, beta_full[3:9])
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    ref = F.rms_norm(x.float(), (333,), w.float(), 1e-6)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6).float(), ref, **tol)
    torch.testing.assert_close(cpu.silu(x).float(), F.silu(x.float()), **tol)
    torch.testing.assert_close(beta_full, torch.sigmoid(b.float()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_full, -torch.exp(alog) * F.softplus(a.float() + dtb), rtol=1e-5, atol=1e-6)


def test_transcendentals_accurate() -> None:
    """exp and exp2 within 2 fp32 ulps over their normal range; log to fp64 precision."""
    x = torch.linspace(-86.5, 88.5, 400_001)
    ref = torch.exp(x.double())
    assert ((cpu.exp(x).double() - ref).abs() / ref).max() < 2 * 2**-24
    x2 = torch.linspace(-124.9, 127.9, 400_001)
    ref2 = torch.exp2(x2.double())
    assert ((cpu.exp2(x2).double() - ref2).abs() / ref2).max() < 2 * 2**-24
    edges = torch.tensor([float("-inf"), -200.0, 100.0, float("inf")])
    assert bits_equal(cpu.exp(edges), torch.tensor([0.0, 0.0, float("inf"), float("inf")]))
    assert bits_equal(cpu.exp2(edges * 2), torch.tensor([0.0, 0.0, float("inf"), float("inf")]))
    y = torch.rand(100_000, dtype=torch.float64) * 1e6 + 1e-30
    assert (cpu.log(y) - torch.log(y)).abs().max() < 4e-15


def test_tree_sum_order_depends_on_width_only() -> None:
    x = torch.randn(50, 1001)
    full = cpu.tree_sum(x)
    assert bits_equal(cpu.tree_sum(x[7:9]), full[7:9])
    assert bits_equal(cpu.tree_sum(x.T.contiguous(), dim=0), full)  # any dim: the same tree
    assert bits_equal(
        cpu.tree_sum(x[:, None, :].expand(50, 3, 1001).transpose(1, 2), dim=1), full[:, None].expand(50, 3)
    )
    torch.testing.assert_close(full.double(), x.double().sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_logprobs_invariant(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    h, w = torch.randn(40, 48).to(dtype), (torch.randn(3001, 48) / 7).to(dtype)
    tok = torch.randint(0, 3001, (40,))
    full = cpu.token_logprobs(h, w, tok)
    for s in (slice(0, 1), slice(0, 7), slice(5, 6), slice(9, 40)):
        assert bits_equal(cpu.token_logprobs(h[s], w, tok[s]), full[s])
    _prefixes_and_offsets(lambda z: cpu.log_softmax(z), torch.randn(40, 3001) * 4, [1, 3, 39])
    ref = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, tok[:, None])[:, 0]
    assert (full.double() - ref).abs().max() < 1e-5


def _attn(q, k, v, cu, pos0, kv_len, slots=None) -> torch.Tensor:
    return cpu.attention(q, k, v, torch.tensor(cu, **I32), torch.tensor(pos0, **I32), torch.tensor(kv_len, **I32),
                         None if slots is None else torch.tensor(slots, **I32))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_attention_prefill_chunked_decode_same_bits(dtype: torch.dtype) -> None:
    """One sequence crossing two 256-key tiles: full prefill, chunked prefill (13, 64, 257), and
    decode of single rows packed beside other sequences of other lengths, all bitwise equal."""
    torch.manual_seed(0)
    n, hq, hkv, d = 530, 8, 2, 32
    q = torch.randn(n, hq, d).to(dtype)
    k, v = (torch.randn(1, n + 40, hkv, d).to(dtype) for _ in range(2))
    full = _attn(q, k, v, [0, n], [0], [n])
    for c in (13, 64, 257):
        parts = [_attn(q[s : s + c], k, v, [0, min(c, n - s)], [s], [min(s + c, n)]) for s in range(0, n, c)]
        assert bits_equal(torch.cat(parts), full), f"chunk {c}"
    other = torch.randn(5, hq, d).to(dtype)
    kk, vv = torch.cat([torch.randn_like(k), k]), torch.cat([torch.randn_like(v), v])
    at = [0, 1, 255, 256, 257, 511, 512, 529]
    rows = [
        _attn(torch.cat([other, q[p : p + 1]]), kk, vv, [0, 5, 6], [p % 11, p], [p % 11 + 5, p + 1], [0, 1])[
            5:
        ]
        for p in at
    ]
    assert bits_equal(torch.cat(rows), full[at])
    ref = _math_attention(q, k, v, *(torch.tensor(t, **I32) for t in ([0, n], [0], [n], [0])), d**-0.5)
    tol = 2**-8 if dtype == torch.bfloat16 else 2e-6  # bf16: within its output rounding
    assert ((full.float() - ref).abs() <= tol * ref.abs() + tol).all()


def test_attention_short_cache_reads_zeros() -> None:
    """Cached keys at or past a sequence's kv_len count as zeros, not as what the cache holds."""
    torch.manual_seed(1)
    k, v = torch.randn(2, 80, 2, 16), torch.randn(2, 80, 2, 16)
    q = torch.randn(6, 4, 16)
    out = _attn(q, k, v, [0, 3, 6], [30, 50], [20, 45], [1, 0])
    k2, v2 = k.clone(), v.clone()
    k2[1, 20:], v2[1, 20:], k2[0, 45:], v2[0, 45:] = 0, 0, 0, 0
    assert bits_equal(out, _attn(q, k2, v2, [0, 3, 6], [30, 50], [20, 45], [1, 0]))


def test_thread_count_changes_no_bit() -> None:
    """BLAS splits work over threads differently; exact integer sums make that irrelevant."""
    torch.manual_seed(0)
    a, w = torch.randn(300, 700).bfloat16(), torch.randn(500, 700).bfloat16()
    q, k = torch.randn(300, 4, 32), torch.randn(1, 300, 2, 32)
    one = cpu.gemm(a, w), _attn(q, k, k, [0, 300], [0], [300])
    torch.set_num_threads(2)
    try:
        two = cpu.gemm(a, w), _attn(q, k, k, [0, 300], [0], [300])
    finally:
        torch.set_num_threads(1)
    assert bits_equal(one[0], two[0]) and bits_equal(one[1], two[1])


def test_autograd_matches_native() -> None:
    """The trainer backprops through every CPU op; gradients agree with the native ones."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 32, requires_grad=True)
    w = (torch.randn(48, 32) / 6).requires_grad_()
    nw = (torch.rand(48) + 0.5).requires_grad_()
    lm = (torch.randn(100, 48) / 7).requires_grad_()
    tok = torch.randint(0, 100, (18,))

    def forward(native: bool) -> torch.Tensor:
        lin = F.linear if native else cpu.linear
        h = lin(x, w)
        h = F.rms_norm(h, (48,), nw, 1e-6) if native else cpu.rms_norm(h, nw, 1e-6)
        h = F.silu(h) if native else cpu.silu(h)
        q = h.view(18, 3, 16)
        kv = h.view(2, 9, 3, 16)
        cu, pos0, kvl = torch.tensor([0, 9, 18], **I32), torch.zeros(2, **I32), torch.full((2,), 9, **I32)
        if native:
            o = _math_attention(q, kv, kv, cu, pos0, kvl, torch.arange(2), 0.25)
            return torch.log_softmax(F.linear(o.reshape(18, 48), lm), -1).gather(1, tok[:, None]).sum()
        o = cpu.attention(q, kv, kv, cu, pos0, kvl, None, 0.25)
        return cpu.token_logprobs(o.reshape(18, 48), lm, tok).sum()

    grads = []
    for native in (True, False):
        for t in (x, w, nw, lm):
            t.grad = None
        forward(native).backward()
        grads.append([t.grad.clone() for t in (x, w, nw, lm)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_routing_sends_cpu_tensors_here() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(5, 40), torch.randn(24, 40)
    with kernels.enable():
        assert bits_equal(dispatch.linear(x, w), cpu.gemm(x, w))
        prev = dispatch.set_cpu_impl("triton")
        try:
            assert bits_equal(dispatch.linear(x, w), gemm(x, w))  # the Triton module's own choice
        finally:
            dispatch.set_cpu_impl(prev)
    assert bits_equal(dispatch.linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="impl"):
        dispatch.set_cpu_impl("cuda")


# -- end to end: trainer (whole sequences, autograd) vs engine (batched, chunked prefill, decode) --

FAMILIES = ["qwen3", "llama"]


@pytest.fixture(scope="module", params=[(f, dt) for f in FAMILIES for dt in ("bf16", "fp32")], ids=str)
def tiny_model(request: pytest.FixtureRequest):
    family, dt = request.param
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    return family, dt, _hf(family, 2, 64, 16, 256, dtype, "cpu")


def test_e2e_trainer_equals_engine(tiny_model) -> None:
    family, dt, model = tiny_model
    prompts, new = _requests(256, [3, 9, 20, 33], [6, 3, 5, 12])
    if dt == "bf16":
        native = run_pair(model, False, prompts, new)
        _report(f"{family}-cpu-bf16 native", native)
        assert native["mean_abs_delta"] > 0  # bf16 on the CPU has a real native mismatch
    for chunk in (None, 4):
        res = run_pair(model, True, prompts, new, chunk)
        _report(f"{family}-cpu-{dt} isoaudit.kernels.cpu chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0


def test_e2e_across_key_tiles() -> None:
    """Sequences whose prefill and decode cross the 256-key tile boundary, chunked at 64."""
    model = _hf("qwen3", 2, 64, 16, 256, torch.bfloat16, "cpu")
    prompts, new = _requests(256, [250, 262, 30], [12, 6, 20])
    for chunk in (None, 64):
        res = run_pair(model, True, prompts, new, chunk)
        _report(f"qwen3-cpu-bf16 isoaudit.kernels.cpu across tiles chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
