"""The invariant CPU Gated DeltaNet (kernels/gdn_cpu.py), in bf16 and fp32, without Triton:
batch-invariant (a sequence's output and state do not depend on the rest of the call or its place
in it), prefill/decode-invariant (chunked prefill then token-by-token decode in a mixed batch
equals the one-shot prefill bit for bit, state included), within a stated tolerance of the fp64
recurrence, differentiable, and routed to by ``isoaudit.kernels.dispatch`` on the CPU (end to end on the
hybrid GDN LM in bf16: trainer and engine equal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from isoaudit.kernels import dispatch, gdn_cpu
from isoaudit.kernels.gdn import GDNCache, gdn_chunk_reference, gdn_recurrent

from isoaudit import kernels

from .conftest import bits_equal
from .test_e2e import _gdn, _report, _requests, run_pair

DTYPES = [torch.bfloat16, torch.float32]
IDS = ["bf16", "fp32"]
# Forward tolerance against the fp64 recurrence on the same (rounded) inputs: max |o - o64| and
# max |H - H64| within OUT_RTOL * max(1, max |ref|). The state is fp32 throughout, so bf16 inputs
# are as accurate as fp32 ones (measured: ~1.5e-8 on o, ~1.2e-7 on H at these shapes).
OUT_RTOL = 1e-6
BWD_RTOL = 1e-4  # as tests/kernels/test_gdn.py: max |grad - ref| / max |ref| per input


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _inputs(t: int, h: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.3
    beta = torch.rand(t, h, generator=gen)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _rows(x: list[torch.Tensor], s: int, n: int) -> list[torch.Tensor]:
    return [t[s : s + n] for t in x]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_batch_invariant(dtype: torch.dtype) -> None:
    """Each sequence alone, packed with others in any order, with other initial states beside it:
    the same bits of o and of the final state."""
    lens = [70, 1, 33, 130, 64]
    x = _inputs(sum(lens), 3, 32, 48, dtype)
    starts = _cu(lens)[:-1].tolist()
    h0 = torch.randn(len(lens), 3, 32, 48) * 0.1
    o, h = gdn_cpu.gdn(*x, _cu(lens), h0)
    for i, (s, n) in enumerate(zip(starts, lens, strict=True)):
        oi, hi = gdn_cpu.gdn(*_rows(x, s, n), _cu([n]), h0[i : i + 1])
        assert bits_equal(oi, o[s : s + n]) and bits_equal(hi[0], h[i]), f"sequence {i} alone"
    for perm in ([4, 2, 0, 3, 1], [3, 1]):
        xs = [torch.cat([t[starts[i] : starts[i] + lens[i]] for i in perm]) for t in x]
        op, hp = gdn_cpu.gdn(*xs, _cu([lens[i] for i in perm]), h0[perm])
        want = torch.cat([o[starts[i] : starts[i] + lens[i]] for i in perm])
        assert bits_equal(op, want) and bits_equal(hp, h[perm]), f"order {perm}"


def test_in_place_tree_is_cpu_tree_sum() -> None:
    from isoaudit.kernels.cpu import tree_sum

    for n in (1, 2, 3, 16, 24, 100, 128):
        x = torch.randn(5, n, 7) * torch.rand(5, n, 1) * 100
        assert bits_equal(gdn_cpu.tree_sum_rows_(x.clone()), tree_sum(x, dim=1)), n


@pytest.mark.parametrize("pairs", [1, 4])
def test_state_blocks_change_no_bit(monkeypatch: pytest.MonkeyPatch, pairs: int) -> None:
    """Large batches step through their (sequence, head) states in L2-sized blocks; the block size
    changes no bit."""
    lens = [40, 7, 23]
    x = _inputs(sum(lens), 3, 16, 16, torch.bfloat16, seed=6)
    whole = gdn_cpu.gdn(*x, _cu(lens))
    monkeypatch.setattr(gdn_cpu, "BLOCK_BYTES", pairs * 16 * 16 * 4)
    blocked = gdn_cpu.gdn(*x, _cu(lens))
    assert bits_equal(blocked[0], whole[0]) and bits_equal(blocked[1], whole[1])


def _decode(
    x: list[torch.Tensor], lens: list[int], first: list[int], chunk: int, cache: GDNCache
) -> torch.Tensor:
    """Every sequence prefills ``first[i]`` tokens in chunks of ``chunk`` (all sequences packed into
    one call per round), then decodes the rest one token a call, all live sequences packed
    together, in reversed slot order (slot i holds sequence i)."""
    starts = _cu(lens)[:-1].tolist()
    out = [torch.empty(n, x[0].shape[1], x[2].shape[2]) for n in lens]
    pos = [0] * len(lens)
    while any(p < n for p, n in zip(pos, lens, strict=True)):
        live = [i for i in reversed(range(len(lens))) if pos[i] < lens[i]]
        take = {i: min(chunk, first[i] - pos[i]) if pos[i] < first[i] else 1 for i in live}
        xs = [torch.cat([t[starts[i] + pos[i] : starts[i] + pos[i] + take[i]] for i in live]) for t in x]
        o = gdn_cpu.gdn_incremental(*xs, _cu([take[i] for i in live]), live, cache)
        j = 0
        for i in live:
            out[i][pos[i] : pos[i] + take[i]] = o[j : j + take[i]]
            j += take[i]
            pos[i] += take[i]
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_chunked_prefill_decode_same_bits(dtype: torch.dtype) -> None:
    """Prefill lengths 0, 1, 15, 64, 65 and whole, in prefill chunks of 1, 16 and 64, then decode
    in a mixed batch: o and the state after the last token equal the one-shot prefill's."""
    lens = [130, 17, 66, 64, 5]
    x = _inputs(sum(lens), 2, 64, 64, dtype, seed=1)
    one_shot, h_end = gdn_cpu.gdn(*x, _cu(lens))
    for first in ([0, 1, 15, 64, 5], [65, 17, 0, 1, 2], [130, 16, 65, 63, 0]):
        for chunk in (1, 16, 64):
            cache = GDNCache.empty(len(lens), 2, 64, 64, dtype, torch.device("cpu"))
            got = _decode(x, lens, first, chunk, cache)
            assert bits_equal(got, one_shot), (first, chunk)
            assert bits_equal(cache.h, h_end), (first, chunk)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    chunk=st.integers(1, 17),
    dk=st.sampled_from([3, 16, 24]),
    fp32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_lengths_and_splits(
    lens: list[int], cuts: list[int], chunk: int, dk: int, fp32: bool, seed: int
) -> None:
    """Any sequence lengths, prefill lengths, prefill chunks and head widths (dk not a power of
    two too): the engine's bits and final states equal the one-shot prefill's."""
    dtype = torch.float32 if fp32 else torch.bfloat16
    x = _inputs(sum(lens), 2, dk, 8, dtype, seed=seed)
    one_shot, h_end = gdn_cpu.gdn(*x, _cu(lens))
    cache = GDNCache.empty(len(lens), 2, dk, 8, dtype, torch.device("cpu"))
    first = [min(c, n) for c, n in zip(cuts, lens, strict=False)]
    assert bits_equal(_decode(x, lens, first, chunk, cache), one_shot)
    assert bits_equal(cache.h, h_end)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_matches_fp64_recurrence(dtype: torch.dtype) -> None:
    lens = [150, 40, 1]
    x = _inputs(sum(lens), 2, 64, 64, dtype, seed=2)
    h0 = torch.randn(3, 2, 64, 64) * 0.1
    o, h = gdn_cpu.gdn(*x, _cu(lens), h0)
    o64, h64 = gdn_recurrent(*x, _cu(lens), h0, dtype=torch.float64)
    err_o = (o.double() - o64).abs().max().item()
    err_h = (h.double() - h64).abs().max().item()
    assert err_o < OUT_RTOL * max(1.0, o64.abs().max().item()), err_o
    assert err_h < OUT_RTOL * max(1.0, h64.abs().max().item()), err_h
    # No less accurate than the native fp32 chunk form on the same inputs.
    native, _ = gdn_chunk_reference(*x, _cu(lens), h0, solve="triangular", state_at="end")
    assert err_o <= (native.double() - o64).abs().max().item() * 2


