"""Which manifest each side computed a step under, and what changed between two of them: two steps,
two runs or the two sides (``isoaudit diff``, the contract page, the worker's "since the last clean
step").

A step's manifest is placed by time, as :func:`audit.db.reads.contract.mode_changes` places mode
switches: the side's latest manifest recorded by the time the step's first record of that side was
stored (manifests carry no step; a collector sends one before the records it describes).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from isoaudit.audit.db.models import SampleRow, StepResultRow
from isoaudit.audit.db.reads.common import SIDES, aware
from isoaudit.audit.db.store import Store
from isoaudit.audit.environment import ManifestDiff, diff_manifests, manifest_at
from isoaudit.audit.records import Manifest
from sqlalchemy import func, select

#: How far back the worker looks for a clean step (step results read, newest first).
CLEAN_LOOKBACK = 1024


def step_times(store: Store, run_id: str, steps: Collection[int]) -> dict[tuple[int, str], datetime]:
    """(step, side) -> when the step's first record of that side was stored."""
    if not steps:
        return {}
    query = (
        select(SampleRow.step, SampleRow.side, func.min(SampleRow.created_at))
        .where(SampleRow.run_id == run_id, SampleRow.step.in_(sorted(set(steps))))
        .group_by(SampleRow.step, SampleRow.side)
    )
    with store.sessions() as session:
        return {
            (int(step), str(side)): at
            for step, side, when in session.execute(query)
            if (at := aware(when)) is not None
        }


def manifests_of_steps(
    store: Store, run_id: str, steps: Collection[int], manifests: Sequence[Manifest] | None = None
) -> dict[tuple[int, str], Manifest | None]:
    """(step, side) -> the manifest that side computed the step under (None: it sent none). A side
    with no record at a step is placed at the step's other side's time."""
    manifests = store.manifests(run_id) if manifests is None else manifests
    times = step_times(store, run_id, steps)
    out: dict[tuple[int, str], Manifest | None] = {}
    for step in steps:
        known = [times[(step, s)] for s in SIDES if (step, s) in times]
        for side in SIDES:
            at = times.get((step, side)) or (min(known) if known else None)
            out[(step, side)] = manifest_at(manifests, side, at) if at is not None else None
    return out


def clean_steps_before(store: Store, run_id: str, before: int, lookback: int = CLEAN_LOOKBACK) -> list[int]:
    """The steps before ``before`` whose every compared sample was clean, among the ``lookback`` newest
    compared ones, newest first."""
    query = (
        select(StepResultRow.step, StepResultRow.diagnoses)
        .where(StepResultRow.run_id == run_id, StepResultRow.step < before)
        .order_by(StepResultRow.step.desc())
        .limit(lookback)
    )
    with store.sessions() as session:
        return [int(step) for step, diagnoses in session.execute(query) if is_clean(diagnoses)]


def is_clean(diagnoses: Any) -> bool:
    """Whether a step result's ``diagnoses`` count clean samples only (and at least one)."""
    counts = diagnoses.get("counts") if isinstance(diagnoses, dict) else None
    return isinstance(counts, dict) and set(counts) == {"clean"}


@dataclass(frozen=True)
class Point:
    """A place to read manifests at: a run, and a step of it (None: its latest manifests)."""

    run_id: str
    step: int | None = None

    @classmethod
    def parse(cls, text: str) -> Point:
        """``RUN`` or ``RUN@STEP`` (a run id holds no ``@``); raises ValueError naming what is wrong."""
        run, sep, step = text.rpartition("@")
        if not sep:
            return cls(text)
        if not run:
            raise ValueError(f"{text!r}: give the run before '@'")
        try:
            number = int(step)
        except ValueError:
            raise ValueError(f"{text!r}: the step after '@' must be a whole number, not {step!r}") from None
        if number < 0:
            raise ValueError(f"{text!r}: the step must be >= 0")
        return cls(run, number)

    def label(self) -> str:
        return self.run_id if self.step is None else f"{self.run_id}@{self.step}"


@dataclass(frozen=True)
class SideDiff:
    """One comparison: manifest ``old`` (at ``old_label``) against ``new`` (at ``new_label``)."""

    title: str
    old_label: str
    new_label: str
    old: Manifest | None
    new: Manifest | None
    diff: ManifestDiff

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "old": self.old_label, "new": self.new_label, **self.diff.as_dict()}


@dataclass(frozen=True)
class EnvironmentReport:
    """The comparisons a diff asked for (one per side, or the two sides against each other)."""

    diffs: list[SideDiff] = field(default_factory=list)

    @property
    def n_changes(self) -> int:
        return sum(len(d.diff.changes) for d in self.diffs)

    def as_dict(self) -> dict[str, Any]:
        return {"diffs": [d.as_dict() for d in self.diffs], "n_changes": self.n_changes}


class UnknownPoint(LookupError):
    """A run or step a diff names is not in the store; the message says which and what exists,
    ``point`` is the one not found."""

    def __init__(self, message: str, point: Point) -> None:
        super().__init__(message)
        self.point = point


def _manifests_at(store: Store, point: Point) -> tuple[dict[str, Manifest | None], list[Manifest]]:
    if store.get_run(point.run_id) is None:
        raise UnknownPoint(f"no run {point.run_id!r} in the store (`isoaudit runs list` shows them)", point)
    manifests = store.manifests(point.run_id)
    if point.step is None:
        return {side: manifest_at(manifests, side, None) for side in SIDES}, manifests
    if not step_times(store, point.run_id, [point.step]):
        raise UnknownPoint(f"run {point.run_id!r} has no records of step {point.step}", point)
    at = manifests_of_steps(store, point.run_id, [point.step], manifests)
    return {side: at[(point.step, side)] for side in SIDES}, manifests


def _previous(manifests: Sequence[Manifest], current: Manifest | None) -> Manifest | None:
    """The manifest of ``current``'s side recorded just before it (any case or process)."""
    if current is None:
        return None
    mine = [m for m in manifests if m.side == current.side and m.created_at < current.created_at]
    return max(mine, key=lambda m: m.created_at) if mine else None


def environment_diff(
    store: Store, old: Point, new: Point | None = None, *, sides: bool = False
) -> EnvironmentReport:
    """What changed: ``sides`` -> the trainer against the rollout at ``old``; ``new`` given -> each side
    at ``old`` against the same side at ``new``; neither -> each side at ``old`` against that side's
    manifest before it. Raises :class:`UnknownPoint` for a run or step not stored."""
    at_old, manifests = _manifests_at(store, old)
    if sides:
        if new is not None:
            raise ValueError("--sides compares the two sides of one run: give one RUN[@STEP]")
        t, r = at_old["trainer"], at_old["rollout"]
        return EnvironmentReport(
            [
                SideDiff(
                    "trainer → rollout",
                    f"{old.label()} trainer",
                    f"{old.label()} rollout",
                    t,
                    r,
                    diff_manifests(t, r),
                )
            ]
        )
    if new is None:
        out = []
        for side in SIDES:
            current = at_old[side]
            before = _previous(manifests, current)
            out.append(
                SideDiff(
                    side,
                    f"{old.label()} {side}: previous manifest",
                    f"{old.label()} {side}",
                    before,
                    current,
                    diff_manifests(before, current),
                )
            )
        return EnvironmentReport(out)
    at_new, _ = _manifests_at(store, new)
    return EnvironmentReport(
        [
            SideDiff(
                side,
                f"{old.label()} {side}",
                f"{new.label()} {side}",
                at_old[side],
                at_new[side],
                diff_manifests(at_old[side], at_new[side]),
            )
            for side in SIDES
        ]
    )
