"""The alert state machine, as pure functions of a rule and a run's recent step metrics (no I/O, so
it is tested exhaustively and every process that evaluates the same steps reaches the same state).

States: inactive (no open alert) → pending → firing → resolved; a pending alert whose condition
clears before ``for`` steps goes back to inactive without a notice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from isoaudit.audit.alerts.rules import AlertRule
from isoaudit.audit.db.alerts import AlertState
from isoaudit.audit.metric_names import lookup


@dataclass(frozen=True)
class Evaluation:
    """Where a rule stands at the latest compared step of a run."""

    step: int
    value: float | None
    breaching_steps: int
    clear_steps: int
    first_breaching_step: int | None = None

    @property
    def breaching(self) -> bool:
        return self.breaching_steps > 0


def steps_needed(rule: AlertRule) -> int:
    """How many of the latest compared steps decide the state: a window ending at each of the last
    ``max(for, keep_firing_for) + 1`` steps."""
    return rule.window + max(rule.for_steps, rule.keep_firing_for) + 1


def evaluate_series(rule: AlertRule, series: Sequence[tuple[int, Mapping[str, Any]]]) -> Evaluation | None:
    """Evaluate ``rule`` over ``series`` ((step, metrics) in step order, the latest last): the window
    value at the latest step and the run of consecutive breaching (or clear) steps ending there."""
    if not series:
        return None
    values = [lookup(metrics, rule.metric) for _, metrics in series]
    flags = []
    window_values: list[float | None] = []
    for end in range(len(values)):
        window_value = rule.aggregate(values[max(0, end - rule.window + 1) : end + 1])
        window_values.append(window_value)
        flags.append(rule.breaches(window_value))
    latest = flags[-1]
    run = 0
    for flag in reversed(flags):
        if flag != latest:
            break
        run += 1
    return Evaluation(
        step=series[-1][0],
        value=window_values[-1],
        breaching_steps=run if latest else 0,
        clear_steps=0 if latest else run,
        first_breaching_step=series[-run][0] if latest else None,
    )


def breaches_at(rule: AlertRule, series: Sequence[tuple[int, Mapping[str, Any]]], step: int) -> bool:
    """Whether ``rule``'s condition held at ``step`` (its window over ``series``' steps up to it).
    False when ``series`` lacks ``step``."""
    upto = [metrics for s, metrics in series if s <= step]
    if not upto or series[len(upto) - 1][0] != step:
        return False
    return rule.breaches(rule.aggregate(lookup(m, rule.metric) for m in upto[-rule.window :]))


def breaching_steps(rule: AlertRule, series: Sequence[tuple[int, Mapping[str, Any]]], step: int) -> list[int]:
    """The steps of ``series`` whose window holds ``step`` (it and the ``window - 1`` after it: a step
    compared late changes their verdicts too) at which ``rule``'s condition held: what ``/metrics``
    counts as steps over the rule's threshold."""
    steps = [s for s, _ in series]
    if step not in steps:
        return []
    start = steps.index(step)
    return [s for s in steps[start : start + rule.window] if breaches_at(rule, series, s)]


def next_state(rule: AlertRule, current: AlertState, evaluation: Evaluation) -> AlertState:
    """The state after ``evaluation`` for an alert now in ``current`` (inactive/resolved: none open)."""
    fires = evaluation.breaching_steps >= max(rule.for_steps, 1)
    if current in ("inactive", "resolved"):
        if not evaluation.breaching:
            return current
        return "firing" if fires else "pending"
    if current == "pending":
        if not evaluation.breaching:
            return "inactive"
        return "firing" if fires else "pending"
    # firing: stays until the condition has been clear for more than keep_firing_for steps
    if evaluation.breaching or evaluation.clear_steps <= rule.keep_firing_for:
        return "firing"
    return "resolved"
