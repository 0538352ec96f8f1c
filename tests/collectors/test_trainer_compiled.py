"""A ``torch.compile``'d HF trainer (tiny Qwen3, CPU inductor): every region recorded through the
multi-region fingerprint op at the end of the compiled forward (fullgraph, no break), remediated
onto the invariant kernels (registered custom ops), fingerprints and gradients bit for bit the
eager path's."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from isoaudit.audit.fingerprints import ROW_FIELDS
from isoaudit.collectors.control import FixedControl
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import attach

from isoaudit import kernels

TEMPERATURE = 0.7
transformers = pytest.importorskip("transformers")


def _model(dtype: torch.dtype) -> torch.nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).to(dtype).train()


def _batch(seed: int) -> StepBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (5, 3, 6)]
    completions = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (4, 6, 2)]
    return StepBatch.padded(prompts, completions, temperature=TEMPERATURE)  # one shape every step


def _train(
    model: torch.nn.Module, forward, steps: int, *, control=None, mutated: set | None = None,
    held_cap: int | None = None, batch_of=None,
):  # fmt: skip
    """A few real steps (forward, logprobs, loss, backward); each step's records and grads
    (``mutated``: filled with the region slots the hooks found written in place after their tap;
    ``held_cap``: the compiled forward's bound on held activation bytes)."""
    sink = MemorySink()
    collector = attach(
        model, run="c", sink=sink, keep_records=True, strict=True, async_transfer=False,
        control=control,
    )  # fmt: skip
    if held_cap is not None:
        collector._capture.max_held_bytes = held_cap
    out = []
    try:
        for step in range(steps):
            batch = (batch_of or _batch)(step)
            collector.begin_step(step, batch)
            logits = forward(**batch.model_inputs()).logits
            lp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
            lp = lp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
            report = collector.record_step(step, batch, logprobs=lp.detach())
            (-lp.mean()).backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            out.append((report, grads))
        if mutated is not None:
            assert collector._capture._watched  # an eager forward checked the taps' versions
            mutated |= collector._capture.mutated
    finally:
        collector.detach()
    return out


def _prints(report) -> dict:
    return {(r.sample_key, r.region): r for r in report.records if r.kind == "fingerprints"}


def _assert_equal_prints(a, b) -> None:
    pa, pb = _prints(a), _prints(b)
    assert pa and pa.keys() == pb.keys()
    for key, ra in pa.items():
        rb = pb[key]
        assert np.array_equal(ra.positions, rb.positions), key
        for name in ROW_FIELDS:
            x, y = np.asarray(getattr(ra, name)), np.asarray(getattr(rb, name))
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), (key, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_trainer_records_every_region_through_the_op(dtype: torch.dtype) -> None:
    """Invariant mode (set through the control channel, as the dashboard does): the compiled
    steps' fingerprints and gradients equal the eager steps' bit for bit, every region recorded
    from the compiled graph's op (no own forward after the first step), no graph break."""
    eager_model = _model(dtype)
    compiled_model = copy.deepcopy(eager_model)
    torch._dynamo.reset()
    try:
        eager = _train(eager_model, eager_model, 3, control=FixedControl("c", "invariant"))
        compiled_fn = torch.compile(compiled_model, fullgraph=True)
        mutated: set = set()
        compiled = _train(
            compiled_model, compiled_fn, 3, control=FixedControl("c", "invariant"), mutated=mutated
        )
    finally:
        kernels.disable()
        torch._dynamo.reset()
    for step, ((ra, ga), (rb, gb)) in enumerate(zip(eager, compiled, strict=True)):
        assert ra.n_fingerprint_records == rb.n_fingerprint_records > 0
        _assert_equal_prints(ra, rb)
        assert ga.keys() == gb.keys()
        differ = {
            n: float((ga[n].float() - gb[n].float()).abs().max()) for n in ga if not torch.equal(ga[n], gb[n])
        }
        assert not differ, (step, sorted(differ))
        if step >= 1:  # the first compiled call traces; from then on the op writes the buffers
            assert not rb.own_forward
    assert not mutated  # every region through the one multi-region op at the forward's end
    regions = {r.region for r in compiled[-1][0].records if r.kind == "fingerprints"}
    assert {"embed", "layers.0.attn", "layers.1.out", "final_norm", "logits"} <= regions


@pytest.mark.parametrize("held_cap", [None, 1024])
def test_each_ladder_group_copies_its_own_regions_rows_only(
    monkeypatch: pytest.MonkeyPatch, held_cap: int | None
) -> None:
    """A bf16 model has regions of two dtypes, so two ladders and two groups: each group gathers
    the rows of its own regions' slots, never every slot's (the step's copy to the host carries
    each region's rows once), and the records still equal the eager step's bit for bit. With a
    cap below every region, each goes alone through the per-region op: the bf16 logits then
    widened to fp32 as the kernel reads them (no fp32 copy), the same bits."""
    from isoaudit.collectors.hooks import ForwardCapture

    taken: list[list[tuple[int, int]]] = []
    take = ForwardCapture.take_compiled

    def spy(self, input_ids):
        capture = take(self, input_ids)
        if capture is not None:
            plan = capture.prints.plan
            members = [sum(1 for g, _, _ in plan.spans if g == i) for i in range(len(plan.groups))]
            taken.append(
                [
                    (len(group.digest), n * plan.rows)
                    for group, n in zip(capture.prints.groups, members, strict=True)
                ]
            )
        return capture

    monkeypatch.setattr(ForwardCapture, "take_compiled", spy)
    eager_model = _model(torch.bfloat16)
    compiled_model = copy.deepcopy(eager_model)
    torch._dynamo.reset()
    invariant = FixedControl("c", "invariant")
    try:
        eager = _train(eager_model, eager_model, 2, control=invariant)
        compiled = _train(
            compiled_model, torch.compile(compiled_model), 2, control=invariant, held_cap=held_cap
        )
    finally:
        kernels.disable()
        torch._dynamo.reset()
    assert taken and all(len(groups) == 2 for groups in taken)  # bf16 regions, and fp32 ones
    for groups in taken:
        for rows, own in groups:
            assert rows == own  # its regions' rows, not every region's
    for (ra, _), (rb, _) in zip(eager, compiled, strict=True):
        _assert_equal_prints(ra, rb)


def test_compiled_bf16_logits_alone_are_fingerprinted_as_their_float32_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Native bf16, every region alone through the per-region op (a cap below every region): the
    logits region, canonically fp32, is widened as the kernel reads the bf16 logits (the op is
    handed them in bf16: no fp32 copy), and its records equal the fingerprints of the compiled
    forward's own logits cast to fp32."""
    from isoaudit.collectors import fingerprint_op
    from isoaudit.collectors.fingerprints import fingerprint_rows

    handed: list[tuple[torch.dtype, bool]] = []
    into = fingerprint_op.fingerprint_rows_into

    def spy(x, ints, floats, ladder_bits=None, as_float32=False):
        if x.shape[-1] == 256:  # the vocabulary: the logits region
            handed.append((x.dtype, as_float32))
        return into(x, ints, floats, ladder_bits, as_float32)

    monkeypatch.setattr(fingerprint_op, "fingerprint_rows_into", spy)
    model = _model(torch.bfloat16)
    torch._dynamo.reset()
    sink = MemorySink()
    collector = attach(model, run="c", sink=sink, keep_records=True, strict=True, async_transfer=False)
    collector._capture.max_held_bytes = 1024
    compiled = torch.compile(model)
    try:
        for step in range(3):
            batch = _batch(step)
            collector.begin_step(step, batch)
            logits = compiled(**batch.model_inputs()).logits
            report = collector.record_step(step, batch)
        assert report is not None and not report.own_forward
        prints = fingerprint_rows(logits.detach().reshape(-1, logits.shape[-1]).float())
        want = {name: getattr(prints, name).cpu().numpy() for name in ROW_FIELDS}
        seen = 0
        for record in report.records:
            if record.kind != "fingerprints" or record.region != "logits":
                continue
            sample = report.sample_keys.index(record.sample_key)
            rows = batch.flat_start(sample) + np.asarray(record.positions)
            for name in ROW_FIELDS:
                got, expected = (
                    np.ascontiguousarray(getattr(record, name)),
                    np.ascontiguousarray(want[name][rows]),
                )
                assert got.shape == expected.shape and got.tobytes() == expected.tobytes(), name
            seen += 1
        assert seen == batch.num_samples
        assert handed and set(handed) == {(torch.bfloat16, True)}
    finally:
        collector.detach()
        torch._dynamo.reset()


def test_batches_of_one_shape_with_other_real_rows_record_their_own_rows() -> None:
    """Steps whose batches share a shape but not their padding: each compiled step gathers its own
    real rows from the buffers (the gather index is kept only while the rows stay the same), and
    its fingerprints equal the eager step's bit for bit."""

    def batch_of(step: int) -> StepBatch:
        gen = torch.Generator().manual_seed(step)
        tail = (2, 1)[step % 2]  # one sample shorter every other step: the same [3, 9] shape
        prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (5, 3, 6)]
        completions = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (4, 6, tail)]
        return StepBatch.padded(prompts, completions, temperature=TEMPERATURE)

    eager_model = _model(torch.float32)
    compiled_model = copy.deepcopy(eager_model)
    torch._dynamo.reset()
    invariant = FixedControl("c", "invariant")  # the same arithmetic compiled and eager
    try:
        eager = _train(eager_model, eager_model, 4, control=invariant, batch_of=batch_of)
        compiled = _train(
            compiled_model, torch.compile(compiled_model), 4, control=invariant, batch_of=batch_of
        )
    finally:
        kernels.disable()
        torch._dynamo.reset()
    assert batch_of(0).input_ids.shape == batch_of(1).input_ids.shape
    for step, ((ra, _), (rb, _)) in enumerate(zip(eager, compiled, strict=True)):
        assert ra.n_fingerprint_records == rb.n_fingerprint_records > 0
        _assert_equal_prints(ra, rb)
        if step >= 1:
            assert not rb.own_forward


