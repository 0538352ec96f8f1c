"""Which requests the engine fingerprints: all, one in N, a given list, or none.

The choice is made once per request, when the engine first schedules it (before its prefill), so a
selected request is fingerprinted at every position it computes and an unselected one costs nothing
but a dictionary lookup per step. "One in N" counts requests in the order the engine first sees
them; every tensor-parallel rank sees the same order, so all ranks agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from isoaudit.collectors.vllm.messages import Selection

SelectionArg = Literal["all"] | int | Iterable[str] | None

__all__ = ["Selection", "SelectionArg", "parse_selection"]


def parse_selection(fingerprint: SelectionArg) -> Selection:
    """``"all"``, an integer N (one request in N; 1 means all), an iterable of request ids (as
    ``RequestOutput.request_id`` shows them), or ``None`` (logprobs only)."""
    if fingerprint is None:
        return Selection(mode="none")
    if isinstance(fingerprint, str):
        if fingerprint == "all":
            return Selection(mode="all")
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
        return Selection(mode="all") if fingerprint == 1 else Selection(mode="every", every=fingerprint)
    ids = [str(i) for i in fingerprint]
    return Selection(mode="ids", ids=frozenset(ids))
