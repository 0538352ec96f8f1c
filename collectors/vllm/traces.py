"""What the engine keeps of each request until the driver drains it, and the message it is handed
over in (:class:`collectors.vllm.messages.RequestRecord`).

Fingerprints are filed in blocks (:class:`~collectors.fingerprints.HostRows`: one batched
fingerprint pass over many steps, on the host) and a request points into them with pieces
(:class:`Piece`), so filing costs one small object per request and step; :func:`payload` gathers a
request's rows with one fancy index per field when it is drained.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from isoaudit.audit.fingerprints import ROW_FIELDS
from isoaudit.collectors.fingerprints import HostRows
from isoaudit.collectors.vllm.messages import RegionPrints, RequestRecord

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
