"""The reference engine's decode keeps its bucketed (CUDA-graph) step while every region is
fingerprinted: the taps hold each region's rows and one multi-region launch per dtype at the step's
end writes them, inside the captured step; the host files rows by the layout it knows. On the CPU the bucketed step runs eagerly (no graphs here); the GPU tests replay graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from isoaudit.audit.fingerprints import ROW_FIELDS
from isoaudit.collectors.engine_capture import EngineFingerprints
from isoaudit.kernels.engine import RolloutEngine

from isoaudit import kernels

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
NEW = [4, 2, 5]


def _tiny(dev: str, dtype: torch.dtype, layers: int = 2, hidden: int = 64, vocab: int = 256):
    transformers = pytest.importorskip("transformers")
    from isoaudit.kernels.adapters import HFCausalLM

    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return HFCausalLM(transformers.Qwen3ForCausalLM(cfg).to(dev, dtype).eval())


def _by_key(records) -> dict:
    return {(r.sample_key, r.region, r.case): r for r in records}


def _run(model, engine_kw: dict, observe: bool, prompts=PROMPTS, new=NEW, seeds=(3,)):
    longest = max(len(p) + m for p, m in zip(prompts, new, strict=True))
    engine = RolloutEngine(model, max_len=max(32, longest + 8), **engine_kw)
    prints = EngineFingerprints(model, "auto", engine if observe else None)
    try:
        out = []
        for seed in seeds:
            done = engine.generate(prompts, new, seed=seed)
            recs = prints.records("r", seed, [c.prompt for c in done], [c.tokens for c in done])
            out.append((done, recs))
        engine.graph_keys = list(engine._graphs)  # what ran, before detaching drops it
        engine.fusion = prints.fusion
        engine.written = {n: sum(b is not None for b in k.bits) for n, k in prints._buckets.items()}
        return engine, prints, out
    finally:
        prints.detach()


def _assert_same_records(a, b, exact_sketch: bool = True) -> None:
    """Same records, positions and bits. ``exact_sketch=False``: the CPU's sketch is a BLAS
    product whose last bits depend on how many rows share the call (a bucket against the packed
    live rows), so it is compared to fp32 rounding there; digest, ladder, L2 and max-abs stay
    exact (the GPU's fused pass fixes the sketch's order: exact there)."""
    ka, kb = _by_key(a), _by_key(b)
    assert ka.keys() == kb.keys()
    for key, ra in ka.items():
        rb = kb[key]
        assert np.array_equal(ra.positions, rb.positions), key
        assert list(ra.ladder_bits) == list(rb.ladder_bits), key
        for name in ROW_FIELDS:
            x, y = np.asarray(getattr(ra, name)), np.asarray(getattr(rb, name))
            if name == "sketch" and not exact_sketch:
                np.testing.assert_allclose(
                    x, y, rtol=1e-5, atol=1e-6 * float(np.abs(y).max()), err_msg=str(key)
                )
                continue
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), (key, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_decode_with_the_op_equals_the_packed_hooks(dtype: torch.dtype) -> None:
    """Kernels on (batch-invariant): the bucketed decode (3 requests in a bucket of 4, the op
    writing every region into the bucket's buffers) files the same rows, positions and bits as the
    packed eager steps fingerprinted by the hooks, and samples the same tokens."""
    model = _tiny("cpu", dtype)
    with kernels.enable():
        eng, prints, bucketed = _run(model, {"bucketed_decode": True}, observe=True)
        _, _, packed = _run(model, {}, observe=False)
    (done_b, recs_b), (done_p, recs_p) = bucketed[0], packed[0]
    assert [c.tokens for c in done_b] == [c.tokens for c in done_p]
    assert [c.logprobs for c in done_b] == [c.logprobs for c in done_p]
    assert eng.graph_keys == [(4, "invariant")]
    decode = [r for r in recs_b if r.case == "engine_decode"]
    assert decode, "no decode rows recorded"
    # each request's decode rows: every generated position but the last sampled token's
    mlp = sorted((len(r.positions), int(r.positions[0])) for r in decode if r.region == "layers.0.mlp")
    assert mlp == sorted((n - 1, len(p)) for p, n in zip(PROMPTS, NEW, strict=True))
    _assert_same_records(recs_b, recs_p, exact_sketch=False)


def test_observer_attach_and_detach_drop_the_graphs() -> None:
    model = _tiny("cpu", torch.float32)
    engine = RolloutEngine(model, max_len=32, bucketed_decode=True)
    engine.generate(PROMPTS, NEW)
    assert engine._graphs
    prints = EngineFingerprints(model, "auto", engine)
    assert engine.observer is prints and not engine._graphs
    engine.generate(PROMPTS, NEW)
    prints.detach()
    assert engine.observer is None and not engine._graphs and "step" not in vars(model)


def test_a_second_generate_reuses_the_step_and_keeps_recording() -> None:
    model = _tiny("cpu", torch.float32)
    with kernels.enable():
        _, _, bucketed = _run(model, {"bucketed_decode": True}, observe=True, seeds=(1, 2))
        _, _, packed = _run(model, {}, observe=False, seeds=(1, 2))
    for (_, a), (_, b) in zip(bucketed, packed, strict=True):
        _assert_same_records(a, b, exact_sketch=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_decode_fingerprints_equal_eager_and_replay_gpu() -> None:
    """Kernels on, bf16: every region fingerprinted inside the CUDA graph, bit for bit the eager
    packed steps' fingerprints, tokens and logprobs; the decode replayed from the graph."""
    model = _tiny("cuda", torch.bfloat16, layers=4, hidden=256, vocab=1024)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 65)]
    new = [30, 12, 40, 25, 33]
    with kernels.enable():
        eng, _, graphed = _run(model, {}, observe=True, prompts=prompts, new=new, seeds=(1, 2))
        assert eng.graphed() and eng.replays >= 2 * (max(new) - 1)
        assert [k[0] for k in eng.graph_keys] == [8] and len(eng.captures) == 1  # captured once, replayed
        # every region the step runs in one multi-region launch at its end, none alone
        assert eng.fusion == {8: {"fused": eng.written[8]}} and eng.written[8] > 0
        _, _, eager = _run(
            model, {"cuda_graphs": False}, observe=False, prompts=prompts, new=new, seeds=(1, 2)
        )
    for (da, a), (db, b) in zip(graphed, eager, strict=True):
        assert [c.tokens for c in da] == [c.tokens for c in db]
        assert [c.logprobs for c in da] == [c.logprobs for c in db]
        assert any(r.case == "engine_decode" for r in a)
        _assert_same_records(a, b)


