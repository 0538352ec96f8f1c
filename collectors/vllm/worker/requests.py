"""The request book: what the engine keeps of each request until the driver drains it, and the
message it is handed over in (:class:`isoaudit.collectors.vllm.messages.RequestRecord`).

:class:`RequestBook` registers each request the first time the engine schedules it (deciding then
whether it is fingerprinted), keeps its facts and filed fingerprint pieces, and bounds both: past
``max_requests`` requests or ``max_rows`` fingerprint rows it evicts finished, never-drained
requests first, counting every eviction, so a collector nobody drains cannot grow without limit.

Fingerprints are filed in blocks (:class:`~isoaudit.collectors.fingerprints.HostRows`: one batched
fingerprint pass over many steps, on the host) and a request points into them with pieces
(:class:`Piece`), so filing costs one small object per request and step; :func:`payload` gathers a
request's rows with one fancy index per field when it is drained.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from isoaudit.audit.fingerprints import ROW_FIELDS
from isoaudit.collectors.counting import Counters, LogOnce
from isoaudit.collectors.fingerprints import HostRows
from isoaudit.collectors.vllm.messages import CANARY_REQUEST_PREFIX, RegionPrints, RequestRecord, Selection

#: vLLM makes request ids unique by appending "-" and 8 hex digits to the caller's id.
_SUFFIX = re.compile(r"^(?P<ext>.+)-[0-9a-f]{8}$")


def external_id(req_id: str) -> str:
    """The id the caller sees (``RequestOutput.request_id``) for vLLM's internal request id."""
    match = _SUFFIX.match(req_id)
    return match.group("ext") if match else req_id


@dataclass
class Piece:
    """One request's rows in one block for one set of regions, over the forwards of one flush:
    per row ``j`` (in forward order) region ``regions[k]``'s row of the block is
    ``starts[j] + mults[k] * strides[j]``, at position ``positions[j]``, decoded or not. Filed a
    forward at a time into lists (:meth:`add`), gathered when the request is drained."""

    block: HostRows
    regions: tuple[int, ...]
    mults: np.ndarray  # int64 [len(regions)]
    starts: list[int] = field(default_factory=list)
    strides: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    decode: list[bool] = field(default_factory=list)

    def add(self, start: int, stride: int, positions: list[int], decode: bool) -> None:
        """One forward's rows: ``len(positions)`` rows from ``start``."""
        count = len(positions)
        if count == 1:
            self.starts.append(start)
            self.strides.append(stride)
            self.decode.append(decode)
        else:
            self.starts.extend(range(start, start + count))
            self.strides.extend([stride] * count)
            self.decode.extend([decode] * count)
        self.positions.extend(positions)


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
    pieces: dict[tuple[int, int], Piece] = field(default_factory=dict)  # by block and rows filed
    prefill_positions: set[int] = field(default_factory=set)  # last position of each prefill forward
    rows: int = 0  # fingerprint rows reserved for this request (filed or still pending)
    finished: bool = False
    truncated: bool = False


def payload(trace: RequestTrace, region_names: Sequence[str]) -> tuple[RequestRecord, int]:
    """One request's record for the driver, and how many recomputed rows it dropped: per region and
    case, positions sorted, arrays as little-endian bytes; each piece gathered with one fancy index
    per field, and the positions of the regions that share their pieces sorted once."""
    recomputed = 0
    # per region: its parts (positions, decode, one row of the piece's gathered arrays), by piece
    per_region: dict[int, list[tuple[int, dict[str, np.ndarray], int]]] = {}
    gathered: list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], tuple[int, ...]]] = []
    for g, piece in enumerate(trace.pieces.values()):
        block = piece.block
        starts = np.asarray(piece.starts, dtype=np.int64)
        strides = np.asarray(piece.strides, dtype=np.int64)
        rows = starts[None, :] + piece.mults[:, None] * strides[None, :]  # [regions, rows]
        arrays = {name: getattr(block, name)[rows] for name in ROW_FIELDS}
        positions = np.asarray(piece.positions, dtype=np.int64)
        gathered.append((positions, np.asarray(piece.decode, dtype=bool), arrays, block.ladder_bits))
        for k, region in enumerate(piece.regions):
            per_region.setdefault(region, []).append((g, arrays, k))
    # Regions with the same pieces share their positions: their order, cases and recomputed rows once.
    orders: dict[tuple[int, ...], tuple[list[tuple[bool, np.ndarray]], np.ndarray, int]] = {}
    prints = []
    for region, parts in per_region.items():
        key = tuple(g for g, _, _ in parts)
        if key not in orders:
            positions = np.concatenate([gathered[g][0] for g in key]) if len(key) > 1 else gathered[key[0]][0]
            decode = np.concatenate([gathered[g][1] for g in key]) if len(key) > 1 else gathered[key[0]][1]
            # A preempted request recomputes positions it already had: keep the latest computation
            # of each (np.unique over the reversed order finds last occurrences, sorted by position).
            _, first_in_reversed = np.unique(positions[::-1], return_index=True)
            keep = positions.size - 1 - first_in_reversed
            cases = [(d, keep[decode[keep] == d]) for d in (False, True)]
            orders[key] = (
                [(d, rows) for d, rows in cases if rows.size],
                positions,
                positions.size - keep.size,
            )
        cases, positions, dropped = orders[key]
        recomputed += dropped
        arrays = {
            name: np.concatenate([a[name][k] for _, a, k in parts])
            if len(parts) > 1
            else parts[0][1][name][parts[0][2]]
            for name in ROW_FIELDS
        }
        bits = [int(b) for b in gathered[key[0]][3]]
        for case_decode, rows in cases:
            prints.append(
                RegionPrints(
                    region=region_names[region],
                    case="engine_decode" if case_decode else "engine_prefill",
                    ladder_bits=bits,
                    positions=positions[rows].astype("<i4").tobytes(),
                    **{name: arrays[name][rows].tobytes() for name in ROW_FIELDS},
                )
            )
    body = RequestRecord(
        req_id=trace.req_id,
        prompt_len=trace.prompt_len,
        temperature=trace.temperature,
        top_k=trace.top_k,
        top_p=trace.top_p,
        selected=trace.selected,
        truncated=trace.truncated,
        prefill_forwards=len(trace.prefill_positions) if trace.selected else None,
        first_version=trace.first_version,
        last_version=trace.last_version,
        prints=prints,
    )
    return body, recomputed


