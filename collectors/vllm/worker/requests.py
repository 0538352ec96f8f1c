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
    """One request's rows of one forward within a block: region ``regions[k]``'s rows are
    ``offsets[k] + start + arange(count)``."""

    block: HostRows
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
    pieces: list[Piece] = field(default_factory=list)
    rows: int = 0  # fingerprint rows reserved for this request (filed or still pending)
    finished: bool = False
    truncated: bool = False


def payload(trace: RequestTrace, region_names: Sequence[str]) -> tuple[RequestRecord, int]:
    """One request's record for the driver, and how many recomputed rows it dropped: per region and
    case, positions sorted, arrays as little-endian bytes; each piece group gathered with one fancy
    index per field."""
    recomputed = 0
    # Gather each (block, regions) group of pieces with one fancy index per field.
    grouped: dict[tuple[int, tuple[int, ...]], list[Piece]] = {}
    for piece in trace.pieces:
        grouped.setdefault((id(piece.block), piece.regions), []).append(piece)
    per_region: dict[int, list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], tuple[int, ...]]]] = {}
    for pieces in grouped.values():
        block, regions = pieces[0].block, pieces[0].regions
        rows = np.concatenate(
            [p.offsets[:, None] + (p.start + np.arange(p.count, dtype=np.int64))[None, :] for p in pieces],
            axis=1,
        )  # [regions, total]
        positions = np.concatenate([p.positions for p in pieces])
        decode = np.concatenate([np.full(p.count, p.decode) for p in pieces])
        arrays = {name: getattr(block, name)[rows] for name in ROW_FIELDS}
        for k, region in enumerate(regions):
            per_region.setdefault(region, []).append(
                (positions, decode, {name: a[k] for name, a in arrays.items()}, block.ladder_bits)
            )
    prints = []
    for region, parts in per_region.items():
        positions = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        decode = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        arrays = {
            name: np.concatenate([p[2][name] for p in parts]) if len(parts) > 1 else parts[0][2][name]
            for name in ROW_FIELDS
        }
        # A preempted request recomputes positions it already had: keep the latest computation
        # of each (np.unique over the reversed order finds last occurrences, sorted by position).
        _, first_in_reversed = np.unique(positions[::-1], return_index=True)
        keep = positions.size - 1 - first_in_reversed
        recomputed += int(positions.size - keep.size)
        for case_decode in (False, True):
            rows = keep[decode[keep] == case_decode]
            if rows.size == 0:
                continue
            prints.append(
                RegionPrints(
                    region=region_names[region],
                    case="engine_decode" if case_decode else "engine_prefill",
                    ladder_bits=[int(b) for b in parts[0][3]],
                    positions=positions[rows].astype("<i4").tobytes(),
                    **{name: np.ascontiguousarray(arrays[name][rows]).tobytes() for name in ROW_FIELDS},
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
        # A forward files a piece per row-width group, logits holding only its last row: so count
        # distinct last positions.
        prefill_forwards=len({int(p.positions[-1]) for p in trace.pieces if not p.decode and p.count})
        if trace.selected
        else None,
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
        siblings = self._by_ext.get(trace.ext_id, [])
        if trace.req_id in siblings:
            siblings.remove(trace.req_id)
        if not siblings:
            self._by_ext.pop(trace.ext_id, None)
