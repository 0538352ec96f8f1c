"""From host arrays of one forward to wire records: one SampleLogprobs per sample and one
RegionFingerprints per (sample, region), each with the sample's absolute positions, or one
RegionFingerprintsBlock per region with every sample's rows.

Shared by both collectors: whatever the engine, a collector ends up with flat per-row arrays and a
layout (:class:`isoaudit.collectors.layout.StepBatch`), and this module cuts them per sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from isoaudit.audit.records import (
    Case,
    LogprobSemantics,
    RegionFingerprints,
    RegionFingerprintsBlock,
    SampleLogprobs,
    Side,
    sample_key,
)
from isoaudit.collectors.construct import constructor
from isoaudit.collectors.fingerprints import HostFields, HostRows, PackedHostPrints, host_groups
from isoaudit.collectors.layout import StepBatch


def sequence_tokens(batch: StepBatch, host_ids: np.ndarray) -> list[np.ndarray]:
    """Each sample's whole sequence (prompt ‖ completion) as int32."""
    flat = host_ids.reshape(-1)
    return [
        flat[batch.flat_start(i) : batch.flat_start(i) + span.length].astype(np.int32)
        for i, span in enumerate(batch.spans)
    ]


def keys_for(batch: StepBatch, tokens: Sequence[np.ndarray]) -> list[str]:
    """The caller's sample keys, or the ones both sides derive from the tokens."""
    return list(batch.sample_keys) if batch.sample_keys is not None else [sample_key(t) for t in tokens]


def sample_records(
    *,
    run_id: str,
    step: int,
    side: Side,
    batch: StepBatch,
    tokens: Sequence[np.ndarray],
    keys: Sequence[str],
    logprobs: Sequence[np.ndarray],
    weight_version: str | None = None,
    semantics: LogprobSemantics = "processed",
    validate: bool = True,
) -> list[SampleLogprobs]:
    """One record per sample; ``validate=False`` skips pydantic checks (inputs built here are valid
    by construction and the store validates again)."""
    temps = batch.temperature if batch.temperature is not None else np.ones(batch.num_samples)
    build = constructor(SampleLogprobs, _SAMPLE_NAMES)
    records = []
    for i, span in enumerate(batch.spans):
        lp = np.asarray(logprobs[i], dtype=np.float32)
        if lp.size != span.completion_len:
            raise ValueError(
                f"logprobs: sample {i} has {lp.size} values for {span.completion_len} completion tokens"
            )
        # A log-softmax can round to a hair above 0 for a near-certain token; the wire format refuses > 0.
        lp = np.minimum(lp, np.float32(0.0))
        fields: dict[str, Any] = {
            "run_id": run_id,
            "step": step,
            "side": side,
            "sample_key": keys[i],
            "weight_version": weight_version,
            "prompt_len": span.prompt_len,
            "token_ids": tokens[i],
            "logprobs": lp,
            "temperature": float(temps[i]),
            "semantics": semantics,
            "advantage": float(batch.advantages[i]) if batch.advantages is not None else None,
        }
        records.append(SampleLogprobs(**fields) if validate else build(fields))
    return records


_SAMPLE_NAMES = frozenset(
    ("run_id", "step", "side", "sample_key", "weight_version", "prompt_len", "token_ids", "logprobs")
    + ("temperature", "semantics", "advantage")
)
_BLOCK_NAMES = frozenset(
    ("run_id", "step", "side", "case", "sample_keys", "lengths", "positions", "region", "forward_index")
    + ("digest", "ladder_bits", "ladder", "sketch", "l2", "maxabs")
)
_PRINT_NAMES = frozenset(
    ("run_id", "step", "side", "case", "sample_key", "region", "forward_index", "positions", "digest")
    + ("ladder_bits", "ladder", "sketch", "l2", "maxabs")
)