def test_a_switch_recompiles_and_the_next_step_runs_the_new_mode() -> None:
    """Native, then invariant through the control channel: the compiled step after the switch is
    recompiled (Dynamo guards on the mode) and gives the eager invariant fingerprints."""
    eager_model = _model(torch.float32)
    compiled_model = copy.deepcopy(eager_model)
    torch._dynamo.reset()
    try:
        with kernels.enable():
            want = _train(eager_model, eager_model, 1)[0][0]
        kernels.disable()
        control = FixedControl("c", "native")
        sink = MemorySink()
        collector = attach(
            compiled_model, run="c", sink=sink, keep_records=True, strict=True, control=control
        )
        fn = torch.compile(compiled_model, fullgraph=True)
        reports = []
        for step in range(3):
            if step == 2:
                control.set("invariant")
            batch = _batch(0)
            collector.begin_step(step, batch)
            logits = fn(**batch.model_inputs()).logits
            lp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
            lp = lp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
            reports.append(collector.record_step(step, batch, logprobs=lp.detach()))
        collector.detach()
    finally:
        kernels.disable()
        torch._dynamo.reset()
    assert not reports[2].own_forward  # the recompiled graph wrote the op's buffers
    _assert_equal_prints(reports[2], want)
    modes = [m.runtime.remediation for m in sink.of_kind("manifest")]
    assert modes[0] == "native" and modes[-1] == "invariant"


