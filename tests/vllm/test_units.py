"""The collector's parts without an engine: the row layout, selection, the capture's bookkeeping on a
model laid out like vLLM's (``(hidden, residual)`` layers, fused norms, a logits processor) driven by
a stand-in model runner, payload plumbing, weight digests and the refusal rules."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from isoaudit.collectors.fingerprints import fingerprint_rows
from isoaudit.collectors.vllm.messages import (
    Drained,
    ModeState,
    RequestRecord,
    SetMode,
    Started,
    from_wire,
    to_wire,
)
from isoaudit.collectors.vllm.outputs import read_completions
from isoaudit.collectors.vllm.selection import Selection, parse_selection
from isoaudit.collectors.vllm.weights import pack_tensors, unpack_tensors, weight_digest
from isoaudit.collectors.vllm.worker.calls import NATIVE_IN_VLLM, switch_engine_mode
from isoaudit.collectors.vllm.worker.capture import EngineCapture
from isoaudit.collectors.vllm.worker.facts import capture_refusal
from isoaudit.collectors.vllm.worker.regions import resolve_engine_regions
from isoaudit.collectors.vllm.worker.requests import external_id
from isoaudit.collectors.vllm.worker.rows import ForwardRows
from torch import nn

pytestmark = pytest.mark.vllm

HIDDEN, VOCAB = 8, 32


class _Norm(nn.Module):
    """vLLM's RMSNorm contract: ``norm(x)`` or ``norm(x, residual) -> (normed, x + residual)``, in place."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return x * 2
        residual.add_(x)
        x.copy_(residual * 2)
        return x, residual