def _sampling(params: Any) -> tuple[float, int | None, float | None]:
    """(temperature, top-k, top-p) of vLLM's ``SamplingParams`` (``None``: not applied)."""
    if params is None:
        return 1.0, None, None
    temperature = float(getattr(params, "temperature", 1.0) or 0.0)
    top_k = getattr(params, "top_k", None)
    top_k = int(top_k) if top_k is not None and int(top_k) > 0 else None
    top_p = getattr(params, "top_p", None)
    top_p = float(top_p) if top_p is not None else None
    return temperature, top_k, top_p


class RequestBook:
    """Every request the worker has seen and not yet handed over, by engine id and by external id.

    ``counters`` (``requests_seen``, ``requests_selected``, ``evicted_requests``) and ``warn`` are
    the capture's own, so one worker reports one set of counters."""

    def __init__(self, *, max_requests: int, max_rows: int, counters: Counters, warn: LogOnce) -> None:
        self.max_requests = max_requests
        self.max_rows = max_rows
        self.counters = counters
        self._warn = warn
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self._by_ext: dict[str, list[str]] = {}
        self._ordinal = 0
        self._buffered_rows = 0
        self.forgotten = 0  # requests dropped so far: what a cached view of the book checks

    def register(self, req_id: str, state: Any, selection: Selection, version: str | None) -> RequestTrace:
        """File a request the engine schedules for the first time (``state``: the runner's
        ``CachedRequestState``); ``selection`` decides now, once, whether it is fingerprinted."""
        prompt = getattr(state, "prompt_token_ids", None)
        prompt_len = len(prompt) if prompt is not None else int(getattr(state, "num_prompt_tokens", 0) or 0)
        temperature, top_k, top_p = _sampling(getattr(state, "sampling_params", None))
        ext = external_id(req_id)
        if ext.startswith(CANARY_REQUEST_PREFIX):  # the collector's own canary: never a sample
            selected = False  # and not counted in "one in N", so the job's choice stays its own
        else:
            selected = selection.chooses(self._ordinal, ext)
            self._ordinal += 1
        trace = RequestTrace(req_id, ext, prompt_len, temperature, top_k, top_p, selected, version, version)
        self.traces[req_id] = trace
        self._by_ext.setdefault(ext, []).append(req_id)
        self.counters.requests_seen += 1
        self.counters.requests_selected += int(selected)
        while len(self.traces) > self.max_requests:
            victim = next((t for t in self.traces.values() if t.finished), None) or next(
                iter(self.traces.values())
            )
            self.forget(victim)
            self.counters.evicted_requests += 1
            self._warn.warn(
                "evict", "isoaudit vllm collector: request buffer full; evicted undrained requests (counted)"
            )
        return trace

    def finished(self, req_ids: Iterable[str]) -> None:
        """Mark these engine requests finished (first in line for eviction)."""
        for req_id in req_ids:
            trace = self.traces.get(req_id)
            if trace is not None:
                trace.finished = True

    def keeps_selected(self) -> bool:
        """Is some selected request still running (it keeps its choice whatever the selection now)?"""
        return any(t.selected and not t.finished for t in self.traces.values())

    def reserve(self, trace: RequestTrace, rows: int) -> bool:
        """Reserve ``rows`` fingerprint rows for ``trace``, evicting finished requests to make room;
        ``False`` (and a warning, once): there is none, the rows are to be dropped."""
        while self._buffered_rows + rows > self.max_rows:
            finished = next((t for t in self.traces.values() if t.finished and t.rows), None)
            if finished is None:
                self._warn.warn(
                    "rows", "isoaudit vllm collector: fingerprint buffer full; dropping rows (counted)"
                )
                return False
            self.forget(finished)
            self.counters.evicted_requests += 1
        trace.rows += rows
        self._buffered_rows += rows
        return True

    def live(self, trace: RequestTrace) -> bool:
        """Is ``trace`` still in the book (neither drained nor evicted)?"""
        return self.traces.get(trace.req_id) is trace

    def latest(self, ext_id: str) -> RequestTrace | None:
        """The latest request with this external id (or engine id), if any."""
        ids = self._by_ext.get(ext_id) or ([ext_id] if ext_id in self.traces else [])
        return self.traces[ids[-1]] if ids else None

    def forget(self, trace: RequestTrace) -> None:
        """Drop a request and release its rows."""
        self.forgotten += 1
        self.traces.pop(trace.req_id, None)
        self._buffered_rows -= trace.rows
        trace.rows = 0
        trace.pieces.clear()
        trace.prefill_positions.clear()
        siblings = self._by_ext.get(trace.ext_id, [])
        if trace.req_id in siblings:
            siblings.remove(trace.req_id)
        if not siblings:
            self._by_ext.pop(trace.ext_id, None)