def _optimize(model: torch.nn.Module, forward, steps: int, mode: str, *, collect: bool):
    """``steps`` full training steps (forward, loss, backward, AdamW step), each step's report
    (``collect=False``: no collector, reports None) and the weights after each."""
    collector = None
    if collect:
        collector = attach(
            model, run="c", sink=MemorySink(), keep_records=True, strict=True, async_transfer=False,
            control=FixedControl("c", mode),
        )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    try:
        with kernels.enable() if mode == "invariant" and not collect else contextlib.nullcontext():
            for step in range(steps):
                batch = _batch(step)
                if collector is not None:
                    collector.begin_step(step, batch)
                logits = forward(**batch.model_inputs()).logits
                lp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
                lp = lp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
                report = None
                if collector is not None:
                    report = collector.record_step(step, batch, logprobs=lp.detach())
                (-lp.mean()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                weights = {n: p.detach().clone() for n, p in model.named_parameters()}
                out.append((report, weights))
            if collector is not None:
                assert collector.counters.errors == 0 and collector.stats()["hook_errors"] == 0
    finally:
        if collector is not None:
            collector.detach()
    return out


@pytest.mark.parametrize("mode", ["native", "invariant"])
def test_compiled_training_steps_with_every_region_through_the_op(mode: str) -> None:
    """Compiled training steps (not fullgraph, as a trainer compiles: the root hooks run outside the
    model's graph) with every region fingerprinted through the multi-region op, the optimizer
    stepping between them: no error, every region recorded each step, the weights bit for bit
    those of the same compiled model without the collector (invariant mode: the fingerprints
    also the eager collector's, step for step)."""
    steps = 4
    base = _model(torch.float32)
    plain_model, watched_model, eager_model = (copy.deepcopy(base) for _ in range(3))
    torch._dynamo.reset()
    try:
        watched = _optimize(watched_model, torch.compile(watched_model), steps, mode, collect=True)
        kernels.disable()
        torch._dynamo.reset()  # the model without the collector: graphs of its own
        plain = _optimize(plain_model, torch.compile(plain_model), steps, mode, collect=False)
        kernels.disable()
        eager = (
            _optimize(eager_model, eager_model, steps, mode, collect=True) if mode == "invariant" else None
        )
    finally:
        kernels.disable()
        torch._dynamo.reset()
    specs = {r.region for r in watched[0][0].records if r.kind == "fingerprints"}
    assert {"embed", "layers.0.attn", "layers.1.out", "final_norm", "logits"} <= specs
    for step, ((_, want), (report, got)) in enumerate(zip(plain, watched, strict=True)):
        assert {r.region for r in report.records if r.kind == "fingerprints"} == specs, step
        if step >= 1:  # the first compiled call traces without the buffers; then the op writes them
            assert not report.own_forward, step
        differ = sorted(n for n in want if not torch.equal(want[n], got[n]))
        assert not differ, (step, differ)
    if eager is not None:
        for (ra, _), (rb, _) in zip(eager, watched, strict=True):
            _assert_equal_prints(ra, rb)


def _graphs_of(
    model: torch.nn.Module, steps: int, *, collect: bool, held_cap: int | None = None, op: str = "isoaudit"
) -> list[tuple[int, int]]:
    """Compile ``model`` (as a trainer does: not fullgraph) and run ``steps`` forwards and
    backwards; per graph Dynamo made, (outputs, calls of ops whose name holds ``op``)."""
    graphs: list[tuple[int, int]] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        ops = sum(1 for n in gm.graph.nodes if n.op == "call_function" and op in str(n.target))
        graphs.append((len(output.args[0]), ops))
        return gm.forward

    collector = attach(model, run="c", sink=MemorySink(), async_transfer=False) if collect else None
    if collector is not None and held_cap is not None:
        collector._capture.max_held_bytes = held_cap
    fn = torch.compile(model, backend=backend)
    try:
        for step in range(steps):
            batch = _batch(step)
            if collector is not None:
                collector.begin_step(step, batch)
            logits = fn(**batch.model_inputs()).logits
            if collector is not None:
                collector.record_step(step, batch, logprobs=None)
            logits.float().mean().backward()
    finally:
        if collector is not None:
            collector.detach()
    return graphs


def test_held_regions_never_leave_the_compiled_graph() -> None:
    """The taps hold their regions for the one multi-region op inside the model's graph: with
    every region fingerprinted the compiled forward is one graph, without a break, whose outputs
    are those of the graph without a collector (a held tap returned from it would be one more
    output per region, each with its runtime wrapper and a tangent in the backward)."""
    base = _model(torch.float32)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        plain = _graphs_of(copy.deepcopy(base), 2, collect=False)
        torch._dynamo.reset()
        watched = _graphs_of(copy.deepcopy(base), 3, collect=True)
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert not breaks
    assert len(plain) == 1
    # the first call traces the hooks without buffers; the next, with them, calls the op once
    assert len(watched) == 2 and watched[-1][1] == 1
    assert watched[-1][0] == plain[0][0]


#: A held-bytes cap that the tiny model's regions (33 rows: 8 KiB each at width 64, 17 at 128, 33
#: for the logits) pass every few regions.
SMALL_CAP = 40 << 10


def test_regions_past_the_held_cap_go_through_the_op_in_parts() -> None:
    """A batch whose regions pass the held-bytes cap: the held rows go through the multi-region op
    each time the cap is reached (several calls in the one graph, none of the per-region op), and
    every fingerprint still equals the eager steps' bit for bit."""
    base = _model(torch.float32)
    torch._dynamo.reset()
    try:
        multi = _graphs_of(
            copy.deepcopy(base), 3, collect=True, held_cap=SMALL_CAP, op="fingerprint_regions_"
        )
        torch._dynamo.reset()
        alone = _graphs_of(copy.deepcopy(base), 3, collect=True, held_cap=SMALL_CAP, op="fingerprint_rows_")
        torch._dynamo.reset()
        eager_model = _model(torch.float32)  # invariant mode: the compiled activations are eager's
        eager = _train(eager_model, eager_model, 2, control=FixedControl("c", "invariant"))
        compiled_model = copy.deepcopy(eager_model)
        compiled = _train(
            compiled_model, torch.compile(compiled_model, fullgraph=True), 2,
            control=FixedControl("c", "invariant"), held_cap=SMALL_CAP,
        )  # fmt: skip
    finally:
        kernels.disable()
        torch._dynamo.reset()
    assert multi[-1][1] > 1 and alone[-1][1] == 0
    for (ra, _), (rb, _) in zip(eager, compiled, strict=True):
        assert ra.n_fingerprint_records == rb.n_fingerprint_records > 0
        _assert_equal_prints(ra, rb)


def test_watching_adds_no_guard_per_hook() -> None:
    """Dynamo checks each of a compiled forward's guards on every call. Forward hooks on the
    regions would need Dynamo's hook guards turned on (a dictionary check per module and hook, a
    millisecond a call at a hundred regions, on every compiled model of the process), and a region
    hook closing over a shared object adds a Python identity check per pair of hooks. Watched
    classes need neither: Dynamo's hook guards stay off and nothing guards a module's hooks."""
    import logging

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    keep = Keep()
    guards_log = logging.getLogger("torch._dynamo.guards")
    torch._logging.set_logs(guards=True)
    guards_log.addHandler(keep)
    try:
        torch._dynamo.reset()
        graphs = _graphs_of(_model(torch.float32), 2, collect=True)
    finally:
        guards_log.removeHandler(keep)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert graphs[-1][1] == 1  # the compiled forward that calls the op was traced and guarded
    assert torch._dynamo.config.skip_nnmodule_hook_guards  # Dynamo's default, left alone
    lines = [line for text in messages for line in text.splitlines()]
    assert [line for line in lines if "LAMBDA_GUARD" in line]  # the log holds the guards
    assert not [line for line in lines if "._forward_hooks" in line or "._forward_pre_hooks" in line]
    assert not [line for line in lines if "LAMBDA_GUARD" in line and "__closure__" in line]


def test_a_model_compiled_before_the_collector_attaches_is_traced_again() -> None:
    """A job may compile (and run) its model, or another copy of the same class, before attaching:
    Dynamo, whose default skips guards on empty hook dictionaries, would keep running those graphs
    without the regions. The watched classes fail their type guards, so the next call traces the
    regions in; a copy compiled without a collector keeps its own graph, and detaching gives each
    module its class back."""
    model = _model(torch.float32)
    other = copy.deepcopy(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    torch._dynamo.reset()
    try:
        compiled, other_fn = torch.compile(model), torch.compile(other)
        for fn in (compiled, other_fn):  # both traced and run before any collector exists
            fn(**_batch(9).model_inputs()).logits.float().mean().backward()
        sink = MemorySink()
        collector = attach(model, run="c", sink=sink, keep_records=True, strict=True, async_transfer=False)
        reports = []
        for step in range(3):
            batch = _batch(step)
            other_fn(**batch.model_inputs()).logits.float().mean().backward()  # interleaved
            collector.begin_step(step, batch)
            logits = compiled(**batch.model_inputs()).logits
            reports.append(collector.record_step(step, batch, logprobs=None))
            logits.float().mean().backward()
        collector.detach()
        assert {name: type(m) for name, m in model.named_modules()} == classes
        assert {name: type(m) for name, m in other.named_modules()} == classes
        compiled(**_batch(0).model_inputs())  # detached: traced again without the regions
    finally:
        torch._dynamo.reset()
    assert all(r.n_fingerprint_records > 0 for r in reports)
    assert not [r.step for r in reports[1:] if r.own_forward]  # the compiled graph's op recorded them
    assert collector.stats()["hook_errors"] == 0