class _Proj(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o_proj = _Proj(HIDDEN, HIDDEN, bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(hidden + positions[:, None].to(hidden.dtype))[0]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(), _Norm()
        self.self_attn, self.mlp = _Attn(), nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None) -> Any:
        if residual is None:
            residual, hidden = hidden.clone(), self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class _Logits(nn.Module):
    def forward(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return head(hidden)


class FakeVllmModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = nn.ModuleList([_Layer()])
        self.model.norm = _Norm()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.logits_processor = _Logits()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.model.norm(hidden, residual)[0]


class FakeRunner:
    """What the capture reads of vLLM's model runner: input batch, query_start_loc, requests."""

    def __init__(self) -> None:
        self.model = FakeVllmModel()
        self.requests: dict[str, Any] = {}
        self.tokens: dict[str, list[int]] = {}
        self.input_batch = SimpleNamespace(
            num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(8, np.int32)
        )
        self.query_start_loc = SimpleNamespace(np=np.zeros(9, np.int32))

    def get_model(self) -> nn.Module:
        return self.model

    def add(self, req_id: str, prompt: list[int], temperature: float = 0.7) -> None:
        params = SimpleNamespace(temperature=temperature, top_k=0, top_p=0.9)
        self.requests[req_id] = SimpleNamespace(prompt_token_ids=prompt, sampling_params=params)
        self.tokens[req_id] = list(prompt)

    def execute_model(self, scheduler_output: Any) -> torch.Tensor:
        """``scheduler_output.schedule``: req_id -> (tokens already computed, tokens now)."""
        schedule = scheduler_output.schedule
        self.input_batch.req_ids = list(schedule)
        self.input_batch.num_reqs = len(schedule)
        ids, positions, starts = [], [], [0]
        for i, (req_id, (computed, n)) in enumerate(schedule.items()):
            tokens = self.tokens[req_id]
            while len(tokens) < computed + n:
                tokens.append((7 * len(tokens) + 3) % VOCAB)  # "sampled" tokens
            ids += tokens[computed : computed + n]
            positions += list(range(computed, computed + n))
            self.input_batch.num_computed_tokens_cpu[i] = computed
            starts.append(starts[-1] + n)
        self.query_start_loc.np[: len(starts)] = starts
        with torch.no_grad():
            hidden = self.model(input_ids=torch.tensor(ids), positions=torch.tensor(positions))
            return self.model.logits_processor(self.model.lm_head, hidden[torch.tensor(starts[1:]) - 1])


def _capture(
    runner: FakeRunner, selection: Selection = Selection(mode="all"), **options: Any
) -> EngineCapture:
    specs = resolve_engine_regions(runner.model, "qwen3", "auto").specs
    return EngineCapture(runner, runner.model, specs, selection, **options)


def _rows(payload: RequestRecord, region: str, case: str | None = None) -> dict[int, int]:
    out: dict[int, int] = {}
    for body in payload.prints:
        if body.region == region and (case is None or body.case == case):
            arrays = body.arrays()
            out.update(zip(arrays["positions"].tolist(), arrays["digest"].tolist(), strict=True))
    return out


class Driver:
    """Runs steps through the runner's ``execute_model``, which the capture has wrapped."""

    def __init__(self, runner: FakeRunner, capture: EngineCapture) -> None:
        self.runner, self.capture = runner, capture
        assert "execute_model" in vars(runner)

    def step(self, schedule: dict[str, tuple[int, int]], finished: tuple[str, ...] = ()) -> torch.Tensor:
        return self.runner.execute_model(SimpleNamespace(schedule=schedule, finished_req_ids=set(finished)))


def test_forward_rows_layout_and_case() -> None:
    rows = ForwardRows(("a", "b", "c"), np.array([0, 5, 6, 9]), np.array([0, 7, 30]))
    assert rows.rows(1) == (5, 6) and rows.positions(2).tolist() == [30, 31, 32]
    assert [rows.case(i, prompt_len=10) for i in range(3)] == [
        "engine_prefill",
        "engine_prefill",
        "engine_prefill",
    ]
    assert rows.case(1, prompt_len=7) == "engine_decode"
    with pytest.raises(ValueError, match="query_start"):
        ForwardRows(("a",), np.array([0]), np.array([0]))


def test_selection_and_external_ids() -> None:
    assert [parse_selection(4).chooses(i, "x") for i in range(5)] == [True, False, False, False, True]
    assert parse_selection(["7"]).chooses(0, "7") and not parse_selection(["7"]).chooses(0, "8")
    assert not parse_selection(None).chooses(0, "x") and parse_selection(1).mode == "all"
    assert from_wire(to_wire(parse_selection(["a", "b"])), Selection) == parse_selection(["b", "a"])
    for bad in (0, True, "some"):
        with pytest.raises(ValueError, match="fingerprint"):
            parse_selection(bad)  # type: ignore[arg-type]
    assert (
        external_id("12-0123abcd") == "12"
        and external_id("1_12-deadbeef") == "1_12"
        and external_id("x") == "x"
    )


def test_capture_maps_prefill_chunks_and_decode_rows_to_positions() -> None:
    runner = FakeRunner()
    runner.add("a-0123abcd", [1, 2, 3, 4, 5])
    runner.add("b-89abcdef", [9, 8, 7])
    capture = _capture(runner)
    drive = Driver(runner, capture)
    drive.step({"a-0123abcd": (0, 3), "b-89abcdef": (0, 3)})  # a: first chunk; b: whole prompt
    drive.step({"b-89abcdef": (3, 1), "a-0123abcd": (3, 2)})  # b decodes while a finishes its prompt
    last = drive.step({"b-89abcdef": (4, 1), "a-0123abcd": (5, 1)})  # logits rows in batch order: b, a
    out = capture.drain(["a", "b", "zz"])
    assert out.missing == ["zz"] and out.counters["errors"] == 0
    a, b = out.requests["a"], out.requests["b"]
    assert (a.prompt_len, a.temperature, a.top_k, a.top_p) == (5, 0.7, None, 0.9)
    assert sorted(_rows(a, "embed", "engine_prefill")) == [0, 1, 2, 3, 4]
    assert sorted(_rows(a, "embed", "engine_decode")) == [5]
    assert sorted(_rows(b, "embed", "engine_decode")) == [3, 4]
    assert sorted(_rows(a, "logits")) == [2, 4, 5]  # the last row of each forward: chunk ends and decode
    assert _rows(b, "logits")[4] == fingerprint_rows(last[0:1].float()).digest.numpy().view(np.uint64)[0]
    # Each row is the one of its own token: the embedding digest of token t at position p.
    embed = runner.model.model.embed_tokens.weight.detach()
    for req, payload in (("a-0123abcd", a), ("b-89abcdef", b)):
        tokens = runner.tokens[req]
        want = fingerprint_rows(embed[torch.tensor(tokens)]).digest.numpy().view(np.uint64).tolist()
        assert _rows(payload, "embed") == {p: want[p] for p in _rows(payload, "embed")}
    # The residual stream is read as hidden + residual, the same in every region map.
    assert len(_rows(a, "layers.0.out")) == 6 and capture.traces == {}


def test_selected_requests_only_and_hooks_removed() -> None:
    runner = FakeRunner()
    for r in ("r0-00000000", "r1-00000001", "r2-00000002"):
        runner.add(r, [1, 2, 3])
    capture = _capture(runner, parse_selection(2))
    Driver(runner, capture).step({r: (0, 3) for r in runner.requests})
    out = capture.drain(["r0", "r1", "r2"]).requests
    assert [bool(out[r].prints) for r in ("r0", "r1", "r2")] == [True, False, True]
    assert [out[r].selected for r in ("r0", "r1", "r2")] == [True, False, True]
    capture.selection = parse_selection(None)  # logprobs only: no region hooks at all
    assert not any(m._forward_hooks for m in runner.model.modules())
    capture.selection = parse_selection("all")
    assert runner.model.model.embed_tokens._forward_hooks
    capture.remove()
    assert "execute_model" not in vars(runner)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())


def test_buffers_are_bounded_and_drops_counted() -> None:
    runner = FakeRunner()
    for r in ("a-00000000", "b-00000001", "c-00000002"):
        runner.add(r, [1, 2, 3, 4])
    capture = _capture(runner, max_requests=2)
    drive = Driver(runner, capture)
    drive.step({"a-00000000": (0, 4)})
    drive.step({"b-00000001": (0, 4)}, finished=("a-00000000",))
    drive.step({"c-00000002": (0, 4)})  # a third request: the finished one goes
    assert capture.counters.evicted_requests == 1 and "a-00000000" not in capture.traces
    small = FakeRunner()
    small.add("x-00000000", [1, 2, 3, 4])
    tight = _capture(small, max_rows=20)
    drive = Driver(small, tight)
    drive.step({"x-00000000": (0, 4)})  # 4 rows x 7 regions + 1 logits row > 20
    out = tight.drain(["x"]).requests["x"]
    assert out.truncated and out.prints == [] and tight.counters.dropped_rows == 29
    # Room for the first of two requests only: the second is dropped, the first keeps the right rows.
    pair = FakeRunner()
    pair.add("y-00000000", [1, 2])
    pair.add("z-00000001", [3, 4])
    room = _capture(pair, max_rows=2 * 7 + 1)
    logits = Driver(pair, room).step({"y-00000000": (0, 2), "z-00000001": (0, 2)})
    out = room.drain(["y", "z"]).requests
    assert out["z"].truncated and out["z"].prints == [] and not out["y"].truncated
    want = fingerprint_rows(logits[0:1].float()).digest.numpy().view(np.uint64).tolist()
    assert _rows(out["y"], "logits") == {1: want[0]}


def test_recomputed_positions_keep_the_latest_rows() -> None:
    runner = FakeRunner()
    runner.add("p-00000000", [1, 2, 3, 4])
    capture = _capture(runner)
    drive = Driver(runner, capture)
    drive.step({"p-00000000": (0, 4)})
    drive.step({"p-00000000": (4, 1)})
    drive.step({"p-00000000": (0, 5)})  # preempted and recomputed: prompt and generated token again
    out = capture.drain(["p"]).requests["p"]
    embed = _rows(out, "embed")
    assert sorted(embed) == [0, 1, 2, 3, 4] and capture.counters.recomputed_rows > 0
    assert sorted(_rows(out, "embed", "engine_prefill")) == [0, 1, 2, 3, 4]  # the latest: the recompute


def test_refused_capture_keeps_metadata_and_failures_never_reach_the_engine() -> None:
    runner = FakeRunner()
    runner.add("q-00000000", [1, 2, 3])
    refused = _capture(runner, refusal="regions not captured: test")
    Driver(runner, refused).step({"q-00000000": (0, 3)})
    out = refused.drain(["q"]).requests["q"]
    assert out.prints == [] and out.prompt_len == 3
    refused.remove()

    def broken(_x: torch.Tensor) -> Any:
        raise RuntimeError("boom")

    runner.add("s-00000000", [1, 2, 3])
    failing = _capture(runner, fingerprinter=broken)
    logits = Driver(runner, failing).step({"s-00000000": (0, 3)})
    assert logits.shape == (1, VOCAB)
    out = failing.drain(["s"])
    assert out.counters["errors"] >= 1 and out.requests["s"].prints == []


def test_messages_cross_processes_as_msgpack() -> None:
    """What a worker answers survives msgpack (what collective_rpc uses between processes) and comes
    back as the same typed message; odd scalars (a TorchVersion, numpy numbers) become plain ones."""
    import msgspec

    runner = FakeRunner()
    runner.add("m-00000000", [1, 2, 3])
    capture = _capture(runner)
    Driver(runner, capture).step({"m-00000000": (0, 3)})
    drained = capture.drain(["m"])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire(drained)))
    again = from_wire(wire, Drained)
    assert again == drained and _rows(again.requests["m"], "embed") == _rows(drained.requests["m"], "embed")
    started = Started(
        facts={"torch_version": torch.__version__, "n": np.int64(3), "f": np.float32(0.5)},
        regions=["embed"],
        unobserved={},
        refusal=None,
        family="qwen3",
        tp_rank=0,
        pp_rank=0,
        weight_version=None,
        weight_digest=None,
        mode=ModeState(),
    )
    facts = from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire(started))), Started).facts
    assert facts == {"torch_version": str(torch.__version__), "n": 3, "f": 0.5}
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        from_wire({"mode": "native", "extra": 1}, SetMode)