def _tiny_moe(dev: str, dtype: torch.dtype, layers: int = 2, hidden: int = 64, vocab: int = 256):
    pytest.importorskip("transformers")
    from tests.kernels.test_moe_e2e import hf_moe

    return hf_moe("qwen3_moe", layers, hidden, 8, 2, vocab, dtype, dev)


MOE_REGIONS = {"layers.1.router", "layers.1.experts", "layers.1.combine"}


def test_moe_bucketed_decode_fingerprints_equal_the_packed_hooks() -> None:
    """Kernels on, a Qwen3-MoE: the bucketed decode fingerprints every region, the router, the
    per-slot expert outputs and the combine included, with the packed eager steps' rows and bits,
    and samples the same tokens."""
    model = _tiny_moe("cpu", torch.float32)
    with kernels.enable():
        eng, _, bucketed = _run(model, {"bucketed_decode": True}, observe=True)
        _, _, packed = _run(model, {}, observe=False)
    (done_b, recs_b), (done_p, recs_p) = bucketed[0], packed[0]
    assert [c.tokens for c in done_b] == [c.tokens for c in done_p]
    assert [c.logprobs for c in done_b] == [c.logprobs for c in done_p]
    assert eng.graph_keys == [(4, "invariant")]
    assert {r.region for r in recs_b if r.case == "engine_decode"} >= MOE_REGIONS
    _assert_same_records(recs_b, recs_p, exact_sketch=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_graphed_decode_fingerprints_equal_eager_gpu() -> None:
    """Kernels on, a bf16 Qwen3-MoE: every region, the MoE ones included, fingerprinted inside the
    captured decode, bit for bit the eager packed steps' fingerprints, tokens and logprobs."""
    model = _tiny_moe("cuda", torch.bfloat16, layers=4, hidden=256, vocab=1024)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 65)]
    new = [30, 12, 40, 25, 33]
    with kernels.enable():
        eng, _, graphed = _run(model, {}, observe=True, prompts=prompts, new=new, seeds=(1, 2))
        assert eng.graphed() and eng.replays >= 2 * (max(new) - 1) and len(eng.captures) == 1
        _, _, eager = _run(
            model, {"cuda_graphs": False}, observe=False, prompts=prompts, new=new, seeds=(1, 2)
        )
    for (da, a), (db, b) in zip(graphed, eager, strict=True):
        assert [c.tokens for c in da] == [c.tokens for c in db]
        assert [c.logprobs for c in da] == [c.logprobs for c in db]
        assert {r.region for r in a if r.case == "engine_decode"} >= {"layers.3.router", "layers.3.combine"}
        _assert_same_records(a, b)


def test_a_mode_switch_rebuilds_the_decode_step_and_the_manifest_says_so() -> None:
    """The collector at the engine's step boundary: a switch drops the captured step, the next
    decode builds it again in the new mode (with the fingerprints inside), and records stay
    complete on both sides of the switch."""
    from isoaudit.collectors.control import FixedControl
    from isoaudit.collectors.engine_capture import EngineCollector
    from isoaudit.collectors.sinks import MemorySink

    model = _tiny("cpu", torch.float32)
    engine = RolloutEngine(model, max_len=32, bucketed_decode=True)
    control = FixedControl("g", "native")
    sink = MemorySink()
    collector = EngineCollector(engine, run="g", sink=sink, control=control, keep_records=True, strict=True)
    try:
        assert engine.observer is collector.prints
        a = collector.record_step(0, engine.generate(PROMPTS, NEW, seed=1))
        assert list(engine._graphs) == [(4, "native")]
        control.set("invariant")
        b = collector.record_step(1, engine.generate(PROMPTS, NEW, seed=1))
        assert list(engine._graphs) == [(4, "invariant")]  # the native one dropped at the switch
        for report in (a, b):
            decode = [r for r in report.records if r.kind == "fingerprints" and r.case == "engine_decode"]
            assert {r.region for r in decode} >= {"embed", "layers.1.mlp", "final_norm"}
    finally:
        collector.detach()
        sink.flush(30)
        kernels.disable()
    assert engine.observer is None
    modes = [m.runtime.remediation for m in sink.of_kind("manifest")]
    assert modes[0] == "native" and modes[-1] == "invariant"
