"""From host arrays of one forward to wire records: one SampleLogprobs per sample and one
RegionFingerprints per (sample, region), each with the sample's absolute positions.

Shared by both collectors: whatever the engine, a collector ends up with flat per-row arrays and a
layout (:class:`collectors.layout.StepBatch`), and this module cuts them per sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, Generic, TypeVar

import numpy as np
from pydantic import BaseModel

from audit.records import Case, LogprobSemantics, RegionFingerprints, SampleLogprobs, Side, sample_key
from collectors.fingerprints import HostRows
from collectors.layout import StepBatch

M = TypeVar("M", bound=BaseModel)

_IMMUTABLE = (type(None), bool, int, float, str, bytes)
_set = object.__setattr__


class Construct(Generic[M]):
    """``cls.model_construct(**values)`` for calls that always give the same field names, at a
    fraction of its cost: a step with every region fingerprinted builds about a thousand records,
    and ``model_construct`` resolves every field's default for each. Here the defaults are resolved
    once and each record is the template's dict updated with the values.

    The first record is also built by ``model_construct`` and compared (dict, fields set, extras):
    if they differ (another pydantic, a model with a post-init or a mutable default), every record
    is built by ``model_construct`` instead."""

    def __init__(self, cls: type[M], names: frozenset[str]) -> None:
        self.cls = cls
        self.names = names
        self._template: dict[str, Any] | None = {}
        self._checked = False
        if (
            cls.__pydantic_post_init__
            or cls.__pydantic_root_model__
            or cls.model_config.get("extra") == "allow"
        ):
            self._template = None
            return
        for name, info in cls.__pydantic_fields__.items():
            if info.alias is not None or info.validation_alias is not None:
                self._template = None
                return
            if name in names:
                self._template[name] = None  # its place in field order; every call sets it
            elif info.default_factory is None and not info.is_required() and type(info.default) in _IMMUTABLE:
                self._template[name] = info.default
            else:  # a fresh default per record, or a missing required field: model_construct's way
                self._template = None
                return
        if set(names) - set(self._template):
            self._template = None  # names that are not fields: model_construct drops them

    def __call__(self, values: dict[str, Any]) -> M:
        template = self._template
        if template is None or values.keys() != self.names:
            return self.cls.model_construct(**values)
        fields = template.copy()
        fields.update(values)
        record = self.cls.__new__(self.cls)
        _set(record, "__dict__", fields)
        _set(record, "__pydantic_fields_set__", set(self.names))
        _set(record, "__pydantic_extra__", None)
        _set(record, "__pydantic_private__", None)
        if not self._checked:
            self._checked = True
            slow = self.cls.model_construct(**values)
            if not _same_construction(record, slow):
                self._template = None
                return slow
        return record


def _same_construction(a: BaseModel, b: BaseModel) -> bool:
    da, db = a.__dict__, b.__dict__
    try:  # values given are the same objects; defaults are immutable scalars
        if list(da) != list(db) or any(da[k] is not db[k] and bool(da[k] != db[k]) for k in da):
            return False
        return bool(
            a.__pydantic_fields_set__ == b.__pydantic_fields_set__
            and a.__pydantic_extra__ == b.__pydantic_extra__
            and a.__pydantic_private__ == b.__pydantic_private__
        )
    except Exception:  # noqa: BLE001 - anything not comparable: not the same, model_construct it is
        return False


@lru_cache(maxsize=32)
def constructor(cls: type[M], names: frozenset[str]) -> Construct[M]:
    """The shared :class:`Construct` of ``cls`` for these field names."""
    return Construct(cls, names)


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
        fields = {
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
        }
        records.append(SampleLogprobs(**fields) if validate else build(fields))
    return records


_SAMPLE_NAMES = frozenset(
    ("run_id", "step", "side", "sample_key", "weight_version", "prompt_len", "token_ids", "logprobs")
    + ("temperature", "semantics")
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
    positions = [np.arange(span.length, dtype=np.int32) for span in batch.spans]
    lengths = [span.length for span in batch.spans]
    starts: dict[int, list[int]] = {}  # per distinct row_index (all regions of a forward share one)
    build = constructor(RegionFingerprints, _PRINT_NAMES)
    records = []
    for (region, forward_index), host in prints.items():
        expected = rows * cols if host.row_index is None else host.row_index.size
        if len(host) != expected:
            raise ValueError(
                f"prints[{region!r}]: {len(host)} rows where the forward fingerprinted {expected}"
            )
        key = id(host.row_index)
        if key not in starts:
            starts[key] = [
                _first_row(host.row_index, batch.flat_start(i), span.length, region)
                for i, span in enumerate(batch.spans)
            ]
        digest, ladder, sketch, l2, maxabs = host.digest, host.ladder, host.sketch, host.l2, host.maxabs
        bits = host.ladder_bits
        for i, (a, length) in enumerate(zip(starts[key], lengths, strict=True)):
            b = a + length
            fields = {
                "run_id": run_id,
                "step": step,
                "side": side,
                "case": case,
                "sample_key": keys[i],
                "region": region,
                "forward_index": forward_index,
                "positions": positions[i],
                "digest": digest[a:b],
                "ladder_bits": list(bits),
                "ladder": ladder[a:b],
                "sketch": sketch[a:b],
                "l2": l2[a:b],
                "maxabs": maxabs[a:b],
            }
            records.append(RegionFingerprints(**fields) if validate else build(fields))
    return records


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
