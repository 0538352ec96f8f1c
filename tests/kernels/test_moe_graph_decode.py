"""The MoE decode step (:meth:`HFMoECausalLM.decode`): one token per cache slot with ``step``'s bits,
its routing written into a device buffer and filed in the traces after the step, so the engine can
run it in a bucket (eagerly here, the path ``bucketed_decode=True`` takes on the CPU) or replay it
from a CUDA graph (the `gpu` tests) and give the packed engine's tokens, logprobs and routing
tables. On the CPU: native (bf16), the kernels' CPU path (bf16), the host-sync-free path a graph
captures (fp32 under the Triton interpreter) and the FP8 mode (the CPU torch reference)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from isoaudit.kernels import dispatch, moe
from isoaudit.kernels.engine import Completion, RolloutEngine

from isoaudit import kernels

from .conftest import gpu, needs_triton
from .test_e2e import _requests
from .test_moe_e2e import hf_moe

# Five requests decode in a bucket of 8 (three padding slots); one is done after its prefill (its
# slot re-runs the position after its last token) and one asks for no token (never prefilled).
LENS, NEW = [3, 9, 20, 5, 2], [6, 3, 5, 1, 0]
GPU_LENS, GPU_NEW = [5, 17, 40, 63, 130], [40, 24, 1, 0, 50]

MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "native": kernels.disable,
    "invariant": kernels.enable,
    "invariant-fp8": lambda: kernels.enable(fp8=True),
}


def _engine(model, prompts: list[list[int]], new: list[int], chunk: int | None, **engine_kw) -> RolloutEngine:
    """An engine for these requests (``cuda_graphs`` off unless asked for)."""
    longest = max(len(p) + m for p, m in zip(prompts, new, strict=True))
    engine_kw.setdefault("cuda_graphs", False)
    return RolloutEngine(model, max_len=longest + 8, prefill_chunk=chunk, **engine_kw)


def _traced(
    engine: RolloutEngine, prompts: list[list[int]], new: list[int], seed: int = 1
) -> tuple[list[Completion], moe.RoutingTrace]:
    """One generation with its routing traced."""
    with moe.trace_routing() as trace:
        completions = engine.generate(prompts, new, seed=seed)
    return completions, trace


def _assert_same(
    a: tuple[list[Completion], moe.RoutingTrace], b: tuple[list[Completion], moe.RoutingTrace]
) -> None:
    """Tokens and logprobs bit for bit, and every layer's routing (keys, experts and their dtype)."""
    (ca, ta), (cb, tb) = a, b
    assert [c.tokens for c in ca] == [c.tokens for c in cb]
    assert [c.logprobs for c in ca] == [c.logprobs for c in cb]
    assert ta.layers() == tb.layers() and tb.layers()
    for layer in tb.layers():
        (ka, ea), (kb, eb) = ta.arrays(layer), tb.arrays(layer)
        assert torch.equal(ka, kb) and torch.equal(ea, eb) and ea.dtype == eb.dtype, layer
        assert ta.table(layer) == tb.table(layer)


@contextlib.contextmanager
def _cpu_impl(impl: str) -> Iterator[None]:
    prev = dispatch.set_cpu_impl(impl)
    try:
        yield
    finally:
        dispatch.set_cpu_impl(prev)


