"""The changes since the last clean step: when a compared step is not clean, what changed in each
side's environment (versions, backends, flags, pins, runtime facts) since the newest clean step
before it, named in each non-clean sample's diagnosis and in the step's result (DESIGN.md,
"Comparator": with every verdict, what changed since the last clean step, when anything did).

Clean steps come from the batch being compared and from the stored step results before it
(:data:`audit.db.reads.environment.CLEAN_LOOKBACK` of them at most); each step's manifests are placed
by time (:func:`audit.db.reads.environment.manifests_of_steps`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from isoaudit.audit.compare import StepOutcome
from isoaudit.audit.db import Store
from isoaudit.audit.db.reads.common import SIDES
from isoaudit.audit.db.reads.environment import clean_steps_before, manifests_of_steps
from isoaudit.audit.environment import diff_manifests, with_changes
from isoaudit.audit.records import Manifest


def _clean(outcome: StepOutcome) -> bool:
    return bool(outcome.comparisons) and all(c.diagnosis.kind == "clean" for c in outcome.comparisons)


def note_changes_since_clean(
    store: Store, outcomes: Sequence[StepOutcome], manifests: Mapping[str, Sequence[Manifest]] | None = None
) -> int:
    """Name, in each non-clean sample diagnosis of ``outcomes``, what changed in the environment since
    the last clean step before its step (in place). ``manifests``: each run's manifests, when the caller
    read them already. Returns how many steps had changes to name."""
    by_run: dict[str, list[StepOutcome]] = defaultdict(list)
    for outcome in outcomes:
        by_run[outcome.run_id].append(outcome)
    noted = 0
    for run_id, mine in by_run.items():
        dirty = [o for o in mine if any(c.diagnosis.kind != "clean" for c in o.comparisons)]
        if not dirty:
            continue
        in_batch = {o.step for o in mine}
        stored = clean_steps_before(store, run_id, max(o.step for o in dirty))
        clean = sorted({s for s in stored if s not in in_batch} | {o.step for o in mine if _clean(o)})
        since: dict[int, int] = {}
        for outcome in dirty:
            earlier = [s for s in clean if s < outcome.step]
            if earlier:
                since[outcome.step] = earlier[-1]
        if not since:
            continue
        placed = manifests_of_steps(
            store, run_id, set(since) | set(since.values()), manifests.get(run_id) if manifests else None
        )
        for outcome in dirty:
            if outcome.step not in since:
                continue
            base = since[outcome.step]
            per_side = {
                side: diff_manifests(placed[(base, side)], placed[(outcome.step, side)]).changes
                for side in SIDES
            }
            if not any(per_side.values()):
                continue
            noted += 1
            for comparison in outcome.comparisons:
                if comparison.diagnosis.kind != "clean":
                    with_changes(comparison.diagnosis, base, per_side)
    return noted
