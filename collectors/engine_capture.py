"""The reference-engine collector: isoaudit's own rollout engine
(:class:`isoaudit.kernels.engine.RolloutEngine` driving :class:`isoaudit.kernels.adapters.HFCausalLM`) watched
as the rollout side, as the demo and the kernels' end-to-end story use it (``Session.watch_engine(engine)``).

:class:`EngineCollector` records each step's sampled tokens and the engine's logprobs, and the
fingerprints of every region inside the engine; it applies a new remediation mode at the start of
each ``generate`` (the engine's step boundary), through the same hook as the trainer (:mod:`isoaudit.kernels`
on or off), and reports it in its manifest.

The engine packs the new tokens of every live request into one flat batch per step and calls the HF
model's own submodules. Forward hooks on those modules (the trainer's region map) see packed rows;
a wrapper on the adapter's ``step`` records, per step, which (request slot, absolute position) each
row is, so rows can be filed under their request. The graphed decode keeps its CUDA graphs: the
same hooks run while each bucket's graph is captured and write every region through the
fingerprint op into that bucket's buffers, which every replay refills (:class:`EngineFingerprints`).
Regions the engine never calls (the decoder layer as a whole, ``lm_head``) are reported as
unobserved, never as equal. A mode switch drops the engine's graphs; each bucket is captured again,
in the new mode with the fingerprints inside, at its next decode (``engine.captures`` times it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from isoaudit.audit.fingerprints import ROW_FIELDS
from isoaudit.audit.records import Case, Record, RegionFingerprints, Run, RuntimeFacts, sample_key
from isoaudit.collectors.assemble import keys_for, sample_records
from isoaudit.collectors.base import Collector, CollectorCounters, ModeReport, RolloutStep
from isoaudit.collectors.canary import canary_tokens, engine_canary, vocab_of
from isoaudit.collectors.control import ControlChannel
from isoaudit.collectors.fingerprint_op import FingerprintBuffers, slot_rows
from isoaudit.collectors.fingerprint_regions import TABLE_WIDTH, HeldRegions, fingerprint_regions_into
from isoaudit.collectors.fingerprints import default_ladder_bits, fingerprint_rows
from isoaudit.collectors.held_weights import module_digests
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.manifest import ContractArg, ContractSource
from isoaudit.collectors.regions import RegionsArg, read_tap, resolve_regions
from isoaudit.collectors.remediation import RemediationHook, apply_kernels_mode, switch_with
from isoaudit.collectors.sinks.base import Sink
from isoaudit.collectors.transfer import to_host
from torch.utils.hooks import RemovableHandle


class _Bucket:
    """The fingerprint buffers of one decode graph (``rows`` = its bucket), the rungs each region
    slot was written with while it was captured (``None``: the graph never wrote it), the regions
    the step's taps hold for its end, and the device table the step's multi-region launch reads
    (written after the capture: a captured launch reads it at each replay)."""

    def __init__(self, slots: int, rows: int, device: torch.device, max_held_bytes: int) -> None:
        self.buffers = FingerprintBuffers(slots, rows, device)
        self.bits: list[tuple[int, ...] | None] = [None] * slots
        self.held = HeldRegions(max_held_bytes)
        self.table = torch.zeros(slots, TABLE_WIDTH, dtype=torch.int64, device=device)
        self.table_values: list[int] = []  # what the captured launch must read, written on exit
        self.fused = 0  # regions in the step's multi-region launches, at the last capture


class EngineFingerprints:
    """Hooks an :class:`~isoaudit.kernels.adapters.HFCausalLM` (and, given its engine, observes the
    engine's graphed decode); call :meth:`records` after each ``generate``.

    Packed steps (prefill, and decode where no graph runs) go through the adapter's ``step``,
    wrapped to record each row's (slot, position); the hooks fingerprint their rows at once. The
    graphed decode keeps its CUDA graphs: while a bucket's graph is captured the same hooks hold
    each region's rows and the adapter's ``decode``, wrapped, fingerprints all of them at the
    step's end into that bucket's buffers in one launch per dtype
    (:mod:`isoaudit.collectors.fingerprint_regions`; a region written in place after its tap, or
    past ``max_held_bytes``, through the per-region op at its tap), so each replay fingerprints
    every region; after a replay the engine says which rows were real and where (:meth:`replayed`),
    a device-side copy keeps them, and :meth:`records` brings all of them to the host in one
    transfer.
    """

    def __init__(
        self, adapter: Any, regions: RegionsArg = "auto", engine: Any = None, max_held_bytes: int = 256 << 20
    ) -> None:
        self.adapter = adapter
        resolved = resolve_regions(adapter.model, regions)
        self.specs = resolved.specs
        self._layout: tuple[np.ndarray, np.ndarray] | None = None  # (slot per row, position per row)
        self._rows: dict[str, list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]] = defaultdict(list)
        self._ladder_bits: dict[str, list[int]] = {}
        self._handles: list[RemovableHandle] = []
        self._buckets: dict[int, _Bucket] = {}
        self._capturing: _Bucket | None = None
        # per replay: (bucket, ints copy, floats copy, real rows, their positions), on the device
        self._decoded: list[tuple[_Bucket, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]] = []
        self._original_step = adapter.step
        self._own_step = vars(adapter).get("step")  # an instance attribute to put back, if any
        adapter.step = self._step
        self.max_held_bytes = max_held_bytes
        self._original_decode = getattr(adapter, "decode", None)
        self._own_decode = vars(adapter).get("decode")
        if callable(self._original_decode):
            adapter.decode = self._decode
        for k, spec in enumerate(self.specs):
            module = adapter.model.get_submodule(spec.module)
            self._handles.append(module.register_forward_hook(self._hook(k, spec.name, spec.tap)))
        self.engine = engine if callable(getattr(engine, "set_observer", None)) else None
        if self.engine is not None:
            self.engine.set_observer(self)

    def _step(
        self, ids: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, slots: list[int], cache: Any
    ):
        lengths = (cu[1:] - cu[:-1]).tolist()
        self._layout = (
            np.repeat(np.asarray(slots), lengths),
            positions.detach().cpu().numpy().astype(np.int32),
        )
        try:
            return self._original_step(ids, positions, cu, slots, cache)
        finally:
            self._layout = None

    def _decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """The adapter's decode step; inside a bucket's capture (or its eager run), the regions its
        taps held are fingerprinted at its end, still inside the step (replays repeat it)."""
        out = self._original_decode(ids, positions, cache)  # type: ignore[misc]  # callable: wrapped only then
        bucket = self._capturing
        if bucket is not None:
            self._flush(bucket)
        return out

    def _flush(self, bucket: _Bucket) -> None:
        """The held regions in one launch per group; a region written in place since its tap is
        not recorded from this forward (its slot is written at its tap from the next one)."""
        keep, lost = bucket.held.take()
        for region in lost:
            bucket.bits[region.slot] = None
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        buffers = bucket.buffers
        values = fingerprint_regions_into(keep, buffers.ints, buffers.floats, bucket.table, not capturing)
        bucket.fused = len(values) // TABLE_WIDTH
        if capturing:
            bucket.table_values = values

    def _hook(self, slot: int, region: str, tap: Any):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            bucket = self._capturing
            if self._layout is None and bucket is None:  # a forward outside the engine: not ours
                return
            tensor = read_tap(output, tap)
            if tensor is None:
                return
            rows = tensor.detach().reshape(-1, tensor.shape[-1])
            if bucket is not None:  # a decode step being captured: held for its end, or the op now
                if rows.shape[0] == bucket.buffers.rows:
                    bits = default_ladder_bits(rows.dtype)
                    if not bucket.held.hold(slot, rows, bits):
                        bucket.buffers.write(slot, rows, bits)
                    bucket.bits[slot] = bits
                return
            host = fingerprint_rows(rows).to_host()
            self._ladder_bits[region] = list(host.ladder_bits)
            slots, positions = self._layout  # type: ignore[misc]  # not None: checked above
            self._rows[region].append((slots, positions, host.fields()))

        return hook

    # ------------------------------------------------ DecodeObserver (isoaudit.kernels.engine)

    @contextmanager
    def capturing(self, slots: int) -> Iterator[None]:
        """The ``slots``-row decode graph is being warmed up and captured: the hooks hold each
        region for the step's end, which writes them into that bucket's buffers (allocated once
        per bucket); on exit the captured launch's table is written (its addresses are the
        graph's, fixed for every replay)."""
        bucket = self._buckets.get(slots)
        if bucket is None:
            device = self.adapter.lm_head_weight.device
            bucket = self._buckets[slots] = _Bucket(len(self.specs), slots, device, self.max_held_bytes)
        bucket.bits = [None] * len(self.specs)
        bucket.table_values = []
        bucket.held.alone = {}
        self._capturing = bucket
        try:
            yield
        finally:
            self._capturing = None
            bucket.held.take()  # a step that raised: nothing stays held
            if bucket.table_values:
                values = torch.tensor(bucket.table_values, dtype=torch.int64)
                bucket.table.reshape(-1)[: values.numel()].copy_(values)
                bucket.table_values = []

    @property
    def fusion(self) -> dict[int, dict[str, int]]:
        """Per captured bucket: the regions its step fingerprints in multi-region launches
        (``fused``) and, by reason, those written at their tap (``mutated``: written in place
        after the tap; ``over_cap``: past ``max_held_bytes``; ``not_fused``: no kernel for them)."""
        return {slots: {"fused": b.fused, **b.held.alone} for slots, b in self._buckets.items()}

    def replayed(self, slots: int, positions: np.ndarray, live: np.ndarray) -> None:
        """Keep the real rows of the replay that just ran (a device copy: no sync)."""
        bucket = self._buckets.get(slots)
        rows = np.flatnonzero(live)
        if bucket is None or not rows.size:
            return
        m = int(rows[-1]) + 1
        ints = bucket.buffers.ints[:, :m].clone()
        floats = bucket.buffers.floats[:, :m].clone()
        self._decoded.append((bucket, ints, floats, rows, positions[rows].astype(np.int32)))

    def _take_decoded(self) -> None:
        """File the graphed decode's rows under their regions (one transfer for all replays)."""
        if not self._decoded:
            return
        decoded, self._decoded = self._decoded, []
        tensors: dict[str, torch.Tensor] = {}
        for i, (_, dev_ints, dev_floats, _, _) in enumerate(decoded):
            tensors[f"{i}.i"], tensors[f"{i}.f"] = dev_ints, dev_floats
        host = to_host(tensors)
        for i, (bucket, _, _, rows, positions) in enumerate(decoded):
            ints, floats = host[f"{i}.i"], host[f"{i}.f"]
            for k, bits in enumerate(bucket.bits):
                if bits is None:
                    continue
                region = self.specs[k].name
                got = slot_rows(ints[k][rows], floats[k][rows], bits)
                self._ladder_bits[region] = list(bits)
                self._rows[region].append((rows, positions, got.fields()))

    @property
    def unobserved(self) -> dict[str, str]:
        """Regions the engine never ran through a hooked module (so far)."""
        in_graphs = {k for b in self._buckets.values() for k, bits in enumerate(b.bits) if bits is not None}
        return {
            spec.name: "the engine does not call this module"
            for k, spec in enumerate(self.specs)
            if spec.name not in self._rows and k not in in_graphs
        }

    def records(
        self, run_id: str, step: int, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[RegionFingerprints]:
        """The fingerprints gathered since the last call, one record per (request, region, case):
        ``engine_prefill`` for prompt positions, ``engine_decode`` for generated ones."""
        self._take_decoded()
        out = []
        for region, chunks in self._rows.items():
            slots = np.concatenate([c[0] for c in chunks])
            positions = np.concatenate([c[1] for c in chunks])
            fields = {name: np.concatenate([c[2][name] for c in chunks]) for name in ROW_FIELDS}
            for slot, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
                mine = slots == slot
                key = sample_key(prompt, completion)
                halves: tuple[tuple[Case, np.ndarray], ...] = (
                    ("engine_prefill", mine & (positions < len(prompt))),
                    ("engine_decode", mine & (positions >= len(prompt))),
                )
                for case, rows in halves:
                    if not rows.any():
                        continue
                    order = np.argsort(positions[rows], kind="stable")
                    out.append(
                        RegionFingerprints(
                            run_id=run_id,
                            step=step,
                            side="rollout",
                            case=case,
                            sample_key=key,
                            region=region,
                            positions=positions[rows][order],
                            ladder_bits=self._ladder_bits[region],
                            **{name: values[rows][order] for name, values in fields.items()},
                        )
                    )
        self._rows.clear()
        return out

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.engine is not None and self.engine.observer is self:
            self.engine.set_observer(None)  # its graphs wrote into our buffers: captured again
        self._buckets.clear()
        self._decoded.clear()
        if self._own_step is not None:
            self.adapter.step = self._own_step
        else:
            vars(self.adapter).pop("step", None)  # the class's method again
        if self._own_decode is not None:
            self.adapter.decode = self._own_decode
        else:
            vars(self.adapter).pop("decode", None)


def _head_dtype(model: torch.nn.Module) -> str | None:
    """The dtype the engine's head computes in: fp32 while :mod:`isoaudit.kernels` routes
    (:func:`isoaudit.kernels.dispatch.logits_fp32`), otherwise the weight's own (a stock bf16 lm_head)."""
    from isoaudit.kernels import dispatch

    if dispatch.is_enabled():
        return "float32"
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    return str(weight.dtype).removeprefix("torch.") if isinstance(weight, torch.Tensor) else None


class EngineCollector(Collector):
    """The handle ``Session.watch_engine(engine)`` returns: call :meth:`record_step` with what each
    ``engine.generate`` returned.

    ``regions``: as for the trainer (``None``: logprobs only). ``contract``: the execution contract
    for the manifest (``"auto"``: built per mode from what the engine runs,
    :func:`isoaudit.collectors.policy.hf_contracts`); ``control``: where the desired mode comes from;
    ``remediation_hook(model, mode)``: how the engine switches (default :mod:`isoaudit.kernels` on/off);
    ``weight_version``: the version of the weights it starts with; ``validate``/``strict``/``keep_records``:
    as for the trainer.
    """

    side = "rollout"
    COUNTERS = CollectorCounters

    def __init__(
        self,
        engine: Any,
        *,
        run: str | Run,
        sink: Sink,
        regions: RegionsArg = "auto",
        contract: ContractArg | Literal["auto"] = None,
        control: ControlChannel | None = None,
        remediation_hook: RemediationHook | None = apply_kernels_mode,
        weight_version: str | int | None = None,
        validate: bool = False,
        strict: bool = False,
        keep_records: bool = False,
    ) -> None:
        # the engine's HFCausalLM (the engine is duck-typed: Any); None fails the checks below
        adapter: Any = getattr(engine, "model", None)
        if not callable(getattr(engine, "generate", None)) or not hasattr(adapter, "step"):
            raise TypeError(
                "engine: expected an isoaudit.kernels.engine.RolloutEngine over an HFCausalLM, "
                f"got {type(engine).__name__}"
            )
        if not isinstance(getattr(adapter, "model", None), torch.nn.Module):
            raise TypeError(
                "engine: its model must wrap a torch.nn.Module (isoaudit.kernels.adapters.HFCausalLM)"
            )
        source: ContractSource
        if contract == "auto":
            from isoaudit.collectors.policy import hf_contracts, torch_op

            source = hf_contracts(adapter.model, native_attention=torch_op("sdpa"))
        else:
            source = contract
        super().__init__(
            run=run,
            sink=sink,
            cases=("engine_prefill", "engine_decode"),
            contract=source,
            control=control,
            strict=strict,
            weight_version=weight_version,
        )
        self.engine = engine
        self.model: torch.nn.Module = adapter.model
        self.remediation_hook = remediation_hook
        self.validate = validate
        self.keep_records = keep_records
        self.temperature = 1.0
        self.prints = EngineFingerprints(adapter, regions, engine) if regions is not None else None
        self._original_generate: Callable[..., Any] = engine.generate
        engine.generate = self._generate  # an instance attribute: removed on detach
        self._observed: list[str] = []
        self._held_now(self.weight_version)
        self._begin([], self._unobserved())

    def record_step(self, step: int, completions: Sequence[Any]) -> RolloutStep | None:
        """Record what ``engine.generate`` returned (``isoaudit.kernels.engine.Completion`` objects) as step
        ``step``: each sample's tokens and logprobs, and the fingerprints the engine computed."""
        return self.guarded("record_step", self._record, step, completions)

    # ------------------------------------------------------------------ internals

    def _generate(self, prompts: Any, max_new: Any, *args: Any, **kwargs: Any) -> Any:
        """The engine's step boundary: a new mode takes effect before the step's first forward."""
        self._step_boundary()
        temperature = kwargs.get("temperature", args[1] if len(args) > 1 else 1.0)
        self.temperature = float(temperature)
        return self._original_generate(prompts, max_new, *args, **kwargs)

    def _unobserved(self) -> dict[str, str]:
        if self.prints is None:
            return {"*": "fingerprints not requested (regions=None)"}
        return self.prints.unobserved

    def _record(self, step: int, completions: Sequence[Any]) -> RolloutStep:
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step: must be an integer >= 0, got {step!r}")
        step = int(step)
        prompts = [list(c.prompt) for c in completions]
        tokens = [list(c.tokens) for c in completions]
        if self.prints is not None:
            seen = [spec.name for spec in self.prints.specs if spec.name not in self.prints.unobserved]
            if seen != self._observed:  # the regions the engine has run through so far
                self._observed = seen
                self._set_observed(seen, self._unobserved())
        records: list[Record] = []
        self._manifests(records)
        batch = StepBatch.padded(prompts, tokens, temperature=self.temperature)
        sequences = [np.asarray(p + t, dtype=np.int32) for p, t in zip(prompts, tokens, strict=True)]
        samples = sample_records(
            run_id=self.run.run_id,
            step=step,
            side="rollout",
            batch=batch,
            tokens=sequences,
            keys=keys_for(batch, sequences),
            logprobs=[np.asarray(c.logprobs, dtype=np.float32) for c in completions],
            weight_version=self.weight_version,
            semantics="raw",  # the engine's logprobs are log_softmax of the raw logits
            validate=self.validate,
        )
        prints = self.prints.records(self.run.run_id, step, prompts, tokens) if self.prints else []
        records += samples
        records += prints
        self.sink.send(records)
        self.counters.steps += 1
        self.counters.samples += len(samples)
        self.counters.fingerprint_records += len(prints)
        keys = [str(s.sample_key) for s in samples]
        return RolloutStep(step, keys, len(prints), records if self.keep_records else [])

    def _runtime(self) -> RuntimeFacts:
        param = next(self.model.parameters(), None)
        dtype = str(param.dtype).removeprefix("torch.") if param is not None else None
        graphed = getattr(self.engine, "graphed", None)
        in_graphs = bool(graphed()) if callable(graphed) else None
        facts = RuntimeFacts(
            framework="isoaudit.kernels.engine",
            torch_version=torch.__version__,
            device=str(param.device) if param is not None else None,
            dtype=dtype,
            lm_head_dtype=_head_dtype(self.model),
            logprobs_mode="raw_logprobs",
            prefix_caching=False,
            chunked_prefill=getattr(self.engine, "prefill_chunk", None) is not None,
            cuda_graphs=in_graphs,
        )
        if not in_graphs:
            return facts
        # how a mode switch reaches the graphs, and whether the fingerprints run inside them
        return facts.model_copy(
            update={
                "graph_recapture": "each bucket at its next decode after a mode switch",
                "fingerprints_in_graphs": self.prints is not None and self.prints.engine is not None,
            }
        )

    def _signature(self) -> tuple[Any, ...]:
        param = next(self.model.parameters(), None)
        return (param.dtype, param.device, _head_dtype(self.model)) if param is not None else ()

    def _apply_mode(self, mode: str, version: int | None) -> ModeReport:
        report = switch_with(self.remediation_hook, self.model, mode, "engine")
        drop = getattr(self.engine, "drop_graphs", None)
        if callable(drop):  # graphs captured in the old mode: each bucket is captured again
            drop()
        return report

    def _weights_moved(self, version: str, digest: str | None) -> None:
        self._held_now(version)

    def _held_now(self, version: str | None) -> None:
        """Digest the parameters the engine's model holds, then run the canary through the decode
        the engine runs (:func:`isoaudit.collectors.canary.engine_canary`)."""
        digests = self.guarded("weight digests", module_digests, self.model)
        self.weight_tensor_digests = digests if digests is not None else {}
        if not self.canary_enabled:
            return
        vocab = self.guarded("canary", vocab_of, self.model)
        tokens = self.guarded("canary", canary_tokens, vocab) if vocab is not None else None
        if tokens is None:
            return
        step = self.prints._original_step if self.prints is not None else None
        self._take_canary(version, tokens, lambda: engine_canary(self.engine, tokens, step))

    def _remove_hooks(self) -> None:
        if self.prints is not None:
            self.prints.detach()
        if vars(self.engine).get("generate") == self._generate:
            del self.engine.generate