def test_thread_count_changes_no_bit() -> None:
    x = _inputs(200, 4, 64, 64, torch.bfloat16, seed=3)
    one = gdn_cpu.gdn(*x, _cu([120, 80]))
    torch.set_num_threads(2)
    try:
        two = gdn_cpu.gdn(*x, _cu([120, 80]))
    finally:
        torch.set_num_threads(1)
    assert bits_equal(one[0], two[0]) and bits_equal(one[1], two[1])


def test_backward_vs_fp64() -> None:
    lens = [70, 30]
    x = _inputs(sum(lens), 2, 16, 16, torch.float32, seed=4)
    gout = torch.randn(sum(lens), 2, 16)
    a = [y.clone().requires_grad_(True) for y in x]
    out = gdn_cpu.gdn_autograd(*a, _cu(lens), 16)
    assert bits_equal(out.detach(), gdn_cpu.gdn(*x, _cu(lens))[0])  # autograd changes no forward bit
    (out * gout).sum().backward()
    b = [y.double().clone().requires_grad_(True) for y in x]
    (gdn_recurrent(*b, _cu(lens), dtype=torch.float64)[0] * gout.double()).sum().backward()
    for name, ga, gb in zip("q k v g beta".split(), a, b, strict=True):
        err = ((ga.grad.double() - gb.grad).abs().max() / gb.grad.abs().max()).item()
        assert err < BWD_RTOL, (name, err)


