"""What changed between two manifests: library versions, backends, flags, environment pins and the
other runtime facts, key by key with old → new (DESIGN.md, "Comparator": with every verdict, what
changed in the environment since the last clean step).

A diff compares any two manifests: one side at two steps, the same side of two runs, or the two
sides of one step. Groups come in :data:`GROUPS` order; ``runtime`` holds the manifest's other
runtime facts (dtype, remediation, prefix caching, ...), less those the environment already names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from isoaudit.audit.diagnosis import Diagnosis
from isoaudit.audit.records import Manifest
from isoaudit.audit.records.environment import GROUPS as ENVIRONMENT_GROUPS

#: The groups of a diff, in the order it lists them.
GROUPS: Final = (*ENVIRONMENT_GROUPS, "runtime")

#: Runtime facts that an environment names under its own keys: left out of the ``runtime`` group
#: when both manifests record an environment, so one change is not listed twice.
NAMED_BY_ENVIRONMENT: Final = frozenset(
    {
        "torch_version",
        "framework_version",
        "attention_backend",
        "batch_invariant",
        "remediation",
        "gemm_split_k",
        "matmul_allow_tf32",
        "matmul_allow_bf16_reduced_precision",
        "matmul_allow_fp16_reduced_precision",
        "cudnn_allow_tf32",
        "deterministic_algorithms",
    }
)

#: Marks a key one manifest does not hold (shown as "unset").
_MISSING: Final = object()


def shown(value: Any) -> str:
    """A value as a diff shows it: text as is, None as ``unset``, anything else as JSON (``true``)."""
    if value is _MISSING or value is None:
        return "unset"
    return value if isinstance(value, str) else json.dumps(value, default=str)


@dataclass(frozen=True)
class Change:
    """One key whose value differs: ``old`` in the first manifest, ``new`` in the second (None: unset)."""

    group: str
    key: str
    old: Any
    new: Any

    def text(self) -> str:
        """``key old → new``, as the sentence and the table show it."""
        return f"{self.key} {shown(self.old)} → {shown(self.new)}"

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "key": self.key, "old": self.old, "new": self.new}

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> Change:
        return cls(str(body["group"]), str(body["key"]), body.get("old"), body.get("new"))


@dataclass(frozen=True)
class ManifestDiff:
    """What differs from manifest ``old`` to manifest ``new``; ``unrecorded`` names which of the two
    (``"old"``, ``"new"``) carried no environment (then only runtime facts are compared) or is missing."""

    changes: list[Change] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)

    def by_group(self) -> dict[str, list[Change]]:
        """The changes per group, groups in :data:`GROUPS` order, empty groups left out."""
        out: dict[str, list[Change]] = {}
        for group in GROUPS:
            found = [c for c in self.changes if c.group == group]
            if found:
                out[group] = found
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "changes": {g: [c.as_dict() for c in cs] for g, cs in self.by_group().items()},
            "unrecorded": list(self.unrecorded),
        }


def _diff_maps(group: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    changes = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if a != b:
            changes.append(Change(group, key, None if a is _MISSING else a, None if b is _MISSING else b))
    return changes


def diff_manifests(old: Manifest | None, new: Manifest | None) -> ManifestDiff:
    """Every environment key and runtime fact that differs from ``old`` to ``new``."""
    unrecorded = [label for label, m in (("old", old), ("new", new)) if m is None or m.environment is None]
    if old is None or new is None:
        return ManifestDiff([], unrecorded)
    changes: list[Change] = []
    both = old.environment is not None and new.environment is not None
    if old.environment is not None and new.environment is not None:
        a, b = old.environment.groups(), new.environment.groups()
        for group in ENVIRONMENT_GROUPS:
            changes += _diff_maps(group, a[group], b[group])
    skip = NAMED_BY_ENVIRONMENT if both else frozenset()
    ra = {k: v for k, v in old.runtime.model_dump(mode="json").items() if k not in skip}
    rb = {k: v for k, v in new.runtime.model_dump(mode="json").items() if k not in skip}
    changes += _diff_maps("runtime", ra, rb)
    return ManifestDiff(changes, unrecorded)


def describe(changes: Sequence[Change], limit: int = 6) -> str:
    """The first ``limit`` changes as one phrase: ``vllm 0.32.0 → 0.33.0, attention A → B (and 2 more)``."""
    shown = ", ".join(c.text() for c in changes[:limit])
    return shown + (f" (and {len(changes) - limit} more)" if len(changes) > limit else "")


def manifest_at(manifests: Sequence[Manifest], side: str, at: datetime | None) -> Manifest | None:
    """The manifest ``side`` computed under at time ``at``: its latest one recorded by then (its first
    one when all came later: a clock a little ahead of the store's), or its latest when ``at`` is None."""
    mine = [m for m in manifests if m.side == side]
    if not mine:
        return None
    ordered = sorted(enumerate(mine), key=lambda pair: (pair[1].created_at, pair[0]))
    if at is None:
        return ordered[-1][1]
    before = [m for _, m in ordered if m.created_at <= at]
    return before[-1] if before else ordered[0][1]


#: The evidence key of the changes since the last clean step (a diagnosis's, and the step result's
#: ``diagnoses``): ``{"since_step": k, "sides": {side: [change, ...]}}``.
EVIDENCE_KEY: Final = "environment_changes"


def with_changes(
    diagnosis: Diagnosis, since_step: int, per_side: Mapping[str, Sequence[Change]]
) -> Diagnosis:
    """``diagnosis`` (changed in place, and returned) naming what changed in each side's environment
    since step ``since_step``, the last clean one: in its evidence and at the end of its sentence."""
    parts = [f"on the {side}, {describe(changes)}" for side, changes in per_side.items() if changes]
    if not parts:
        return diagnosis
    diagnosis.evidence[EVIDENCE_KEY] = {
        "since_step": since_step,
        "sides": {side: [c.as_dict() for c in changes] for side, changes in per_side.items() if changes},
    }
    diagnosis.sentence = (
        f"{diagnosis.sentence.rstrip()} Changed since the last clean step {since_step}: {'; '.join(parts)}."
    )
    return diagnosis
