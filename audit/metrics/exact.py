"""Exact parity of a compared step: fail-closed reads it (``isoaudit gate --exact``, ``session(...,
fail_closed=True)``).

A step is *identical* when every compared token's float32 logprob has the same bits on both sides
(``bitwise_mismatch_count == 0``): as strict as ``torch.equal`` on the two logprob tensors, and
stricter for ``-0.0`` against ``+0.0`` (different bits); a NaN with the same bits on both sides
counts as identical. A step whose count is missing (not computed, or no data) is not known to be
identical, and fail-closed fails it. The failure names the count of differing tokens and the largest
``|Δ|`` over finite tokens (``logprob_abs_diff_max``: a token that is ``-inf`` on one side only
differs without entering it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The stored step keys fail-closed reads.
EXACT_KEYS: tuple[str, ...] = ("bitwise_mismatch_count", "logprob_abs_diff_max", "n_tokens")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class Exactness:
    """What a compared step says about exact parity: ``differing_tokens`` (None: not known),
    ``max_abs_delta`` (None: no finite token) and ``n_tokens`` compared."""

    step: int
    differing_tokens: int | None
    max_abs_delta: float | None
    n_tokens: int | None

    @classmethod
    def of(cls, step: int, metrics: Mapping[str, Any]) -> Exactness:
        count = _number(metrics.get("bitwise_mismatch_count"))
        tokens = _number(metrics.get("n_tokens"))
        return cls(
            step,
            int(count) if count is not None else None,
            _number(metrics.get("logprob_abs_diff_max")),
            int(tokens) if tokens is not None else None,
        )

    @property
    def identical(self) -> bool:
        return self.differing_tokens == 0

    def describe(self) -> str:
        """``differing tokens: 3 of 4096, max |Δ| 0.0125`` (or why it is not known)."""
        if self.differing_tokens is None:
            return "not known to be identical (no bitwise count for this step)"
        of = f" of {self.n_tokens}" if self.n_tokens is not None else ""
        if self.identical:
            return f"all{of} tokens identical"
        delta = "n/a" if self.max_abs_delta is None else f"{self.max_abs_delta:.6g}"
        return f"differing tokens: {self.differing_tokens}{of}, max |Δ| {delta}"


class ExactnessError(AssertionError):
    """Fail-closed refused the run: a compared step is not identical, or steps could not be compared."""


class NotIdentical(ExactnessError):
    """A compared step of ``run_id`` has a non-identical token: ``step``, ``differing_tokens`` and
    ``max_abs_delta`` are that step's (the earliest such step known), ``failing_steps`` how many
    steps were known to fail when it was raised."""

    def __init__(self, run_id: str, first: Exactness, failing_steps: int = 1, *, detail: str = "") -> None:
        self.run_id = run_id
        self.step = first.step
        self.differing_tokens = first.differing_tokens
        self.max_abs_delta = first.max_abs_delta
        self.failing_steps = failing_steps
        more = f" ({failing_steps} steps fail)" if failing_steps > 1 else ""
        text = f"run {run_id}: step {first.step} is not identical: {first.describe()}{more}"
        super().__init__(text + (f"\n{detail}" if detail else ""))


class ParityUnverified(ExactnessError):
    """Fail-closed could not verify ``run_id``: ``steps_left`` steps stored on both sides were not
    compared by the end (None: the results could not be read)."""

    def __init__(self, run_id: str, steps_left: int | None, why: str = "") -> None:
        self.run_id = run_id
        self.steps_left = steps_left
        what = "the results could not be read" if steps_left is None else f"{steps_left} step(s) not verified"
        super().__init__(f"run {run_id}: parity unverified: {what}" + (f" ({why})" if why else ""))
