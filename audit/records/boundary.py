"""The store's boundary: one record of any kind, or a batch of them, verified however it was built.

:func:`validate_record` is the one door every record passes on its way into the store (directly,
through a sink, or through the HTTP API): a dict is validated by pydantic, a record object is
checked by :meth:`~audit.records.kinds.Record.checked` (its hand checks when it was built with
``model_construct``). An invalid record is refused by name (:class:`Rejection`), never half-stored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Any

from isoaudit.audit.records.checks import RecordError, record_error
from isoaudit.audit.records.kinds import (
    Manifest,
    Record,
    RegionFingerprints,
    RegionFingerprintsBlock,
    Run,
    SampleLogprobs,
    StepStats,
)
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


@dataclass(frozen=True)
class Rejection:
    """One record of a batch that was not stored, and why: ``index`` in the batch, its ``kind``
    (``"unknown"`` when it has none we know), the ``field`` at fault and a ``message`` starting with it."""

    index: int
    kind: str
    field: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: A record of any kind, as :func:`validate_record` returns it.
RecordOfAnyKind = Run | Manifest | SampleLogprobs | RegionFingerprints | RegionFingerprintsBlock | StepStats
_KIND_CLASSES = (Run, Manifest, SampleLogprobs, RegionFingerprints, RegionFingerprintsBlock, StepStats)
#: The same, told apart by its ``kind`` tag (a batch's records).
AnyRecord = Annotated[RecordOfAnyKind, Field(discriminator="kind")]
#: The kind tags, in the order of :data:`RecordOfAnyKind`.
RECORD_KINDS: tuple[str, ...] = tuple(cls.model_fields["kind"].default for cls in _KIND_CLASSES)

_record_adapter: TypeAdapter[RecordOfAnyKind] = TypeAdapter(AnyRecord)


def record_kind(item: object) -> str:
    """The kind tag of a record or of its dict, ``"unknown"`` when there is no kind we know."""
    kind = item.get("kind") if isinstance(item, dict) else getattr(item, "kind", None)
    return kind if isinstance(kind, str) and kind in RECORD_KINDS else "unknown"


def validate_record(item: object) -> RecordOfAnyKind:
    """The store's boundary: a record (however built) or its dict, verified; raises RecordError."""
    if isinstance(item, Record):
        checked = item.checked()
        if not isinstance(checked, _KIND_CLASSES):
            raise RecordError("kind", f"{type(item).__name__} is not a record kind")
        return checked
    if not isinstance(item, dict):
        raise RecordError("record", f"expected a record object, got {type(item).__name__}")
    try:
        return _record_adapter.validate_python(item)
    except ValidationError as exc:
        raise record_error(exc, tags=RECORD_KINDS) from None


class Batch(BaseModel):
    """What a sink sends in one request. The store keeps its valid records in one transaction and
    refuses each invalid one by name (:class:`Rejection`)."""

    model_config = ConfigDict(extra="forbid")

    records: list[AnyRecord] = Field(max_length=100_000)


class BatchShape(BaseModel):
    """A body that is a batch at all: an object with a list of records (each checked on its own)."""

    model_config = ConfigDict(extra="forbid")

    records: list[Any] = Field(max_length=100_000)
