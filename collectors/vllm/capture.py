"""Fingerprints inside the engine: hooks on the vLLM model, rows mapped to (request, position).

One :class:`EngineCapture` lives in each worker. It wraps the model runner's ``execute_model`` (to
know a real step from a warm-up or dummy forward, and to see which requests finished), reads each
forward's layout (:mod:`collectors.vllm.rows`) in a pre-hook on the model, and in the region hooks
copies only the rows of the requests chosen for fingerprinting. Those copies wait, and are
fingerprinted many steps at a time (one :func:`~collectors.fingerprints.fingerprint_rows` call per row
width, one device-to-host transfer) when they exceed ``flush_bytes`` or when the driver drains:
per-call overhead then hardly counts, and a GPU is not synchronised every step. The results are
filed under each request until the driver drains them.

It never raises into the engine: errors are counted and logged once. Its buffers are bounded
(requests and fingerprint rows); past a bound it evicts finished, never-drained requests first,
then drops new rows, counting both, so a collector that nobody drains cannot grow without limit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from isoaudit.collectors.counting import Counters, LogOnce
from isoaudit.collectors.fingerprints import RowFingerprints, device_tensors, fingerprint_rows, host_rows
from isoaudit.collectors.regions import RegionSpec, Tap, read_tap
from isoaudit.collectors.transfer import to_host
from isoaudit.collectors.vllm.messages import Drained, ModeState, Selection, SetMode
from isoaudit.collectors.vllm.rows import ForwardRows, read_forward_rows
from isoaudit.collectors.vllm.traces import Piece, RequestTrace, external_id, payload
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


#: ``switch(mode) -> (applied, reason)``: how a worker switches its engine's remediation mode.
ModeSwitch = Callable[[str], tuple[str, str | None]]


@dataclass
class _Member:
    """A selected request in one forward: its rows ``[first, first + count)`` of the selection."""

    trace: RequestTrace
    index: int  # position in the batch (its logits row)
    row: int  # position among the forward's selected requests (its row of the selected logits)
    first: int
    count: int
    decode: bool
    positions: np.ndarray | None  # None: read from the forward's positions at the flush


@dataclass
class _Forward:
    """The selected rows of the forward in flight, and later of a step waiting to be fingerprinted."""

    layout: ForwardRows
    members: list[_Member]
    index: torch.Tensor | None  # flat rows of the selected requests, concatenated in batch order
    logits_index: torch.Tensor | None  # their batch indices (logits rows)
    positions: torch.Tensor | None  # the forward's own positions of those rows
    # Hidden-state regions write their selected rows straight into one staging tensor
    # [slots, selected rows, width] (no small allocations, one tensor per step to concatenate).
    stage: torch.Tensor | None = None
    filled: list[int] = field(default_factory=list)  # regions written into the stage
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # logits, and odd shapes

    @property
    def selected_rows(self) -> int:
        return int(self.index.numel()) if self.index is not None else 0


#: The forward in flight when nothing of it is recorded (hooks return at once on it).
_IDLE = _Forward(ForwardRows((), np.zeros(1, np.int64), np.zeros(0, np.int64)), [], None, None, None)


def _sampling(params: Any) -> tuple[float, int | None, float | None]:
    if params is None:
        return 1.0, None, None
    temperature = float(getattr(params, "temperature", 1.0) or 0.0)
    top_k = getattr(params, "top_k", None)
    top_k = int(top_k) if top_k is not None and int(top_k) > 0 else None
    top_p = getattr(params, "top_p", None)
    top_p = float(top_p) if top_p is not None else None
    return temperature, top_k, top_p


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


def _select(
    parts: Sequence[torch.Tensor], index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tap's value at the selected rows only, as a copy (vLLM's fused norms later overwrite the
    module outputs in place). Rows are selected *before* a SUM tap adds hidden + residual: the add
    then runs on a few rows, not the whole batch; elementwise, the bits are the same."""
    index = index.to(parts[0].device)
    if out is None:
        out = parts[0].index_select(0, index)
    else:
        torch.index_select(parts[0], 0, index, out=out)
    if len(parts) > 1:
        out.add_(parts[1].index_select(0, index))
    return out


