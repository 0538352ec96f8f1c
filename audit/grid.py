"""The region x position grid of one sample: where the two sides' fingerprints agree.

A cell is EQUAL when the two sides' row digests match, DIFFERS when they do not, and NOT_OBSERVED
when either side has no row there: an unobserved cell is never reported as equal. An *origin* is a
differing cell whose inputs all agree (the previous observed region agrees at every position up to
and including its own, since attention reads earlier positions); the *first divergence* is the
earliest origin in forward order.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from isoaudit.audit.fingerprints import estimate_relative_l2, first_agreeing_rung
from isoaudit.audit.records import RegionFingerprints
from isoaudit.audit.regions import region_key, region_order

NOT_OBSERVED, EQUAL, DIFFERS = -1, 0, 1

Cell = tuple[str, int]


@dataclass
class _SideRows:
    """One side's rows of one region, sorted by position (prefill and decode records merged)."""

    positions: np.ndarray
    digest: np.ndarray
    ladder: np.ndarray
    ladder_bits: list[int]
    sketch: np.ndarray
    l2: np.ndarray

    @classmethod
    def merge(cls, records: Sequence[RegionFingerprints]) -> _SideRows:
        if len(records) == 1 and _ascending(records[0].positions):  # the usual case: the arrays as they are
            (r,) = records
            n = r.positions.size
            return cls(
                positions=r.positions,
                digest=r.digest,
                ladder=r.ladder.reshape(n, -1) if r.ladder_bits else np.zeros((n, 0), np.uint64),
                ladder_bits=list(r.ladder_bits),
                sketch=r.sketch.reshape(n, -1),
                l2=r.l2,
            )
        positions = np.concatenate([r.positions for r in records])
        # One record with ascending positions (the usual case) needs no reordering.
        order = (
            slice(None) if np.all(positions[1:] > positions[:-1]) else np.argsort(positions, kind="stable")
        )
        rungs = max((len(r.ladder_bits) for r in records), default=0)
        return cls(
            positions=positions[order],
            digest=np.concatenate([r.digest for r in records])[order],
            ladder=np.concatenate([r.ladder.reshape(r.positions.size, -1) for r in records])[order]
            if rungs
            else np.zeros((positions.size, 0), np.uint64),
            ladder_bits=list(records[0].ladder_bits),
            sketch=np.concatenate([r.sketch.reshape(r.positions.size, -1) for r in records])[order],
            l2=np.concatenate([r.l2 for r in records])[order],
        )


def _ascending(positions: np.ndarray) -> bool:
    return bool(np.all(positions[1:] > positions[:-1]))


