"""Regression gates: pin backend parity in CI, as slime and SkyRL do by hand.

A gate is a bound on a step metric (``kl_k3 <= 1e-3``, ``train_rollout_logprob_abs_diff <= 1e-6``),
named as any framework names it (:mod:`audit.metric_names`). Every compared step of the run (or of
``steps``) must satisfy every bound; a missing value fails too, since a gate that cannot be checked
is not a pass. ``isoaudit gate`` is the command; :func:`assert_parity` the pytest helper::

    from isoaudit.audit.gates import assert_parity
    assert_parity(store, "ci-run", max={"kl_k3": 1e-3, "slime:train_rollout_logprob_abs_diff": 1e-6})

``exact=True`` (``isoaudit gate --exact``, alias ``--fail-closed``) is the strict gate for stacks meant
to be bitwise identical: every compared step must have no token whose float32 logprob bits differ
(:mod:`audit.metrics.exact`); a failure names the step, the count of differing tokens and the largest
``|Δ|``, and :func:`assert_parity` raises :class:`~audit.metrics.exact.NotIdentical` (an
``AssertionError``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from isoaudit.audit.db import Store
from isoaudit.audit.metric_names import UnknownMetric, lookup, resolve
from isoaudit.audit.metrics.exact import Exactness, NotIdentical, ParityUnverified

Direction = Literal["max", "min"]


class GateError(ValueError):
    """Input a gate cannot be checked with; the message names the option or value at fault."""


@dataclass(frozen=True)
class Bound:
    name: str  #: as the user wrote it
    key: str  #: the stored key it resolves to
    direction: Direction
    limit: float
    exact: bool = False  #: the fail-closed gate: no differing token (audit.metrics.exact)

    def holds(self, value: float) -> bool:
        return value <= self.limit if self.direction == "max" else value >= self.limit

    def describe(self) -> str:
        if self.exact:
            return "identical"
        return f"{'<=' if self.direction == 'max' else '>='} {self.limit:g}"


#: The fail-closed gate: no token whose float32 logprob bits differ.
EXACT = Bound("exact", "bitwise_mismatch_count", "max", 0.0, exact=True)


@dataclass(frozen=True)
class GateFailure:
    step: int
    bound: Bound
    value: float | None  #: None: the step has no value for it
    #: what the exact gate read of the step (its count of differing tokens and max |Δ|)
    exactness: Exactness | None = None

    @property
    def reason(self) -> str:
        if self.exactness is not None:
            return self.exactness.describe()
        if self.value is None:
            return "no value at this step (not computed, or no data)"
        return f"{self.value:.6g} is not {self.bound.describe()}"


@dataclass
class GateResult:
    run_id: str
    bounds: list[Bound]
    steps: list[int]
    failures: list[GateFailure] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def not_identical(self) -> list[Exactness]:
        """The exact gate's findings on the steps it failed, in step order."""
        return [f.exactness for f in self.failures if f.exactness is not None]

    def text(self) -> str:
        """A plain table of the failures (what pytest shows)."""
        if self.passed:
            return f"run {self.run_id}: {len(self.bounds)} gates pass on {len(self.steps)} steps"
        lines = [f"run {self.run_id}: {len(self.failures)} gate failures"]
        lines += [
            f"  step {f.step}: {f.bound.name}"
            + (f" ({f.bound.key})" if f.bound.key != f.bound.name else "")
            + f" {f.bound.describe()}: {f.reason}"
            for f in self.failures
        ]
        return "\n".join(lines)


def parse_assignment(text: str, option: str) -> tuple[str, float]:
    """``"kl_k3=1e-3"`` -> ("kl_k3", 0.001); the last ``=`` splits (metric keys have none)."""
    name, sep, number = text.rpartition("=")
    if not sep or not name:
        raise GateError(f"{option} {text}: expected METRIC=NUMBER, e.g. kl_k3=1e-3")
    try:
        limit = float(number)
    except ValueError:
        raise GateError(f"{option} {text}: {number!r} is not a number") from None
    if not math.isfinite(limit):
        raise GateError(f"{option} {text}: the bound must be finite")
    return name, limit


