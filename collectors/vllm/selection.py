"""Which requests the engine fingerprints: all, one in N, a given list, or none.

The choice is made once per request, when the engine first schedules it (before its prefill), so a
selected request is fingerprinted at every position it computes and an unselected one costs nothing
but a dictionary lookup per step. "One in N" counts requests in the order the engine first sees
them; every tensor-parallel rank sees the same order, so all ranks agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

SelectionArg = Literal["all"] | int | Iterable[str] | None


@dataclass(frozen=True)
class Selection:
    mode: Literal["all", "every", "ids", "none"] = "all"
    every: int = 1
    ids: frozenset[str] = field(default_factory=frozenset)

    def chooses(self, ordinal: int, request_id: str) -> bool:
        """Is the ``ordinal``-th request the engine sees (0-based), with this external id, selected?"""
        if self.mode == "all":
            return True
        if self.mode == "every":
            return ordinal % self.every == 0
        if self.mode == "ids":
            return request_id in self.ids
        return False

    def to_wire(self) -> dict[str, Any]:
        """A plain dict that crosses ``collective_rpc`` in any engine mode."""
        return {"mode": self.mode, "every": self.every, "ids": sorted(self.ids)}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Selection:
        return cls(body["mode"], int(body["every"]), frozenset(body["ids"]))


def parse_selection(fingerprint: SelectionArg) -> Selection:
    """``"all"``, an integer N (one request in N; 1 means all), an iterable of request ids (as
    ``RequestOutput.request_id`` shows them), or ``None`` (logprobs only)."""
    if fingerprint is None:
        return Selection("none")
    if isinstance(fingerprint, str):
        if fingerprint == "all":
            return Selection("all")
        raise ValueError(
            f"fingerprint: expected 'all', an integer N (one in N), a list of request ids or None, got {fingerprint!r}"
        )
    if isinstance(fingerprint, bool):
        raise ValueError(
            "fingerprint: expected 'all', an integer N, a list of request ids or None, got a bool"
        )
    if isinstance(fingerprint, int):
        if fingerprint < 1:
            raise ValueError(f"fingerprint: one in N needs N >= 1, got {fingerprint}")
        return Selection("all") if fingerprint == 1 else Selection("every", fingerprint)
    ids = [str(i) for i in fingerprint]
    return Selection("ids", ids=frozenset(ids))