def fingerprint_records(
    *,
    run_id: str,
    step: int,
    side: Side,
    case: Case,
    batch: StepBatch,
    keys: Sequence[str],
    prints: Mapping[tuple[str, int], HostRows],
    validate: bool = True,
) -> list[RegionFingerprints]:
    """One record per (sample, region call), rows cut from the forward's flattened rows."""
    rows, cols = batch.shape
    lengths = [span.length for span in batch.spans]
    positions = [np.arange(length, dtype=np.int32) for length in lengths]
    cuts: dict[int, list[slice]] = {}  # per distinct row_index (all regions of a forward share one)
    build = constructor(RegionFingerprints, _PRINT_NAMES)
    shared = {"run_id": run_id, "step": step, "side": side, "case": case}
    # a thousand records a step: each a copy of its region's fields with the sample's set, built
    # without pydantic's per-record default resolution (or validated, when asked); each field's
    # rows cut for every sample at once (a map over the samples' slices)
    common = None if validate else build.prefilled(shared)
    many: list[dict[str, Any]] = []
    append = many.append
    # one ladder_bits list per ladder for the whole step, shared by its records (records are read,
    # never modified): a list per record would be a thousand more objects for the collector to track
    bit_lists: dict[tuple[int, ...], list[int]] = {}
    for (region, forward_index), host in prints.items():
        expected = rows * cols if host.row_index is None else host.row_index.size
        if len(host) != expected:
            raise ValueError(
                f"prints[{region!r}]: {len(host)} rows where the forward fingerprinted {expected}"
            )
        key = id(host.row_index)
        cut = cuts.get(key)
        if cut is None:
            cut = cuts[key] = []
            for i, span in enumerate(batch.spans):
                a = _first_row(host.row_index, batch.flat_start(i), span.length, region)
                cut.append(slice(a, a + span.length))
        bits = bit_lists.get(host.ladder_bits)
        if bits is None:
            bits = bit_lists[host.ladder_bits] = list(host.ladder_bits)
        base = {**(shared if common is None else common), "region": region, "forward_index": forward_index}
        for key_of_sample, sample_positions, digest, ladder, sketch, l2, maxabs in zip(
            keys,
            positions,
            map(host.digest.__getitem__, cut),
            map(host.ladder.__getitem__, cut),
            map(host.sketch.__getitem__, cut),
            map(host.l2.__getitem__, cut),
            map(host.maxabs.__getitem__, cut),
            strict=True,
        ):
            fields = base.copy()
            fields["sample_key"] = key_of_sample
            fields["positions"] = sample_positions
            fields["digest"] = digest
            fields["ladder_bits"] = bits
            fields["ladder"] = ladder
            fields["sketch"] = sketch
            fields["l2"] = l2
            fields["maxabs"] = maxabs
            append(fields)
    if validate:
        return [RegionFingerprints(**fields) for fields in many]
    return build.complete_all(many) if common is not None else [build(fields) for fields in many]