def test_routing_sends_cpu_gdn_here() -> None:
    lens = [20, 9]
    x = _inputs(sum(lens), 2, 16, 16, torch.bfloat16, seed=5)
    want, h_end = gdn_cpu.gdn(*x, _cu(lens))
    cache = GDNCache.empty(2, 2, 16, 16, torch.bfloat16, torch.device("cpu"))
    with kernels.enable():
        assert bits_equal(dispatch.gdn(*x, _cu(lens)), want)
        o = dispatch.gdn_incremental(*x, _cu(lens), [0, 1], cache)
    assert bits_equal(o, want) and bits_equal(cache.h, h_end)
    assert not bits_equal(dispatch.gdn(*x, _cu(lens)), want)  # kernels off: the native chunk form


def test_cache_of_the_triton_path_is_refused() -> None:
    x = _inputs(1, 1, 16, 16, torch.float32)
    cache = GDNCache.empty(2, 1, 16, 16, torch.float32, torch.device("cpu"))
    cache.buf_len[1] = 3
    with pytest.raises(ValueError, match="buf_len"):
        gdn_cpu.gdn_incremental(*x, _cu([1]), [1], cache)


def test_gdn_lm_bf16_trainer_equals_engine() -> None:
    """The hybrid GDN + attention LM in bf16 on the CPU: kernels off, a native mismatch; kernels on
    (GDN through gdn_cpu, the rest through isoaudit.kernels.cpu), every sampled-token logprob of the engine
    (packed prefill, chunked prefill, packed decode) equals the trainer's recompute with autograd."""
    model = _gdn(2, 128, 16, 256, torch.bfloat16, "cpu")
    prompts, new = _requests(256, [30, 70, 100, 5], [30, 20, 30, 9])
    native = run_pair(model, False, prompts, new)
    _report("gdn-lm-cpu-bf16 native", native)
    assert native["mean_abs_delta"] > 0
    for chunk in (None, 4):
        res = run_pair(model, True, prompts, new, chunk)
        _report(f"gdn-lm-cpu-bf16 isoaudit.kernels.cpu chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