def test_a_requested_mode_is_applied_at_the_next_step_and_reported() -> None:
    runner = FakeRunner()
    runner.add("w-00000000", [1, 2, 3])
    capture = _capture(runner, mode_switch=switch_engine_mode)
    drive = Driver(runner, capture)
    drive.step({"w-00000000": (0, 3)})
    capture.request_mode(SetMode(mode="invariant", version=4))
    assert capture.drain([]).mode == ModeState()  # not before the engine's next step
    drive.step({"w-00000000": (3, 1)})
    state = capture.drain(["w"]).mode
    assert (state.requested, state.applied, state.version, state.step) == ("invariant", "native", 4, 1)
    assert state.reason == NATIVE_IN_VLLM  # vLLM's own kernels stay: said, not hidden
    assert switch_engine_mode("native") == ("native", None)


def test_weight_digest_and_packing() -> None:
    a = {"x.weight": torch.randn(3, 4).bfloat16(), "y.bias": torch.arange(5, dtype=torch.float32)}
    assert weight_digest(a) == weight_digest(list(reversed(list(a.items()))))
    changed = {**a, "y.bias": a["y.bias"].clone()}
    changed["y.bias"][2] += 1
    assert weight_digest(changed) != weight_digest(a)
    back = dict(unpack_tensors(pack_tensors(a.items())))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in a.items())
    with pytest.raises(ValueError, match="named_tensors"):
        weight_digest([])


