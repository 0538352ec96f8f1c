"""Manifests and the execution contract: both sides' latest manifests side by side, their history with
what changed, the handshake verdict, and where the remediation mode changed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from isoaudit.audit.contract import HandshakeResult, handshake
from isoaudit.audit.db.models import (
    ManifestRow,
    StepSummaryRow,
)
from isoaudit.audit.db.reads.common import aware
from isoaudit.audit.db.store import Store
from isoaudit.audit.records import Manifest, utcnow
from sqlalchemy import select


@dataclass(frozen=True)
class ManifestEntry:
    """One stored manifest: when it was recorded and what it said."""

    id: int
    side: str
    case: str
    process: str
    created_at: datetime
    manifest: Manifest
    changed: list[str]  # fields that differ from the same side's previous manifest


@dataclass(frozen=True)
class FieldComparison:
    """One field of the two sides' latest manifests, side by side."""

    name: str
    trainer: Any
    rollout: Any
    differs: bool


@dataclass(frozen=True)
class ContractView:
    trainer: Manifest | None
    rollout: Manifest | None
    fields: list[FieldComparison]
    handshake: HandshakeResult | None
    history: list[ManifestEntry]


#: Manifest fields that name a record, not a numerical fact.
_IDENTITY_FIELDS = {"kind", "schema_version", "run_id", "side", "case", "process", "created_at"}


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys: ``{"runtime": {"dtype": "bf16"}}`` -> ``{"runtime.dtype": "bf16"}``."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key in sorted(value, key=str):
            out.update(flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def manifest_fields(manifest: Manifest | None) -> dict[str, Any]:
    """A manifest's numerical facts as dotted keys (identity fields left out)."""
    if manifest is None:
        return {}
    body = manifest.model_dump(mode="json", exclude=_IDENTITY_FIELDS)
    return flatten(body)


def compare_manifests(trainer: Manifest | None, rollout: Manifest | None) -> list[FieldComparison]:
    """Every field either side carries, differing ones flagged."""
    a, b = manifest_fields(trainer), manifest_fields(rollout)
    missing = object()
    rows = []
    for name in sorted(a.keys() | b.keys()):
        ta, rb = a.get(name, missing), b.get(name, missing)
        rows.append(
            FieldComparison(
                name, None if ta is missing else ta, None if rb is missing else rb, differs=ta != rb
            )
        )
    return rows


def manifest_history(store: Store, run_id: str) -> list[ManifestEntry]:
    """Every manifest of the run, oldest first, each with what changed since the previous one of the
    same side, case and process."""
    query = (
        select(ManifestRow)
        .where(ManifestRow.run_id == run_id)
        .order_by(ManifestRow.created_at, ManifestRow.id)
    )
    with store.sessions() as session:
        rows = list(session.scalars(query))
    previous: dict[tuple[str, str, str], dict[str, Any]] = {}
    entries = []
    for row in rows:
        manifest = Manifest.model_validate(row.body)
        now = manifest_fields(manifest)
        before = previous.get((row.side, row.case, row.process))
        changed = (
            []
            if before is None
            else sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
        )
        previous[(row.side, row.case, row.process)] = now
        entries.append(
            ManifestEntry(
                row.id, row.side, row.case, row.process, aware(row.created_at) or utcnow(), manifest, changed
            )
        )
    return entries


def contract_view(store: Store, run_id: str) -> ContractView:
    """Both sides' latest manifests compared, the handshake verdict and the manifest history."""
    history = manifest_history(store, run_id)
    latest: dict[str, Manifest] = {}
    for entry in history:
        latest[entry.side] = entry.manifest
    trainer, rollout = latest.get("trainer"), latest.get("rollout")
    verdict = handshake(trainer, rollout) if trainer is not None and rollout is not None else None
    return ContractView(trainer, rollout, compare_manifests(trainer, rollout), verdict, history)


@dataclass(frozen=True)
class ModeChange:
    """A side reporting a new remediation mode, placed on the first step recorded after it."""

    side: str
    mode: str | None
    at: datetime
    step: int | None


def mode_changes(
    store: Store, run_id: str, history: Sequence[ManifestEntry] | None = None
) -> list[ModeChange]:
    """Where each side's reported remediation mode changed (its first manifest counts only if it
    is not ``native``), placed on the first step whose records arrived after the manifest (None
    while no such step is compared yet). Reads two columns of the step summaries, no arrays."""
    history = manifest_history(store, run_id) if history is None else history
    with store.sessions() as session:
        stamps = [
            (aware(at), step)
            for step, at in session.execute(
                select(StepSummaryRow.step, StepSummaryRow.ingested_at)
                .where(StepSummaryRow.run_id == run_id, StepSummaryRow.ingested_at.is_not(None))
                .order_by(StepSummaryRow.step)
            )
        ]
    changes = []
    current: dict[str, str | None] = {}
    for entry in history:
        mode = entry.manifest.runtime.remediation
        before = current.get(entry.side, "native")
        current[entry.side] = mode
        if mode == before:
            continue
        step = next((s for at, s in stamps if at is not None and at >= entry.created_at), None)
        changes.append(ModeChange(entry.side, mode, entry.created_at, step))
    return changes
