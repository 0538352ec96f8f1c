"""Fingerprints inside the engine: hooks on the vLLM model, rows mapped to (request, position).

One :class:`EngineCapture` lives in each worker. It wraps the model runner's ``execute_model`` (to
know a real step from a warm-up or dummy forward, and to see which requests finished), reads each
forward's layout (:mod:`collectors.vllm.rows`) in a pre-hook on the model, and in the region hooks
copies only the rows of the requests chosen for fingerprinting. Those copies wait, and are
fingerprinted many steps at a time (one :func:`~audit.fingerprints.fingerprint_rows` call per row
width, one device-to-host transfer) when they exceed ``flush_bytes`` or when the driver drains:
per-call overhead then hardly counts, and a GPU is not synchronised every step. The results are
filed under each request until the driver drains them.

It never raises into the engine: errors are counted and logged once. Its buffers are bounded
(requests and fingerprint rows); past a bound it evicts finished, never-drained requests first,
then drops new rows, counting both, so a collector that nobody drains cannot grow without limit.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from audit.fingerprints import RowFingerprints, fingerprint_rows
from collectors.regions import RegionSpec, Tap, read_tap
from collectors.transfer import to_host
from collectors.vllm.rows import ForwardRows, read_forward_rows
from collectors.vllm.selection import Selection

log = logging.getLogger(__name__)

#: Per-row fingerprint fields, as :class:`audit.records.RegionFingerprints` names them.
_FIELDS = ("digest", "ladder", "sketch", "l2", "maxabs")

#: vLLM makes request ids unique by appending "-" and 8 hex digits to the caller's id.
_SUFFIX = re.compile(r"^(?P<ext>.+)-[0-9a-f]{8}$")


def external_id(req_id: str) -> str:
    """The id the caller sees (``RequestOutput.request_id``) for vLLM's internal request id."""
    match = _SUFFIX.match(req_id)
    return match.group("ext") if match else req_id


@dataclass
class CaptureCounters:
    steps: int = 0
    forwards: int = 0
    fingerprinted_forwards: int = 0
    requests_seen: int = 0
    requests_selected: int = 0
    rows: int = 0
    dropped_rows: int = 0
    evicted_requests: int = 0
    recomputed_rows: int = 0
    unmappable: int = 0
    errors: int = 0


@dataclass
class _Block:
    """Host fingerprints of one flush's rows of one (dtype, width) group."""

    digest: np.ndarray  # uint64 [n]
    ladder: np.ndarray  # uint64 [n, rungs]
    sketch: np.ndarray  # float32 [n, 16]
    l2: np.ndarray
    maxabs: np.ndarray
    bits: tuple[int, ...]


@dataclass
class _Piece:
    """One request's rows of one forward within a :class:`_Block`: region ``regions[k]``'s rows are
    ``offsets[k] + start + arange(count)``."""

    block: _Block
    regions: tuple[int, ...]
    offsets: np.ndarray  # int64 [len(regions)]
    start: int
    count: int
    positions: np.ndarray  # int64 [count]
    decode: bool


@dataclass
class RequestTrace:
    """What the engine knows of one request until the driver drains it."""

    req_id: str
    ext_id: str
    prompt_len: int
    temperature: float
    top_k: int | None
    top_p: float | None
    selected: bool
    first_version: str | None
    last_version: str | None
    pieces: list[_Piece] = field(default_factory=list)
    rows: int = 0  # fingerprint rows reserved for this request (filed or still pending)
    finished: bool = False
    truncated: bool = False


@dataclass
class _Member:
    """A selected request in one forward: its rows ``[first, first + count)`` of the selection."""

    trace: RequestTrace
    index: int  # position in the batch (its logits row)
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
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)


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


