"""What the run page's step figures hold, kept in the page (:data:`ids.STATE`) so that a live tick
appends only the steps compared since and knows when a figure must be drawn again."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LiveState:
    """What the run page's figures were drawn with."""

    run_id: str
    last_step: int | None = None
    stat: str = "mean"
    n_bins: int = 0
    regions: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    log_rows: list[int] = field(default_factory=list)  # timeline panels drawn on a log axis

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LiveState:
        return cls(**body)


def json_values(values: Sequence[float | None]) -> list[float | None]:
    """NaN as null (JSON has no NaN), for values a ``dash.Patch`` appends."""
    return [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values]