def test_refusal_rules() -> None:
    def config(mode: str = "NONE", graphs: str = "NONE", eager: bool = True, spec: Any = None) -> Any:
        return SimpleNamespace(
            compilation_config=SimpleNamespace(
                mode=SimpleNamespace(name=mode), cudagraph_mode=SimpleNamespace(name=graphs)
            ),
            model_config=SimpleNamespace(enforce_eager=eager),
            speculative_config=spec,
        )

    assert capture_refusal(config()) is None
    assert "torch.compile" in capture_refusal(config(mode="VLLM_COMPILE"))  # type: ignore[operator]
    assert "CUDA graphs" in capture_refusal(config(graphs="FULL_AND_PIECEWISE", eager=False))  # type: ignore[operator]
    assert "speculative" in capture_refusal(config(spec=object()))  # type: ignore[operator]
    # a decoder compiled through @support_torch_compile is reached by the graph taps
    assert capture_refusal(config(mode="DYNAMO_TRACE_ONCE", eager=False), compiled_decoder=True) is None
    assert "speculative" in capture_refusal(config(mode="VLLM_COMPILE", spec=object()), compiled_decoder=True)  # type: ignore[operator]


def test_region_maps() -> None:
    model = FakeVllmModel()
    resolved = resolve_engine_regions(model, "qwen3")
    assert (
        resolved.names[:3] == ["embed", "layers.0.input_norm", "layers.0.attn"] and resolved.unobserved == {}
    )
    assert {s.name: s.tap.value for s in resolved.specs}["layers.0.out"] == "sum"
    subset = resolve_engine_regions(model, "llama", ["embed", "logits"])
    assert subset.names == ["embed", "logits"] and "layers.0.mlp" in subset.unobserved
    custom = resolve_engine_regions(
        model, None, {"logits": "logits_processor", "embed": "model.embed_tokens"}
    )
    assert custom.names == ["embed", "logits"] and "final_norm" in custom.unobserved
    with pytest.raises(ValueError, match="not in the engine's model"):
        resolve_engine_regions(model, None, {"embed": "model.nope"})
    with pytest.raises(ValueError, match="not regions of this model"):
        resolve_engine_regions(model, "qwen3", ["layers.5.mlp"])
    assert resolve_engine_regions(model, "qwen3", None).unobserved == {"*": "no regions requested"}


