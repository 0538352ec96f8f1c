"""Fingerprints inside the engine: hooks on the vLLM model, rows mapped to (request, position).

One :class:`EngineCapture` lives in each worker. It wraps the model runner's ``execute_model`` (to
know a real step from a warm-up or dummy forward, and to see which requests finished), reads each
forward's layout (:mod:`isoaudit.collectors.vllm.worker.rows`) in a pre-hook on the model, and in
the region hooks copies only the rows of the requests chosen for fingerprinting into the
:class:`~isoaudit.collectors.vllm.worker.print_buffer.PrintBuffer`. Requests and their filed
fingerprints live in the :class:`~isoaudit.collectors.vllm.worker.requests.RequestBook` until the
driver drains them; a requested remediation mode waits in the
:class:`~isoaudit.collectors.vllm.worker.mode.ModeSwitcher` for the next step boundary.

In a compiled engine (``decoder``: :class:`~isoaudit.collectors.vllm.worker.graph.CompiledDecoder`)
the regions inside the compiled module are taps instead: each hook calls the fingerprint op's
row-index variant (``isoaudit::fingerprint_index_rows_``, :mod:`isoaudit.collectors.fingerprint_op`),
which fingerprints the selected rows in the forward itself into preallocated
:class:`~isoaudit.collectors.fingerprint_op.FingerprintBuffers` (``[regions, max_rows]`` rows of
144 bytes, not the rows themselves). The rows are chosen by an index buffer the pre-hook fills
before each forward, outside the graph, and a count held in a tensor (on a GPU: the index padded to
its fixed length instead, so the work does not depend on a host read). After the step the host
hands the buffers' first rows to the print buffer, which files them under requests as it files its
own passes. Hooks are traced into the graph only when it is compiled, so every change of what the
graph holds (regions on or off, the remediation mode) selects the decoder's variant for that state
at the step boundary.

It never raises into the engine: errors are counted and logged once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from isoaudit.collectors.counting import Counters, LogOnce
from isoaudit.collectors.fingerprint_op import record_rows
from isoaudit.collectors.fingerprints import default_ladder_bits, fingerprint_rows
from isoaudit.collectors.regions import RegionSpec, Tap, read_tap
from isoaudit.collectors.vllm.messages import Drained, ModeState, RequestRecord, Selection, SetMode
from isoaudit.collectors.vllm.worker.graph import CompiledDecoder, GraphTaps, tap_rows
from isoaudit.collectors.vllm.worker.mode import ModeKernels, ModeOps, ModeSwitch, ModeSwitcher
from isoaudit.collectors.vllm.worker.print_buffer import IDLE, Fingerprinter, Member, PrintBuffer, StepRows
from isoaudit.collectors.vllm.worker.requests import RequestBook, RequestTrace, payload
from isoaudit.collectors.vllm.worker.rows import ForwardRows, read_forward_rows
from torch import nn
from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)


class CaptureCounters(Counters):
    NAMES = (
        "steps",
        "forwards",
        "fingerprinted_forwards",
        "requests_seen",
        "requests_selected",
        "rows",
        "dropped_rows",
        "evicted_requests",
        "recomputed_rows",
        "unmappable",
        "errors",
    )


class _Unmappable(Exception):
    """A region's rows do not correspond to the forward's layout."""


def _tap_parts(output: Any, tap: Tap, rows: int, exact: bool) -> list[torch.Tensor]:
    """The tensors a tap reads, as [rows, width]: the first, or the first two for a SUM tap.
    ``rows``: how many rows the output must have (at least, or ``exact``ly)."""
    if tap is Tap.SUM:
        found = [
            t
            for t in (output if isinstance(output, tuple | list) else (output,))
            if isinstance(t, torch.Tensor)
        ]
        parts = found[:2]
    else:
        first = read_tap(output, Tap.FIRST)
        parts = [first] if first is not None else []
    parts = [p.reshape(-1, p.shape[-1]) for p in parts]
    for part in parts:
        if part.shape[0] < rows or (exact and part.shape[0] != rows):
            raise _Unmappable
    return parts


def _positions_arg(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    value = kwargs.get("positions")
    if value is None and len(args) > 1:
        value = args[1]
    return value if isinstance(value, torch.Tensor) and value.dim() == 1 else None


@dataclass(frozen=True)
class _Decoding:
    """A forward whose batch decodes one row per request: what the next forward of the same batch
    reuses (its row layout, members, index tensors and flat rows)."""

    layout: ForwardRows
    members: list[Member]
    index: torch.Tensor
    logits_index: torch.Tensor | None
    rows: np.ndarray


class EngineCapture:
    """Hooks one worker's model; :meth:`drain` hands over what it recorded per request.

    ``runner``: vLLM's GPU/CPU model runner (its ``execute_model``, ``input_batch`` and
    ``requests`` are read); ``specs``: the regions to hook; ``selection``: which requests are
    fingerprinted; ``refusal``: why no region may be hooked in this engine (``None``: they may).
    ``max_requests``/``max_rows``/``flush_bytes``: the buffers' bounds; ``mode_switch``/``mode_ops``:
    the worker's remediation; ``mode_kernels``: its kernels' launch settings in the mode it runs."""

    def __init__(
        self,
        runner: Any,
        model: nn.Module,
        specs: Sequence[RegionSpec],
        selection: Selection,
        *,
        refusal: str | None = None,
        max_requests: int = 65536,
        max_rows: int = 1 << 20,
        flush_bytes: int = 64 << 20,
        fingerprinter: Fingerprinter = fingerprint_rows,
        mode_switch: ModeSwitch | None = None,
        mode_ops: ModeOps | None = None,
        mode_kernels: ModeKernels | None = None,
        decoder: CompiledDecoder | None = None,
        graph_rows: int = 0,
    ) -> None:
        if max_requests < 1 or max_rows < 0 or flush_bytes < 0:
            raise ValueError(
                f"max_requests/max_rows/flush_bytes: must be >= 1 / >= 0 / >= 0, got {max_requests}/{max_rows}/{flush_bytes}"
            )
        self.runner = runner
        self.model = model
        self.specs = list(specs)
        self._selection = selection
        self.refusal = refusal
        self.version: str | None = None
        self.counters = CaptureCounters()
        self._warn = LogOnce(log)
        self.book = RequestBook(
            max_requests=max_requests, max_rows=max_rows, counters=self.counters, warn=self._warn
        )
        self.prints = PrintBuffer(
            [spec.name == "logits" for spec in self.specs],
            self.book,
            self.counters,
            flush_bytes=flush_bytes,
            fingerprinter=fingerprinter,
        )
        self.decoder = decoder
        self.modes = ModeSwitcher(self._switch_and_select(mode_switch), mode_ops, self._fail, mode_kernels)
        self._in_step = False
        self._fwd: StepRows | None = None
        self._last_ids: list[str] = []
        self._last_version: str | None = None
        self._last_selected = False
        self._last_forgotten = 0
        # _last_ids' selected requests: their traces, batch indices and prompt lengths
        self._chosen_traces: list[RequestTrace] = []
        self._chosen_index = np.zeros(0, np.int64)
        self._chosen_prompt = np.zeros(0, np.int64)
        self._decoding: _Decoding | None = None  # the last forward, when the next may repeat its rows
        self._handles: list[RemovableHandle] = []
        self._region_handles: list[RemovableHandle] = []
        self._original_execute: Callable[..., Any] | None = None
        # compiled engines: the graph taps' buffers (allocated when the taps are first installed)
        self._graph_rows = graph_rows
        self._graph_regions: list[int] = []
        self._split: tuple[tuple[int, ...], list[int], list[int]] | None = None  # _split_stageable's
        self._taps: GraphTaps | None = None  # the decoder's, once a region is tapped
        self._install()

    @property
    def traces(self) -> OrderedDict[str, RequestTrace]:
        """The requests seen and not yet drained, by engine id."""
        return self.book.traces

    @property
    def mode(self) -> ModeState:
        """The remediation mode this worker runs now (and, compiled, what its decoder has compiled in)."""
        if self.decoder is None:
            return self.modes.state
        graph = {**self.decoder.facts(), **self.graph_buffer_facts()}
        return msgspec.structs.replace(self.modes.state, graph=graph)

    def graph_buffer_facts(self) -> dict[str, int]:
        """The graph taps' fingerprint buffers: bytes held on the device and their row bound
        (empty before any region is tapped)."""
        taps = self._taps
        if taps is None:
            return {}
        stage_rows = int(taps.stage.shape[1]) if taps.stage is not None else 0
        return {
            "tap_buffer_bytes": taps.nbytes,
            "tap_rows": taps.prints.rows,
            "tap_slots": taps.prints.slots,
            "tap_stage_rows": stage_rows,
        }

    # ------------------------------------------------------------ install / remove

    def _install(self) -> None:
        original = self.runner.execute_model
        self._original_execute = original

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._begin_step(scheduler_output)
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                self._end_step()

        self.runner.execute_model = execute_model  # an instance attribute: removed on detach
        self._handles.append(self.model.register_forward_pre_hook(self._open, with_kwargs=True))
        self._sync_region_hooks()

    def _sync_region_hooks(self) -> None:
        """Region hooks exist only while some request can be selected: logprobs-only collection then
        costs the engine one pre-hook per forward and nothing per region."""
        wanted = (
            self.refusal is None
            and bool(self.specs)
            and (self._selection.mode != "none" or self.book.keeps_selected())
        )
        if wanted and not self._region_handles:
            self._graph_regions = []
            inside = set(self._compiled_names())
            for i, spec in enumerate(self.specs):
                module = self.model.get_submodule(spec.module)
                if spec.module in inside:
                    hook = self._graph_hook(i, spec, module)
                    if hook is None:
                        continue
                    self._graph_regions.append(i)
                else:
                    hook = self._region_hook(i, spec)
                self._region_handles.append(module.register_forward_hook(hook))
            if self.decoder is not None and self._taps is not None and self._graph_regions:
                signature = tuple(
                    (self.specs[i].module, self.specs[i].tap, self.prints._slots[i])
                    for i in self._graph_regions
                )
                self.decoder.retap(self._taps, signature)
        elif not wanted:
            for handle in self._region_handles:
                handle.remove()
            self._region_handles.clear()
            self._graph_regions = []
        self.select_graph()

    def _compiled_names(self) -> list[str]:
        """The model's module names inside the compiled decoder (none in an eager engine)."""
        if self.decoder is None:
            return []
        root = self.decoder.module
        prefix = next((name for name, m in self.model.named_modules() if m is root), None)
        if prefix is None:
            return []
        return [f"{prefix}.{name}".strip(".") for name, _ in root.named_modules()]

    def select_graph(self) -> None:
        """The compiled decoder's state from the next forward on: regions tapped or not, and the
        remediation mode applied (compiled on first use)."""
        if self.decoder is not None:
            self.decoder.select((bool(self._graph_regions), self.modes.state.applied))

    @property
    def graph_regions(self) -> list[str]:
        """The regions recorded by graph taps inside the compiled decoder."""
        return [self.specs[i].name for i in self._graph_regions]

    @property
    def selection(self) -> Selection:
        return self._selection

    @selection.setter
    def selection(self, selection: Selection) -> None:
        """Applies to requests the engine has not seen yet (a request keeps its first choice)."""
        self._selection = selection
        if self._original_execute is not None:
            self._sync_region_hooks()

    def _switch_and_select(self, switch: ModeSwitch | None) -> ModeSwitch | None:
        """The remediation switch, followed by the compiled decoder's variant for the new mode."""
        if switch is None or self.decoder is None:
            return switch
        decoder = self.decoder

        def switched(mode: str) -> tuple[str, str | None]:
            applied, reason = switch(mode)
            decoder.select((bool(self._graph_regions), applied))
            return applied, reason

        return switched

    def remove(self) -> None:
        """Remove every hook and restore ``execute_model`` (and vLLM's own compiled decoder)."""
        for handle in self._handles + self._region_handles:
            handle.remove()
        self._handles.clear()
        self._region_handles.clear()
        self._graph_regions = []
        if self.decoder is not None:
            self.decoder.release()
        if self._original_execute is not None and "execute_model" in vars(self.runner):
            del self.runner.execute_model
        self._original_execute = None
        self._fwd = None
        self.prints.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------ step

    def request_mode(self, request: SetMode) -> None:
        """Switch to ``request.mode`` at the next step boundary (the next ``execute_model``)."""
        self.modes.request(request)

    def _begin_step(self, scheduler_output: Any) -> None:
        self._in_step = True
        self._fwd = None
        try:
            self.modes.at_step_boundary(self.counters.steps)
            self.counters.steps += 1
            if self._region_handles and self._selection.mode == "none":
                self._sync_region_hooks()
            self.book.finished(getattr(scheduler_output, "finished_req_ids", ()) or ())
        except Exception as exc:
            self._fail("step", exc)

    def _end_step(self) -> None:
        """Hand the step's selected rows to the print buffer (in a compiled engine: the stage the
        graph taps wrote)."""
        self._in_step = False
        fwd, self._fwd = self._fwd, None
        taps = self._taps
        selected = taps.selected if taps is not None else 0
        picked = taps.picked if taps is not None else None
        if taps is not None:
            taps.clear_rows()  # a forward outside a step (warm-up, dummy run) taps nothing
        if fwd is None:
            return
        try:
            if selected and taps is not None and fwd.index is not None:
                printed = self._graph_regions
                if taps.staged(selected):
                    staged, unstaged = self._split_stageable()
                    if staged:
                        assert taps.stage is not None
                        # fingerprinted in the batched pass: the op's own gather, or the stage's copy
                        fwd.stage = picked if picked is not None else taps.stage[:, :selected].clone()
                        fwd.filled = list(staged)
                        printed = unstaged
                if printed:
                    # ~144 bytes a row: copied out, the next forward writes the same buffers
                    prints = taps.prints
                    fwd.printed = (prints.ints[:, :selected].clone(), prints.floats[:, :selected].clone())
                    fwd.printed_bits = taps.bits
                    fwd.printed_regions = printed
            self.prints.keep(fwd)
        except Exception as exc:
            self._fail("step rows", exc)

    # ------------------------------------------------------------ hooks

    def _trace(self, req_id: str) -> RequestTrace:
        trace = self.book.traces.get(req_id)
        if trace is None:
            state = getattr(self.runner, "requests", {}).get(req_id)
            trace = self.book.register(req_id, state, self._selection, self.version)
        return trace

    def _open(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._in_step or self._fwd is not None:
            return  # a warm-up/dummy forward, or a nested call of the root
        if self._taps is not None:
            self._taps.clear_rows()
        try:
            self.counters.forwards += 1
            batch = self.runner.input_batch
            n = int(batch.num_reqs)
            ids = batch.req_ids[:n]
            # Decode steps repeat the same batch: bookkeeping only when it (or the weights) changed.
            if (
                ids != self._last_ids
                or self.version != self._last_version
                or self.book.forgotten != self._last_forgotten
            ):
                self._last_ids, self._last_version = list(ids), self.version
                self._last_forgotten = self.book.forgotten
                selected: list[tuple[int, RequestTrace]] = []
                for i, req_id in enumerate(ids):
                    trace = self._trace(req_id)
                    trace.last_version = self.version
                    if trace.selected:
                        selected.append((i, trace))
                self._chosen_traces = [trace for _, trace in selected]
                self._chosen_index = np.array([i for i, _ in selected], dtype=np.int64)
                self._chosen_prompt = np.array([t.prompt_len for t in self._chosen_traces], dtype=np.int64)
                self._last_selected = bool(selected)
                self._decoding = None
            if not (self._last_selected and self._region_handles):
                self._fwd = IDLE
                return
            positions = _positions_arg(args, kwargs)
            decoding = self._decoding
            if (
                decoding is not None
                and positions is not None
                and positions.numel() >= n
                and int(self.runner.query_start_loc.np[n]) == n
            ):
                # The same batch, every request decoding one row again: the last forward's rows.
                self._fwd = StepRows(
                    decoding.layout,
                    decoding.members,
                    decoding.index,
                    decoding.logits_index,
                    positions.index_select(0, decoding.index),
                )
                if self._graph_regions and self._taps is not None:
                    self._taps.set_rows(decoding.rows, same=True)
                return
            layout = read_forward_rows(self.runner)
            chosen = self._chosen_index
            picked = layout.select(chosen, self._chosen_prompt)
            rows = picked.rows
            members = [
                Member(trace, i, k, first, count, decode, None)
                for k, (trace, i, first, count, decode) in enumerate(
                    zip(
                        self._chosen_traces,
                        chosen.tolist(),
                        picked.firsts.tolist(),
                        picked.counts.tolist(),
                        picked.decode.tolist(),
                        strict=True,
                    )
                )
            ]
            if positions is not None and positions.numel() < layout.num_tokens:
                positions = None
            device = positions.device if positions is not None else torch.device("cpu")
            index = torch.from_numpy(rows).to(device)
            if positions is None:
                for m in members:
                    m.positions = layout.positions(m.index)
            self._fwd = StepRows(
                layout,
                members,
                index,
                torch.from_numpy(chosen).to(device),
                positions.index_select(0, index) if positions is not None else None,
            )
            if self._graph_regions and self._taps is not None:
                self._taps.set_rows(rows)
            # every request one row and every selected one decoding: the next forward of this batch
            # repeats these rows (members hold nothing of a forward's own: shared by the steps)
            one_each = layout.num_tokens == len(layout.req_ids)
            self._decoding = (
                _Decoding(layout, members, index, self._fwd.logits_index, rows)
                if positions is not None and one_each and bool(picked.decode.all())
                else None
            )
        except Exception as exc:
            self._fail("layout", exc)
            self._fwd = None
            self._decoding = None

    def _graph_hook(
        self, i: int, spec: RegionSpec, module: nn.Module
    ) -> Callable[[nn.Module, Any, Any], None] | None:
        """A hook Dynamo traces into the compiled decoder: one fingerprint op over the selected rows
        into the region's slot of the buffers. Read as the eager hooks read it: the first tensor
        (a router's logits included, in their own dtype), or hidden + residual for a SUM tap. Every
        region inside the decoder computes in the model's dtype, whose ladder the host reads the
        slots with (``None``: the region is not tapped)."""
        if spec.tap not in (Tap.FIRST, Tap.SUM, Tap.FP32):
            return None
        assert self.decoder is not None
        if self._taps is None:
            device = next(self.model.parameters()).device
            slots = max(1, sum(1 for s in self.specs if s.name != "logits"))
            rows = max(1, self._graph_rows)
            taps = self.decoder.taps  # kept on the worker: a re-attach reuses its compiled variants
            if taps is None or not taps.fits(slots, rows, device):
                dtype = self.runner.model_config.dtype
                hidden = int(self.runner.model_config.get_hidden_size())
                taps = GraphTaps.allocate(slots, rows, default_ladder_bits(dtype), device, hidden, dtype)
            self._taps = taps
        taps = self._taps
        index, ladder, stage, ident = taps.index, list(taps.bits), taps.stage, taps.ident
        count = None if taps.padded else taps.count
        slot = self.prints._slots[i]
        ints, floats = taps.prints.views(slot)
        sum_tap = spec.tap is Tap.SUM
        stageable = self._stageable(spec)

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if isinstance(output, tuple | list):
                first = output[0]
                second = output[1] if sum_tap else None
            else:
                first, second = output, None
            if stage is not None:  # a CPU engine: the op reads the host's selection
                if not taps.hold(first, second, slot, stageable):  # held: one op at the forward's end
                    tap_rows(first, second, stage, ident, slot, stageable)
            else:
                record_rows(first, second, index, count, ints, floats, ladder)

        return hook

    def _split_stageable(self) -> tuple[list[int], list[int]]:
        """The graph regions whose rows a CPU forward stages, and the others (kept while the graph
        regions stay the same)."""
        key = tuple(self._graph_regions)
        split = self._split
        if split is None or split[0] != key:
            staged = [i for i in key if self._stageable(self.specs[i])]
            split = self._split = (key, staged, [i for i in key if i not in staged])
        return split[1], split[2]

    @staticmethod
    def _stageable(spec: RegionSpec) -> bool:
        """Whether a graph region's rows are hidden-size, so fit the CPU stage (a MoE router's
        logits, one per expert, are fingerprinted in the graph instead)."""
        return spec.tap is not Tap.FP32

    def _region_hook(self, i: int, spec: RegionSpec) -> Callable[[nn.Module, Any, Any], None]:
        logits = spec.name == "logits"

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            fwd = self._fwd
            if fwd is None or fwd.index is None:
                return
            try:
                if logits:  # one logits row per request, in batch order (no speculative decoding)
                    parts = _tap_parts(output, spec.tap, len(fwd.layout.req_ids), True)
                    if parts:
                        self.prints.add_logits(fwd, i, parts)
                    return
                parts = _tap_parts(output, spec.tap, fwd.layout.num_tokens, False)
                if parts:
                    self.prints.add_hidden(fwd, i, parts)
            except _Unmappable:
                self.counters.unmappable += 1
                self._warn.warn(
                    f"unmappable:{spec.name}",
                    f"isoaudit vllm collector: {spec.name} rows do not fit the "
                    "batch layout; not recorded (counted)",
                )
            except Exception as exc:
                self._fail(spec.name, exc)

        return hook

    # ------------------------------------------------------------ driver side

    def flush(self) -> None:
        """Fingerprint every step the print buffer holds (:meth:`PrintBuffer.flush`)."""
        self.prints.flush()

    def drain(self, ext_ids: Iterable[str]) -> Drained:
        """Hand over (and forget) what the engine recorded for these requests, keyed by their
        external ids, with the worker's counters and the mode it runs."""
        try:
            self.prints.flush()
        except Exception as exc:
            self._fail("flush", exc)
        out: dict[str, RequestRecord] = {}
        missing: list[str] = []
        names = [spec.name for spec in self.specs]
        for ext in ext_ids:
            trace = self.book.latest(ext)
            if trace is None:
                missing.append(ext)
                continue
            try:
                out[ext], recomputed = payload(trace, names)
                self.counters.recomputed_rows += recomputed
            except Exception as exc:
                self._fail("payload", exc)
            self.book.forget(trace)
        return Drained(requests=out, missing=missing, counters=self.counters.as_dict(), mode=self.mode)

    # ------------------------------------------------------------ errors

    def _fail(self, where: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._warn.warn(
            f"fail:{where}",
            f"isoaudit vllm collector: {where} failed ({type(exc).__name__}: {exc}); counted, the engine goes on",
        )