_HOST_READS = ("item", "tolist", "numpy", "cpu", "nonzero", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def _counting_host_reads() -> Iterator[list[str]]:
    """The names of the ``torch.Tensor`` methods that bring values to the host (or make shapes
    from them) called inside the block: on the CPU, where nothing syncs, what would sync on CUDA."""
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    seen: list[str] = []

    def counting(name: str) -> Callable[..., object]:
        def method(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            seen.append(name)
            return saved[name](self, *args, **kwargs)

        return method

    for name in _HOST_READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield seen
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize(
    "mode,dtype,impl,chunks",
    [
        pytest.param("native", torch.bfloat16, "cpu", (None, 4), id="native-bf16"),
        pytest.param("invariant", torch.bfloat16, "cpu", (None, 4), id="invariant-bf16"),
        pytest.param("invariant", torch.float32, "triton", (4,), marks=needs_triton, id="interpreter-fp32"),
        pytest.param("invariant-fp8", torch.float32, "cpu", (None, 4), id="invariant-fp8-fp32"),
    ],
)
def test_bucketed_decode_equals_packed_cpu(
    mode: str, dtype: torch.dtype, impl: str, chunks: tuple[int | None, ...]
) -> None:
    """The engine's bucketed MoE decode (every request in a bucket of 8, eagerly: the graphed
    loop's path) gives the packed engine's tokens, logprobs and routing tables. ``triton``: the
    host-sync-free router, experts and combine a graph captures, under the interpreter (fp32: its
    bf16 dot is not the GPU's). Native runs bf16: the CPU's fp32 GEMM rounds a row by how many rows
    share the call (the dense model's bucketed decode shows it too), its bf16 one does not."""
    model = hf_moe("qwen3_moe", 2, 64, 8, 2, 256, dtype, "cpu")
    prompts, new = _requests(256, LENS, NEW)
    with MODES[mode](), _cpu_impl(impl):
        assert dispatch.mode() == mode
        for chunk in chunks:
            bucketed = _engine(model, prompts, new, chunk, bucketed_decode=True)
            packed = _engine(model, prompts, new, chunk)
            assert bucketed.bucketed() and not bucketed.graphed() and not packed.bucketed()
            _assert_same(_traced(bucketed, prompts, new), _traced(packed, prompts, new))


def test_decode_routes_like_step() -> None:
    """``decode`` computes ``step``'s bits for one token per slot and writes the same K/V; its
    routing, filed by ``decoded`` after the step, is ``step``'s RouteCalls for the live rows only
    (a padding slot is not filed), and nothing reaches the traces before ``decoded``."""
    model = hf_moe("qwen3_moe", 2, 64, 8, 2, 256, torch.float32, "cpu")
    cache_a, cache_b = model.new_cache(4, 32), model.new_cache(4, 32)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0])
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    ids, at = torch.tensor([11, 12, 13]), torch.tensor([3, 5, 1])
    with kernels.enable():
        for cache in (cache_a, cache_b):
            model.step(prompt, pos, cu, [0, 1, 2], cache)
        with moe.trace_routing() as stepped_trace:
            stepped = model.step(ids, at, torch.arange(4, dtype=torch.int32), [0, 1, 2], cache_a)
        with moe.trace_routing() as decoded_trace:
            decoded = model.decode(torch.cat([ids, ids[:1]]), torch.cat([at, torch.tensor([31])]), cache_b)
            assert decoded_trace.calls == []
            model.decoded(np.array([3, 5, 1, 31]), np.array([True, True, True, False]))
    assert torch.equal(stepped, decoded[:3])
    for (ka, va), (kb, vb) in zip(cache_a, cache_b, strict=True):
        assert torch.equal(ka[:3], kb[:3]) and torch.equal(va[:3], vb[:3])
    assert [c.layer for c in decoded_trace.calls] == [c.layer for c in stepped_trace.calls] == [0, 1]
    for got, want in zip(decoded_trace.calls, stepped_trace.calls, strict=True):
        assert got.experts.dtype == want.experts.dtype
        for field in ("experts", "seq", "pos"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field


@needs_triton
def test_host_sync_free_decode_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels on, the Triton modules (the interpreter here, CUDA on a GPU): every MoE layer takes
    the host-sync-free path and the decode step, traced, reads no tensor on the host; filing its
    routing after the step is the one read. With ``ISOAUDIT_MOE_FAST=0`` (the host-table path)
    or natively the layers are not host-sync-free, and on the CPU no decode is capturable."""
    model = hf_moe("qwen3_moe", 2, 64, 8, 2, 256, torch.float32, "cpu")
    experts = [(layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj) for layer in model.inner.layers]
    cache = model.new_cache(4, 16)
    ids = torch.tensor([1, 2, 3, 4])
    with _cpu_impl("triton"), kernels.enable(), moe.trace_routing() as trace:
        assert all(moe.host_sync_free(*e) for e in experts)
        assert not model.decode_capturable()  # CUDA graphs need CUDA
        model.decode(ids, torch.zeros(4, dtype=torch.long), cache)  # compile outside the count
        with _counting_host_reads() as reads:
            model.decode(ids, torch.ones(4, dtype=torch.long), cache)
        assert reads == []
        with _counting_host_reads() as reads:
            model.decoded(np.ones(4, dtype=np.int64), np.ones(4, dtype=bool))
        assert reads.count("cpu") == 1
        assert len(trace.calls) == 2
        monkeypatch.setenv("ISOAUDIT_MOE_FAST", "0")
        assert not any(moe.host_sync_free(*e) for e in experts)
    with _cpu_impl("triton"), kernels.disable():
        assert not any(moe.host_sync_free(*e) for e in experts)


# ------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("mode", ["invariant", "invariant-fp8"])
def test_graphed_moe_decode_gpu(mode: str) -> None:
    """Qwen3-MoE (4 layers, 16 experts top-4, bf16), kernels on: the decode captured once per
    bucket and replayed (in a second call too) gives the packed eager engine's tokens, logprobs and
    routing tables bit for bit; the eager decode step syncs with the host nowhere."""
    model = hf_moe("qwen3_moe", 4, 256, 16, 4, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, GPU_LENS, GPU_NEW)
    with MODES[mode]():
        assert model.decode_capturable()
        for chunk in (None, 16):
            graphed = _engine(model, prompts, new, chunk, cuda_graphs=True)
            eager = _engine(model, prompts, new, chunk)
            assert graphed.graphed() and not eager.bucketed()
            for seed in (1, 2):  # the second call replays the graph the first captured
                _assert_same(_traced(graphed, prompts, new, seed), _traced(eager, prompts, new, seed))
            assert graphed.replays > 0 and len(graphed.captures) == 1
            assert list(graphed._graphs) == [(8, mode)]
        cache = model.new_cache(8, 64)
        ids, pos = torch.arange(8, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda")
        model.decode(ids, pos, cache)
        torch.cuda.synchronize()
        with moe.trace_routing():
            torch.cuda.set_sync_debug_mode("error")
            try:
                model.decode(ids, pos + 1, cache)
            finally:
                torch.cuda.set_sync_debug_mode("default")


@gpu
def test_uncapturable_moe_decode_stays_eager_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Natively (HF's experts find their tokens with ``nonzero``) and with ``ISOAUDIT_MOE_FAST=0``
    the decode is not capturable: the engine captures nothing and decodes in packed eager steps,
    the same bits as an engine without graphs."""
    model = hf_moe("qwen3_moe", 4, 256, 16, 4, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, GPU_LENS, GPU_NEW)
    for mode, fast in (("native", "1"), ("invariant", "0")):
        monkeypatch.setenv("ISOAUDIT_MOE_FAST", fast)
        with MODES[mode]():
            assert not model.decode_capturable()
            asked = _engine(model, prompts, new, None, cuda_graphs=True)
            assert not asked.graphed() and not asked.bucketed()
            traced = _traced(asked, prompts, new)
            assert asked.replays == 0 and not asked._graphs
            _assert_same(traced, _traced(_engine(model, prompts, new, None), prompts, new))