def fingerprint_blocks(
    *,
    run_id: str,
    step: int,
    side: Side,
    case: Case,
    batch: StepBatch,
    keys: Sequence[str],
    prints: Mapping[tuple[str, int], HostRows] | PackedHostPrints,
    validate: bool = True,
) -> list[RegionFingerprintsBlock]:
    """One record per region call with every sample's rows (:class:`RegionFingerprintsBlock`):
    what :func:`fingerprint_records` gives, in a tenth of the Python objects or less (a region's
    rows for all samples are one slice of its arrays when the samples' rows are adjacent, one
    gather otherwise). ``prints`` left packed (:class:`PackedHostPrints`) are sliced once per
    field, straight from their group's arrays."""
    if not batch.spans or not prints:
        return []
    rows, cols = batch.shape
    # Token-identical samples (a GRPO group's equal completions) share their derived key: a block
    # names each sample once, so it keeps the first one's rows, as the store keeps the first
    # SampleLogprobs of a key (one sample named twice would refuse the whole block).
    first: dict[str, int] = {}
    for i, sample in enumerate(keys):
        first.setdefault(sample, i)
    kept = list(first.values())  # ascending: each key's first sample
    lengths = np.array([batch.spans[i].length for i in kept], dtype=np.int32)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths.tolist()])
    sample_keys = [keys[i] for i in kept]
    takes: dict[int, slice | np.ndarray] = {}  # per distinct row_index (all regions of a forward share one)
    build = constructor(RegionFingerprintsBlock, _BLOCK_NAMES)
    shared = {"run_id": run_id, "step": step, "side": side, "case": case}
    shared |= {"sample_keys": sample_keys, "lengths": lengths, "positions": positions}
    common = None if validate else build.prefilled(shared)
    bit_lists: dict[tuple[int, ...], list[int]] = {}  # one ladder_bits list per ladder, shared
    many: list[dict[str, Any]] = []
    for (region, forward_index), fields, start, stop, ladder_bits, row_index in _region_rows(prints):
        expected = rows * cols if row_index is None else row_index.size
        if stop - start != expected:
            raise ValueError(
                f"prints[{region!r}]: {stop - start} rows where the forward fingerprinted {expected}"
            )
        key = id(row_index)
        take = takes.get(key)
        if take is None:
            starts = [_first_row(row_index, batch.flat_start(i), batch.spans[i].length, region) for i in kept]
            adjacent = all(a + n == b for a, n, b in zip(starts, lengths.tolist(), starts[1:], strict=False))
            take = takes[key] = (
                slice(starts[0], starts[0] + positions.size)
                if adjacent
                else np.concatenate(
                    [np.arange(a, a + n) for a, n in zip(starts, lengths.tolist(), strict=True)]
                )
            )
        # the region's rows start at ``start`` of its arrays: one slice (or gather) per field
        at = slice(start + take.start, start + take.stop) if isinstance(take, slice) else take + start
        bits = bit_lists.get(ladder_bits)
        if bits is None:
            bits = bit_lists[ladder_bits] = list(ladder_bits)
        digest, ladder, sketch, l2, maxabs = fields
        entry = (shared if common is None else common).copy()
        entry["region"] = region
        entry["forward_index"] = forward_index
        entry["digest"] = digest[at]
        entry["ladder_bits"] = bits
        entry["ladder"] = ladder[at]
        entry["sketch"] = sketch[at]
        entry["l2"] = l2[at]
        entry["maxabs"] = maxabs[at]
        many.append(entry)
    if validate:
        return [RegionFingerprintsBlock(**entry) for entry in many]
    return build.complete_all(many) if common is not None else [build(entry) for entry in many]


def _region_rows(
    prints: Mapping[tuple[str, int], HostRows] | PackedHostPrints,
) -> Iterator[tuple[tuple[str, int], HostFields, int, int, tuple[int, ...], np.ndarray | None]]:
    """Each region call's (key, arrays, first row, row stop, rungs, row index): its rows are
    ``start:stop`` of the arrays (a packed group's, or its own :class:`HostRows`')."""
    if isinstance(prints, PackedHostPrints):
        groups = host_groups(prints.host, prints.layout)
        for key, (group, start, stop), bits in zip(
            prints.keys, prints.layout.spans, prints.layout.ladder_bits, strict=True
        ):
            yield key, groups[group], start, stop, bits, prints.row_index
        return
    for key, host in prints.items():
        fields = (host.digest, host.ladder, host.sketch, host.l2, host.maxabs)
        yield key, fields, 0, len(host), host.ladder_bits, host.row_index


def _first_row(row_index: np.ndarray | None, flat_start: int, length: int, region: str) -> int:
    """Where a sample's rows start among the fingerprinted rows (they are contiguous there too)."""
    if row_index is None:
        return flat_start
    at = int(np.searchsorted(row_index, flat_start))
    stop = at + length
    if stop > row_index.size or row_index[at] != flat_start or row_index[stop - 1] != flat_start + length - 1:
        raise ValueError(
            f"prints[{region!r}]: the sample at flat row {flat_start} was not fingerprinted whole"
        )
    return at