def test_completions_are_read_from_request_outputs() -> None:
    def lp(value: float) -> Any:
        return SimpleNamespace(logprob=value)

    one = SimpleNamespace(
        request_id="3",
        prompt_token_ids=[1, 2],
        outputs=[
            SimpleNamespace(index=0, token_ids=[5, 6], logprobs=[{5: lp(-0.5)}, {6: lp(-1.0), 9: lp(-0.1)}])
        ],
    )
    many = SimpleNamespace(
        request_id="4",
        prompt_token_ids=[1],
        outputs=[SimpleNamespace(index=k, token_ids=[k + 1], logprobs=None) for k in range(2)],
    )
    found = read_completions([one, many])
    assert [c.engine_id for c in found] == ["3", "0_4", "1_4"]
    assert found[0].logprobs.tolist() == [-0.5, -1.0] and found[1].logprobs is None
    with pytest.raises(TypeError, match="outputs"):
        read_completions([object()])


def test_vllm_stays_optional() -> None:
    import subprocess
    import sys

    code = "import sys; sys.modules['vllm'] = None; import isoaudit.audit, isoaudit.collectors, isoaudit.collectors.vllm; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_worker_processes_need_the_extension() -> None:
    from isoaudit.collectors.vllm.link import EngineLink

    class SyncMPClient:  # what vLLM's multiprocess engine client is called
        pass

    def fake(extension: str, client: object) -> Any:
        config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=extension))
        return SimpleNamespace(
            llm_engine=SimpleNamespace(vllm_config=config, engine_core=client), collective_rpc=None
        )

    with pytest.raises(ValueError, match="worker_extension_cls"):
        EngineLink(fake("", SyncMPClient()))
    assert (
        EngineLink(fake("isoaudit.collectors.vllm.worker.calls.IsoauditWorkerExtension", SyncMPClient())).mode
        == "worker_extension"
    )
    with pytest.raises(TypeError, match="vllm.LLM"):
        EngineLink(object())


def test_cpu_graph_tap_reads_the_hosts_selection() -> None:
    """The CPU graph tap: nothing selected writes nothing; a selection that fits the stage is copied
    there (hidden + residual added after selection); a larger one, or a region that is not
    stageable, is fingerprinted in place with the bits of ``fingerprint_rows``; a decode step that
    repeats the rows reuses the index, and new rows replace it."""
    from isoaudit.collectors.fingerprint_op import slot_rows
    from isoaudit.collectors.fingerprints import default_ladder_bits
    from isoaudit.collectors.vllm.worker.graph import GraphTaps, tap_rows

    bits = default_ladder_bits(torch.bfloat16)
    taps = GraphTaps.allocate(2, 16, bits, torch.device("cpu"), HIDDEN, torch.bfloat16)
    assert taps.stage is not None and taps.stage.shape == (2, 16, HIDDEN)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, HIDDEN, generator=gen).to(torch.bfloat16)
    res = torch.randn(12, HIDDEN, generator=gen).to(torch.bfloat16)

    tap_rows(x, res, taps.stage, taps.ident, 0, True)  # nothing selected
    assert not taps.stage.any()

    for rows in ([3, 7], [3, 7], [1, 4, 9]):
        taps.set_rows(np.array(rows, dtype=np.int64))
        tap_rows(x, res, taps.stage, taps.ident, 0, True)
        want = x[rows] + res[rows]
        assert torch.equal(taps.stage[0, : len(rows)], want)
        assert torch.equal(taps.index[: len(rows)], torch.tensor(rows)) and int(taps.count[0]) == len(rows)

    # not stageable: fingerprinted in the graph, the bits of fingerprint_rows
    tap_rows(x, None, taps.stage, taps.ident, 1, False)
    got = slot_rows(taps.prints.ints[1, :3].numpy(), taps.prints.floats[1, :3].numpy(), bits)
    want_prints = fingerprint_rows(x[[1, 4, 9]])
    assert np.array_equal(got.digest, want_prints.digest.numpy().view(np.uint64))
    assert np.array_equal(got.sketch, want_prints.sketch.numpy())

    # more rows than the stage holds: fingerprinted in the graph as well
    rows = np.arange(12, dtype=np.int64)
    small = GraphTaps.allocate(1, 16, bits, torch.device("cpu"), HIDDEN, torch.bfloat16)
    small.stage = torch.zeros(1, 4, HIDDEN, dtype=torch.bfloat16)
    small.set_rows(rows)
    tap_rows(x, res, small.stage, small.ident, 0, True)
    got = slot_rows(small.prints.ints[0, :12].numpy(), small.prints.floats[0, :12].numpy(), bits)
    assert np.array_equal(got.digest, fingerprint_rows(x + res).digest.numpy().view(np.uint64))
    assert not small.stage.any()
    small.clear_rows()
    assert small.selected == 0