def bounds_of(
    max: Mapping[str, float] | None = None,
    min: Mapping[str, float] | None = None,
    *,
    exact: bool = False,
) -> list[Bound]:
    """Bounds from {metric name: limit}, and :data:`EXACT` with ``exact``; every name is resolved
    now, so a typo fails before any check."""
    out = []
    for direction, given in (("max", max or {}), ("min", min or {})):
        for name, limit in given.items():
            try:
                key = resolve(name)
            except UnknownMetric as exc:
                raise GateError(f"--{direction} {name}: {str(exc).removeprefix('metric: ')}") from None
            if not isinstance(limit, int | float) or isinstance(limit, bool) or not math.isfinite(limit):
                raise GateError(f"--{direction} {name}: the bound must be a finite number, got {limit!r}")
            out.append(Bound(name, key, direction, float(limit)))  # type: ignore[arg-type]  # direction is one of the two Literal names the loop iterates
    if exact:
        out.append(EXACT)
    if not out:
        raise GateError("gates: give at least one --max or --min, or --exact")
    return out


_STEPS = re.compile(r"^\s*(\d+)?\s*(\.\.)?\s*(\d+)?\s*$")


def parse_steps(text: str) -> set[int] | tuple[int | None, int | None]:
    """``"3"``, ``"1,4,9"`` (a set) or ``"2..8"``, ``"5.."``, ``"..3"`` (an inclusive range)."""
    if "," in text:
        try:
            return {int(part) for part in text.split(",") if part.strip()}
        except ValueError:
            raise GateError(f"--steps {text}: expected N, N,M,... or A..B") from None
    match = _STEPS.match(text)
    if match is None or (match[1] is None and match[3] is None):
        raise GateError(f"--steps {text}: expected N, N,M,... or A..B")
    lo = int(match[1]) if match[1] is not None else None
    hi = int(match[3]) if match[3] is not None else None
    if match[2] is None:
        return {lo if lo is not None else hi}  # type: ignore[arg-type]  # the pattern makes one of lo/hi an int when match[2] is None
    if lo is not None and hi is not None and lo > hi:
        raise GateError(f"--steps {text}: the range is empty ({lo} > {hi})")
    return (lo, hi)


def check(
    store: Store,
    run_id: str,
    bounds: Iterable[Bound],
    steps: set[int] | tuple[int | None, int | None] | None = None,
    *,
    compare: bool = True,
) -> GateResult:
    """Check ``bounds`` on every compared step of ``run_id`` (comparing queued samples first)."""
    bounds = list(bounds)
    if store.get_run(run_id) is None:
        raise GateError(f"RUN: no run {run_id!r} in the store (`isoaudit runs list` shows the recorded ones)")
    if compare:
        from isoaudit.audit.worker import ComparisonWorker

        ComparisonWorker(store).run_once(run_id)
    if isinstance(steps, set):
        rows = store.step_results(run_id, only=steps)
    else:
        rows = store.step_results(run_id, *(steps or (None, None)))
    if not rows:
        raise GateError(
            f"--steps: run {run_id!r} has no compared step to check" + (" in that range" if steps else "")
        )
    result = GateResult(run_id, bounds, [row.step for row in rows])
    for row in rows:
        for bound in bounds:
            if bound.exact:
                found = Exactness.of(row.step, row.metrics)
                if not found.identical:
                    result.failures.append(GateFailure(row.step, bound, found.differing_tokens, found))
                continue
            value = lookup(row.metrics, bound.key)
            number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
            if number is None or not math.isfinite(number):
                result.failures.append(GateFailure(row.step, bound, None))
            elif not bound.holds(number):
                result.failures.append(GateFailure(row.step, bound, number))
    return result


def assert_parity(
    store: Store,
    run_id: str,
    *,
    max: Mapping[str, float] | None = None,
    min: Mapping[str, float] | None = None,
    steps: set[int] | tuple[int | None, int | None] | str | None = None,
    exact: bool = False,
) -> GateResult:
    """The pytest helper: raise AssertionError with the failure table unless every gate holds.
    ``exact``: also fail any step with a non-identical token, raising
    :class:`~audit.metrics.exact.NotIdentical` (the earliest such step's count and max |Δ|), or
    :class:`~audit.metrics.exact.ParityUnverified` where a step's count is missing."""
    chosen = parse_steps(steps) if isinstance(steps, str) else steps
    result = check(store, run_id, bounds_of(max, min, exact=exact), chosen)
    if result.passed:
        return result
    found = result.not_identical()
    differing = [e for e in found if e.differing_tokens is not None]
    if differing:
        raise NotIdentical(run_id, differing[0], len(differing), detail=result.text())
    if found:
        raise ParityUnverified(run_id, len(found), f"no bitwise count at step {found[0].step}")
    raise AssertionError(result.text())