def _selected_rows(output: Any, tap: Tap, index: torch.Tensor, rows: int, exact: bool) -> torch.Tensor | None:
    """The tap's tensor at the selected rows only, as a copy (vLLM's fused norms later overwrite
    the module outputs in place). Rows are selected *before* the tap's arithmetic: a decoder
    layer's hidden + residual is then added on a few rows, not on the whole batch; elementwise, the
    bits are the same. ``rows``: how many rows the output must have (at least, or ``exact``ly)."""

    def check(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.reshape(-1, tensor.shape[-1])
        if tensor.shape[0] < rows or (exact and tensor.shape[0] != rows):
            raise _Unmappable
        return tensor

    if tap is Tap.SUM:
        parts = [
            t
            for t in (output if isinstance(output, tuple | list) else (output,))
            if isinstance(t, torch.Tensor)
        ]
        if not parts:
            return None
        picked = [check(p) for p in parts[:2]]
        index = index.to(picked[0].device)
        return (
            picked[0].index_select(0, index) + picked[1].index_select(0, index)
            if len(picked) > 1
            else picked[0].index_select(0, index)
        )
    tensor = read_tap(output, Tap.FIRST)
    if tensor is None:
        return None
    tensor = check(tensor)
    selected = tensor.index_select(0, index.to(tensor.device))
    return selected.float() if tap is Tap.FP32 else selected


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
    ) -> None:
        if max_requests < 1 or max_rows < 0 or flush_bytes < 0:
            raise ValueError(
                f"max_requests/max_rows/flush_bytes: must be >= 1 / >= 0 / >= 0, got {max_requests}/{max_rows}/{flush_bytes}"
            )
        self.runner = runner
        self.model = model
        self.specs = list(specs)
        self.selection = selection
        self.refusal = refusal
        self.max_requests = max_requests
        self.max_rows = max_rows
        self.flush_bytes = flush_bytes
        self.fingerprinter = fingerprinter
        self.version: str | None = None
        self.counters = CaptureCounters()
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self._by_ext: dict[str, list[str]] = {}
        self._buffered_rows = 0
        self._ordinal = 0
        self._in_step = False
        self._fwd: _Forward | None = None
        self._unprinted: list[_Forward] = []
        self._unprinted_bytes = 0
        self._logged: set[str] = set()
        self._handles: list[RemovableHandle] = []
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
        if self.refusal is None:
            for i, spec in enumerate(self.specs):
                module = self.model.get_submodule(spec.module)
                self._handles.append(module.register_forward_hook(self._region_hook(i, spec)))

    def remove(self) -> None:
        """Remove every hook and restore ``execute_model``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
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

    def _begin_step(self, scheduler_output: Any) -> None:
        self._in_step = True
        self._fwd = None
        try:
            self.counters.steps += 1
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
        if fwd is None or not fwd.pending:
            return
        try:
            hidden = sum(1 for i, _ in fwd.pending if self.specs[i].name != "logits")
            logits = len(fwd.pending) - hidden
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
            self._unprinted_bytes += sum(t.numel() * t.element_size() for _, t in fwd.pending)
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
            layout = read_forward_rows(self.runner)
            members: list[_Member] = []
            first = 0
            for i, req_id in enumerate(layout.req_ids):
                trace = self.traces.get(req_id) or self._register(req_id)
                trace.last_version = self.version
                if trace.selected and self.refusal is None:
                    a, b = layout.rows(i)
                    decode = layout.case(i, trace.prompt_len) == "engine_decode"
                    members.append(_Member(trace, i, first, b - a, decode, None))
                    first += b - a
            if not members or not self.specs:
                self._fwd = _Forward(layout, [], None, None, None)
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
                    rows = _selected_rows(output, spec.tap, fwd.logits_index, len(fwd.layout.req_ids), True)  # type: ignore[arg-type]
                else:
                    rows = _selected_rows(output, spec.tap, fwd.index, fwd.layout.num_tokens, False)  # type: ignore[arg-type]
                if rows is not None:
                    fwd.pending.append((i, rows))
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
        groups: dict[tuple[torch.dtype, int, bool], list[tuple[int, int, torch.Tensor]]] = {}
        for k, step in enumerate(steps):
            for region, rows in step.pending:
                key = (rows.dtype, int(rows.shape[-1]), self.specs[region].name == "logits")
                groups.setdefault(key, []).append((k, region, rows))
        tensors: dict[str, torch.Tensor] = {}
        # per step: per group: (regions, offsets)
        where: list[dict[int, tuple[list[int], list[int]]]] = [{} for _ in steps]
        bits: list[tuple[int, ...]] = []
        for g, items in enumerate(groups.values()):
            stacked = torch.cat([rows for _, _, rows in items]) if len(items) > 1 else items[0][2]
            prints = self.fingerprinter(stacked)
            bits.append(prints.ladder_bits)
            tensors.update(
                {
                    f"{g}.d": prints.digest,
                    f"{g}.l": prints.ladder,
                    f"{g}.s": prints.sketch,
                    f"{g}.n": prints.l2,
                    f"{g}.m": prints.maxabs,
                }
            )
            offset = 0
            for k, region, rows in items:
                regions, offsets = where[k].setdefault(g, ([], []))
                regions.append(region)
                offsets.append(offset)
                offset += int(rows.shape[0])
        for k, step in enumerate(steps):
            if step.positions is not None:
                tensors[f"pos{k}"] = step.positions
        host = to_host(tensors)
        blocks = [
            _Block(
                host[f"{g}.d"].view(np.uint64),
                host[f"{g}.l"].view(np.uint64),
                host[f"{g}.s"],
                host[f"{g}.n"],
                host[f"{g}.m"],
                bits[g],
            )
            for g in range(len(groups))
        ]
        logits_group = [key[2] for key in groups]
        self.counters.fingerprinted_forwards += len(steps)
        for k, step in enumerate(steps):
            for j, member in enumerate(step.members):
                if not self._live(member.trace):
                    continue
                positions = member.positions
                if positions is None:
                    positions = host[f"pos{k}"][member.first : member.first + member.count].astype(np.int64)
                for g, (regions, offsets) in where[k].items():
                    logits = logits_group[g]
                    member.trace.pieces.append(
                        _Piece(
                            blocks[g],
                            tuple(regions),
                            np.asarray(offsets, dtype=np.int64),
                            j if logits else member.first,
                            1 if logits else member.count,
                            positions[-1:] if logits else positions,
                            member.decode,
                        )
                    )
                    self.counters.rows += (1 if logits else member.count) * len(regions)

    # ------------------------------------------------------------ driver side

    def drain(self, ext_ids: Iterable[str]) -> dict[str, Any]:
        """Hand over (and forget) what the engine recorded for these requests, keyed by their
        external ids; the payload is plain data (bytes, numbers, strings) for ``collective_rpc``."""
        try:
            self.flush()
        except Exception as exc:
            self._fail("flush", exc)
        out: dict[str, Any] = {}
        missing: list[str] = []
        for ext in ext_ids:
            ids = self._by_ext.get(ext) or ([ext] if ext in self.traces else [])
            if not ids:
                missing.append(ext)
                continue
            trace = self.traces[ids[-1]]  # the latest request with that id
            try:
                out[ext] = self._payload(trace)
            except Exception as exc:
                self._fail("payload", exc)
            self._forget(trace)
        return {"requests": out, "missing": missing, "counters": asdict(self.counters)}

    def _payload(self, trace: RequestTrace) -> dict[str, Any]:
        # Gather each (block, regions) group of pieces with one fancy index per field.
        grouped: dict[tuple[int, tuple[int, ...]], list[_Piece]] = {}
        for piece in trace.pieces:
            grouped.setdefault((id(piece.block), piece.regions), []).append(piece)
        per_region: dict[
            int, list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], tuple[int, ...]]]
        ] = {}
        for pieces in grouped.values():
            block, regions = pieces[0].block, pieces[0].regions
            rows = np.concatenate(
                [
                    p.offsets[:, None] + (p.start + np.arange(p.count, dtype=np.int64))[None, :]
                    for p in pieces
                ],
                axis=1,
            )  # [regions, total]
            positions = np.concatenate([p.positions for p in pieces])
            decode = np.concatenate([np.full(p.count, p.decode) for p in pieces])
            arrays = {name: getattr(block, name)[rows] for name in _FIELDS}
            for k, region in enumerate(regions):
                per_region.setdefault(region, []).append(
                    (positions, decode, {name: a[k] for name, a in arrays.items()}, block.bits)
                )
        prints = []
        for region, parts in per_region.items():
            positions = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            decode = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            arrays = {
                name: np.concatenate([p[2][name] for p in parts]) if len(parts) > 1 else parts[0][2][name]
                for name in _FIELDS
            }
            # A preempted request recomputes positions it already had: keep the latest computation
            # of each (np.unique over the reversed order finds last occurrences, sorted by position).
            _, first_in_reversed = np.unique(positions[::-1], return_index=True)
            keep = positions.size - 1 - first_in_reversed
            self.counters.recomputed_rows += int(positions.size - keep.size)
            for case_decode in (False, True):
                rows = keep[decode[keep] == case_decode]
                if rows.size == 0:
                    continue
                prints.append(
                    {
                        "region": self.specs[region].name,
                        "case": "engine_decode" if case_decode else "engine_prefill",
                        "ladder_bits": [int(b) for b in parts[0][3]],
                        "positions": positions[rows].astype("<i4").tobytes(),
                        **{name: np.ascontiguousarray(arrays[name][rows]).tobytes() for name in _FIELDS},
                    }
                )
        return {
            "req_id": trace.req_id,
            "prompt_len": trace.prompt_len,
            "temperature": trace.temperature,
            "top_k": trace.top_k,
            "top_p": trace.top_p,
            "selected": trace.selected,
            "truncated": trace.truncated,
            "first_version": trace.first_version,
            "last_version": trace.last_version,
            "prints": prints,
        }

    # ------------------------------------------------------------ errors

    def _fail(self, where: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._log_once(
            f"fail:{where}",
            f"isoaudit vllm collector: {where} failed ({type(exc).__name__}: {exc}); counted, the engine goes on",
        )

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s", message)