@dataclass
class RegionGrid:
    """Region x position verdicts for one sample. ``state`` is int8 [regions, positions]."""

    regions: list[str]
    positions: np.ndarray
    state: np.ndarray
    rel_l2: np.ndarray
    agreeing_bits: np.ndarray
    origins: list[Cell] = field(default_factory=list)

    @property
    def first_divergence(self) -> Cell | None:
        return self.origins[0] if self.origins else None

    def has_differences(self) -> bool:
        return bool((self.state == DIFFERS).any())

    def differing_cells(self) -> list[Cell]:
        rows, cols = np.nonzero(self.state == DIFFERS)
        return [(self.regions[r], int(self.positions[c])) for r, c in zip(rows, cols, strict=True)]

    def not_observed_regions(self) -> list[str]:
        """Regions with no position observed on both sides."""
        return [
            name for name, row in zip(self.regions, self.state, strict=True) if (row == NOT_OBSERVED).all()
        ]

    def has_unobserved(self) -> bool:
        return bool((self.state == NOT_OBSERVED).any())

    def to_json(self) -> dict[str, Any]:
        """Compact form for the store and the dashboard: matrices as base64 (int8 / float32 / int8)."""

        def b64(array: np.ndarray) -> str:
            return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")

        return {
            "regions": self.regions,
            "positions": self.positions.tolist(),
            "state": b64(self.state.astype(np.int8)),
            "rel_l2": b64(self.rel_l2.astype("<f4")),
            "agreeing_bits": b64(self.agreeing_bits.astype(np.int8)),
            "origins": [list(cell) for cell in self.origins],
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RegionGrid:
        shape = (len(body["regions"]), len(body["positions"]))

        def unb64(text: str, dtype: str) -> np.ndarray:
            return np.frombuffer(base64.b64decode(text), dtype=dtype).reshape(shape)

        return cls(
            regions=list(body["regions"]),
            positions=np.asarray(body["positions"], dtype=np.int32),
            state=unb64(body["state"], "i1"),
            rel_l2=unb64(body["rel_l2"], "<f4"),
            agreeing_bits=unb64(body["agreeing_bits"], "i1"),
            origins=[(str(r), int(p)) for r, p in body["origins"]],
        )


def _group(records: Sequence[RegionFingerprints]) -> dict[tuple[str, int], list[RegionFingerprints]]:
    grouped: dict[tuple[str, int], list[RegionFingerprints]] = defaultdict(list)
    for record in records:
        grouped[(record.region, record.forward_index)].append(record)
    return grouped


def compare_fingerprints(
    trainer: Sequence[RegionFingerprints], rollout: Sequence[RegionFingerprints]
) -> RegionGrid | None:
    """The region x position grid of one sample, or ``None`` when neither side sent fingerprints."""
    if not trainer and not rollout:
        return None
    by_side = (_group(trainer), _group(rollout))
    keys = sorted(set(by_side[0]) | set(by_side[1]), key=lambda k: (region_order(k[0]), k[1]))
    merged = [tuple(_SideRows.merge(side[key]) if key in side else None for side in by_side) for key in keys]
    observed = [rows.positions for pair in merged for rows in pair if rows is not None]
    if observed and all(np.array_equal(p, observed[0]) for p in observed[1:]):
        positions = observed[0].astype(np.int32)  # every row at the same positions (ascending, unique)
    else:
        positions = np.unique(np.concatenate(observed or [np.zeros(0)])).astype(np.int32)
    shape = (len(keys), positions.size)
    state = np.full(shape, NOT_OBSERVED, np.int8)
    rel_l2 = np.full(shape, np.nan, np.float32)
    agreeing_bits = np.full(shape, -1, np.int8)
    for r, (a, b) in enumerate(merged):
        if a is None or b is None:
            continue
        ia: slice | np.ndarray
        ib: slice | np.ndarray
        if np.array_equal(a.positions, b.positions):  # both sides observed the same positions
            common = a.positions
            ia = ib = slice(None)
        else:
            common, ia, ib = np.intersect1d(a.positions, b.positions, assume_unique=True, return_indices=True)
        # a row at every position of the grid takes a slice, not an index
        cols: slice | np.ndarray = (
            slice(None) if np.array_equal(common, positions) else np.searchsorted(positions, common)
        )
        equal = a.digest[ia] == b.digest[ib]
        state[r, cols] = np.where(equal, EQUAL, DIFFERS)
        rel_l2[r, cols] = np.where(equal, np.float32(0.0), rel_l2[r, cols])
        differ = np.flatnonzero(~equal)
        if differ.size:
            dcols = differ if isinstance(cols, slice) else cols[differ]
            da = differ if isinstance(ia, slice) else ia[differ]
            db = differ if isinstance(ib, slice) else ib[differ]
            rel_l2[r, dcols] = estimate_relative_l2(a.sketch[da], b.sketch[db], a.l2[da], b.l2[db])
            if a.ladder_bits == b.ladder_bits and a.ladder.shape[1]:
                rung = first_agreeing_rung(a.ladder[da], b.ladder[db])
                bits = np.asarray(a.ladder_bits, dtype=np.int64)
                agreeing_bits[r, dcols] = np.where(rung >= 0, bits[np.maximum(rung, 0)], -1)
    grid = RegionGrid([region_key(*k) for k in keys], positions, state, rel_l2, agreeing_bits)
    grid.origins = _origins(state, grid.regions, positions)
    return grid


def _origins(state: np.ndarray, regions: list[str], positions: np.ndarray) -> list[Cell]:
    """Differing cells whose inputs agree, in forward order (region, then position)."""
    found: list[Cell] = []
    previous_ok: np.ndarray | None = (
        None  # per position: previous observed region equal at every position <= t
    )
    for r in range(state.shape[0]):
        row = state[r]
        if previous_ok is None:
            # The first region reads only the tokens, which both sides share by construction of the key.
            inputs_agree = np.ones(row.shape, bool)
        else:
            inputs_agree = previous_ok
        region = regions[r]
        found.extend((region, p) for p in positions[(row == DIFFERS) & inputs_agree].tolist())
        if (row != NOT_OBSERVED).any():
            # A region observed nowhere says nothing: keep judging inputs by the last one that was.
            previous_ok = np.logical_and.accumulate(row == EQUAL)
    return found