def _positions_arg(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    value = kwargs.get("positions")
    if value is None and len(args) > 1:
        value = args[1]
    return value if isinstance(value, torch.Tensor) and value.dim() == 1 else None


class EngineCapture:
    """Hooks one worker's model; :meth:`drain` hands over what it recorded per request."""

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
        fingerprinter: Callable[[torch.Tensor], RowFingerprints] = fingerprint_rows,
        mode_switch: ModeSwitch | None = None,
        mode_ops: Callable[[], dict[str, str]] | None = None,
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
        self.max_requests = max_requests
        self.max_rows = max_rows
        self.flush_bytes = flush_bytes
        self.fingerprinter = fingerprinter
        hidden = [i for i, spec in enumerate(self.specs) if spec.name != "logits"]
        self._slots = {region: slot for slot, region in enumerate(hidden)}
        self._slots_count = max(1, len(hidden))
        self.version: str | None = None
        self.counters = CaptureCounters()
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self._by_ext: dict[str, list[str]] = {}
        self._buffered_rows = 0
        self._ordinal = 0
        self._in_step = False
        self._fwd: _Forward | None = None
        self._last_ids: list[str] = []
        self._last_version: str | None = None
        self._last_selected = False
        self._unprinted: list[_Forward] = []
        self._unprinted_bytes = 0
        self._warn = LogOnce(log)
        self.mode_switch = mode_switch
        self.mode_ops = mode_ops
        self.mode = ModeState(ops=self._ops())
        self._pending_mode: SetMode | None = None
        self._handles: list[RemovableHandle] = []
        self._region_handles: list[RemovableHandle] = []
        self._original_execute: Callable[..., Any] | None = None
        self._install()

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
            and (
                self._selection.mode != "none"
                or any(t.selected and not t.finished for t in self.traces.values())  # they keep their choice
            )
        )
        if wanted and not self._region_handles:
            for i, spec in enumerate(self.specs):
                module = self.model.get_submodule(spec.module)
                self._region_handles.append(module.register_forward_hook(self._region_hook(i, spec)))
        elif not wanted:
            for handle in self._region_handles:
                handle.remove()
            self._region_handles.clear()

    @property
    def selection(self) -> Selection:
        return self._selection

    @selection.setter
    def selection(self, selection: Selection) -> None:
        """Applies to requests the engine has not seen yet (a request keeps its first choice)."""
        self._selection = selection
        if self._original_execute is not None:
            self._sync_region_hooks()

    def remove(self) -> None:
        """Remove every hook and restore ``execute_model``."""
        for handle in self._handles + self._region_handles:
            handle.remove()
        self._handles.clear()
        self._region_handles.clear()
        if self._original_execute is not None and "execute_model" in vars(self.runner):
            del self.runner.execute_model
        self._original_execute = None
        self._fwd = None
        self._unprinted.clear()
        self._unprinted_bytes = 0

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------ step

    def request_mode(self, request: SetMode) -> None:
        """Switch to ``request.mode`` at the next step boundary (the next ``execute_model``)."""
        self._pending_mode = request

    def _switch_mode(self) -> None:
        request, self._pending_mode = self._pending_mode, None
        if request is None:
            return
        try:
            if self.mode_switch is None:
                applied, reason = "native", "this worker has no way to switch modes"
            else:
                applied, reason = self.mode_switch(request.mode)
        except Exception as exc:  # the engine goes on in the mode it had
            self._fail("mode switch", exc)
            applied, reason = self.mode.applied, f"switching failed ({type(exc).__name__}: {exc})"
        self.mode = ModeState(
            requested=request.mode,
            applied=applied,
            reason=reason,
            version=request.version,
            step=self.counters.steps,
            ops=self._ops(),
        )

    def _ops(self) -> dict[str, str]:
        """What runs each op now, as the worker's remediation says (empty when it cannot)."""
        if self.mode_ops is None:
            return {}
        try:
            return dict(self.mode_ops())
        except Exception as exc:
            self._fail("mode ops", exc)
            return {}

    def _begin_step(self, scheduler_output: Any) -> None:
        self._in_step = True
        self._fwd = None
        try:
            if self._pending_mode is not None:
                self._switch_mode()
            self.counters.steps += 1
            if self._region_handles and self._selection.mode == "none":
                self._sync_region_hooks()
            for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
                trace = self.traces.get(req_id)
                if trace is not None:
                    trace.finished = True
        except Exception as exc:
            self._fail("step", exc)

    def _end_step(self) -> None:
        """Keep the step's selected rows for a later, batched fingerprint pass: one pass over many
        steps costs far less than one per step (and, on a GPU, does not synchronise every step)."""
        self._in_step = False
        fwd, self._fwd = self._fwd, None
        if fwd is None or fwd is _IDLE or not (fwd.pending or fwd.filled):
            return
        try:
            logits = sum(1 for i, _ in fwd.pending if self.specs[i].name == "logits")
            hidden = len(fwd.filled) + len(fwd.pending) - logits
            kept = []
            for member in fwd.members:
                needed = member.count * hidden + logits
                if self._room_for(needed):
                    member.trace.rows += needed
                    self._buffered_rows += needed
                    kept.append(member)
                else:
                    member.trace.truncated = True
                    self.counters.dropped_rows += needed
            if not kept:
                return
            fwd.members = kept
            if fwd.positions is not None and fwd.positions.device.type == "cpu":
                host = fwd.positions.numpy()
                for member in kept:
                    member.positions = host[member.first : member.first + member.count].astype(np.int64)
                fwd.positions = None
            self._unprinted.append(fwd)
            staged = [fwd.stage] if fwd.stage is not None else []
            self._unprinted_bytes += sum(
                t.numel() * t.element_size() for t in staged + [t for _, t in fwd.pending]
            )
            if self._unprinted_bytes >= self.flush_bytes:
                self.flush()
        except Exception as exc:
            self._fail("step rows", exc)

    # ------------------------------------------------------------ hooks

    def _open(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._in_step or self._fwd is not None:
            return  # a warm-up/dummy forward, or a nested call of the root
        try:
            self.counters.forwards += 1
            batch = self.runner.input_batch
            ids = batch.req_ids[: int(batch.num_reqs)]
            # Decode steps repeat the same batch: bookkeeping only when it (or the weights) changed.
            if ids != self._last_ids or self.version != self._last_version:
                self._last_ids, self._last_version, self._last_selected = list(ids), self.version, False
                for req_id in ids:
                    trace = self.traces.get(req_id) or self._register(req_id)
                    trace.last_version = self.version
                    self._last_selected |= trace.selected
            if not (self._last_selected and self._region_handles):
                self._fwd = _IDLE
                return
            layout = read_forward_rows(self.runner)
            members: list[_Member] = []
            first = 0
            for i, req_id in enumerate(layout.req_ids):
                trace = self.traces.get(req_id) or self._register(req_id)
                if trace.selected:
                    a, b = layout.rows(i)
                    decode = layout.case(i, trace.prompt_len) == "engine_decode"
                    members.append(_Member(trace, i, len(members), first, b - a, decode, None))
                    first += b - a
            if not members:
                self._fwd = _IDLE
                return
            rows = np.concatenate([np.arange(*layout.rows(m.index)) for m in members])
            positions = _positions_arg(args, kwargs)
            if positions is not None and positions.numel() < layout.num_tokens:
                positions = None
            device = positions.device if positions is not None else torch.device("cpu")
            index = torch.from_numpy(rows).to(device)
            if positions is None:
                for m in members:
                    m.positions = layout.positions(m.index)
            self._fwd = _Forward(
                layout,
                members,
                index,
                torch.tensor([m.index for m in members], dtype=torch.long, device=device),
                positions.index_select(0, index) if positions is not None else None,
            )
        except Exception as exc:
            self._fail("layout", exc)
            self._fwd = None

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
                        fwd.pending.append((i, _select(parts, fwd.logits_index).float()))  # type: ignore[arg-type]
                    return
                parts = _tap_parts(output, spec.tap, fwd.layout.num_tokens, False)
                if not parts:
                    return
                first = parts[0]
                if fwd.stage is None:
                    shape = (self._slots_count, fwd.selected_rows, first.shape[-1])
                    fwd.stage = torch.empty(shape, dtype=first.dtype, device=first.device)
                stage = fwd.stage
                if (stage.dtype, stage.shape[-1], stage.device) == (
                    first.dtype,
                    first.shape[-1],
                    first.device,
                ):
                    _select(parts, fwd.index, out=stage[self._slots[i]])  # type: ignore[arg-type]
                    fwd.filled.append(i)
                else:
                    fwd.pending.append((i, _select(parts, fwd.index)))  # type: ignore[arg-type]
            except _Unmappable:
                self.counters.unmappable += 1
                self._log_once(
                    f"unmappable:{spec.name}",
                    f"isoaudit vllm collector: {spec.name} rows do not fit the "
                    "batch layout; not recorded (counted)",
                )
            except Exception as exc:
                self._fail(spec.name, exc)

        return hook

    # ------------------------------------------------------------ bookkeeping

    def _register(self, req_id: str) -> RequestTrace:
        state = getattr(self.runner, "requests", {}).get(req_id)
        prompt = getattr(state, "prompt_token_ids", None)
        prompt_len = len(prompt) if prompt is not None else int(getattr(state, "num_prompt_tokens", 0) or 0)
        temperature, top_k, top_p = _sampling(getattr(state, "sampling_params", None))
        ext = external_id(req_id)
        selected = self.selection.chooses(self._ordinal, ext)
        self._ordinal += 1
        trace = RequestTrace(
            req_id, ext, prompt_len, temperature, top_k, top_p, selected, self.version, self.version
        )
        self.traces[req_id] = trace
        self._by_ext.setdefault(ext, []).append(req_id)
        self.counters.requests_seen += 1
        self.counters.requests_selected += int(selected)
        while len(self.traces) > self.max_requests:
            victim = next((t for t in self.traces.values() if t.finished), None) or next(
                iter(self.traces.values())
            )
            self._forget(victim)
            self.counters.evicted_requests += 1
            self._log_once(
                "evict", "isoaudit vllm collector: request buffer full; evicted undrained requests (counted)"
            )
        return trace

    def _forget(self, trace: RequestTrace) -> None:
        self.traces.pop(trace.req_id, None)
        self._buffered_rows -= trace.rows
        trace.rows = 0
        trace.pieces.clear()
        siblings = self._by_ext.get(trace.ext_id, [])
        if trace.req_id in siblings:
            siblings.remove(trace.req_id)
        if not siblings:
            self._by_ext.pop(trace.ext_id, None)

    def _room_for(self, rows: int) -> bool:
        while self._buffered_rows + rows > self.max_rows:
            finished = next((t for t in self.traces.values() if t.finished and t.rows), None)
            if finished is None:
                self._log_once(
                    "rows", "isoaudit vllm collector: fingerprint buffer full; dropping rows (counted)"
                )
                return False
            self._forget(finished)
            self.counters.evicted_requests += 1
        return True

    def _live(self, trace: RequestTrace) -> bool:
        return self.traces.get(trace.req_id) is trace

    def flush(self) -> None:
        """Fingerprint every step kept since the last flush, in one pass per (dtype, width) group with
        one device-to-host transfer, and file the results under each request."""
        steps, self._unprinted, self._unprinted_bytes = self._unprinted, [], 0
        steps = [s for s in steps if any(self._live(m.trace) for m in s.members)]
        if not steps:
            return
        # Chunks to fingerprint, grouped by (dtype, width, logits?): (step, tensor, [(region, row offset)]).
        groups: dict[
            tuple[torch.dtype, int, bool], list[tuple[int, torch.Tensor, list[tuple[int, int]]]]
        ] = {}
        for k, step in enumerate(steps):
            if step.stage is not None and step.filled:
                n = step.selected_rows
                stage = step.stage.reshape(-1, step.stage.shape[-1])
                entries = [(region, self._slots[region] * n) for region in step.filled]
                groups.setdefault((stage.dtype, int(stage.shape[-1]), False), []).append((k, stage, entries))
            for region, rows in step.pending:
                key = (rows.dtype, int(rows.shape[-1]), self.specs[region].name == "logits")
                groups.setdefault(key, []).append((k, rows, [(region, 0)]))
        tensors: dict[str, torch.Tensor] = {}
        # per step: per group: (regions, row offsets in the group's concatenation)
        where: list[dict[int, tuple[list[int], list[int]]]] = [{} for _ in steps]
        bits: list[tuple[int, ...]] = []
        for g, items in enumerate(groups.values()):
            stacked = torch.cat([rows for _, rows, _ in items]) if len(items) > 1 else items[0][1]
            prints = self.fingerprinter(stacked)
            bits.append(prints.ladder_bits)
            tensors.update(device_tensors([prints], prefix=f"g{g}."))
            base = 0
            for k, rows, entries in items:
                regions, offsets = where[k].setdefault(g, ([], []))
                for region, offset in entries:
                    regions.append(region)
                    offsets.append(base + offset)
                base += int(rows.shape[0])
        for k, step in enumerate(steps):
            if step.positions is not None:
                tensors[f"pos{k}"] = step.positions
        host = to_host(tensors)  # the flush's one device-to-host transfer
        blocks = [host_rows(host, [bits[g]], prefix=f"g{g}.")[0] for g in range(len(groups))]
        logits_group = [key[2] for key in groups]
        self.counters.fingerprinted_forwards += len(steps)
        for k, step in enumerate(steps):
            filed = [
                (g, tuple(regions), np.asarray(offsets, dtype=np.int64))
                for g, (regions, offsets) in where[k].items()
            ]
            for member in step.members:
                if not self._live(member.trace):
                    continue
                positions = member.positions
                if positions is None:
                    positions = host[f"pos{k}"][member.first : member.first + member.count].astype(np.int64)
                for g, regions, offsets in filed:
                    logits = logits_group[g]
                    member.trace.pieces.append(
                        Piece(
                            blocks[g],
                            regions,
                            offsets,
                            member.row if logits else member.first,
                            1 if logits else member.count,
                            positions[-1:] if logits else positions,
                            member.decode,
                        )
                    )
                    self.counters.rows += (1 if logits else member.count) * len(regions)

    # ------------------------------------------------------------ driver side

    def drain(self, ext_ids: Iterable[str]) -> Drained:
        """Hand over (and forget) what the engine recorded for these requests, keyed by their
        external ids, with the worker's counters and the mode it runs."""
        try:
            self.flush()
        except Exception as exc:
            self._fail("flush", exc)
        out = {}
        missing: list[str] = []
        for ext in ext_ids:
            ids = self._by_ext.get(ext) or ([ext] if ext in self.traces else [])
            if not ids:
                missing.append(ext)
                continue
            trace = self.traces[ids[-1]]  # the latest request with that id
            try:
                out[ext], recomputed = payload(trace, [spec.name for spec in self.specs])
                self.counters.recomputed_rows += recomputed
            except Exception as exc:
                self._fail("payload", exc)
            self._forget(trace)
        return Drained(requests=out, missing=missing, counters=self.counters.as_dict(), mode=self.mode)

    # ------------------------------------------------------------ errors

    def _fail(self, where: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._warn.warn(
            f"fail:{where}",
            f"isoaudit vllm collector: {where} failed ({type(exc).__name__}: {exc}); counted, the engine goes on",
        )

    def _log_once(self, key: str, message: str) -> None:
        self._warn.warn(key, message)
