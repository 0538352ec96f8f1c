"""Which flat token row of an engine forward is which (request, position), and in which case.

vLLM flattens every scheduled token of every running request into one ``[num_tokens, hidden]``
batch: request ``i`` (in the input batch's order) owns rows ``query_start_loc[i]:query_start_loc[i+1]``,
at absolute positions ``num_computed_tokens[i] + 0, 1, ...`` of its prompt ‖ completion. That holds
for a whole prefill, a chunk of a chunked prefill, a decode step and any mix of them in one batch.
The logits are computed only for the last row of each request (``logits_indices``), so logits row
``i`` is request ``i`` at its last scheduled position.

The case follows the engine's path, not the token's role: one scheduled token past the prompt is
``engine_decode``; anything else (a prompt chunk, or prompt and completion recomputed after a
preemption) is ``engine_prefill``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from isoaudit.audit.records import Case


@dataclass(frozen=True)
class ForwardRows:
    """The layout of one forward: requests in batch order and where their rows lie."""

    req_ids: tuple[str, ...]
    query_start: np.ndarray  # int64 [num_reqs + 1]
    computed: np.ndarray  # int64 [num_reqs]: tokens already in the KV cache before this forward

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        if self.query_start.shape != (n + 1,) or self.computed.shape != (n,):
            raise ValueError(
                f"query_start/computed: shapes {list(self.query_start.shape)}/{list(self.computed.shape)} "
                f"do not fit {n} requests"
            )
        if n and (np.diff(self.query_start) < 0).any():
            raise ValueError("query_start: must be non-decreasing")

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1]) if len(self.req_ids) else 0

    def rows(self, i: int) -> tuple[int, int]:
        """Flat rows ``[a, b)`` of request ``i``."""
        return int(self.query_start[i]), int(self.query_start[i + 1])

    def positions(self, i: int) -> np.ndarray:
        """Absolute positions (in prompt ‖ completion) of request ``i``'s rows."""
        a, b = self.rows(i)
        return np.arange(self.computed[i], self.computed[i] + (b - a), dtype=np.int64)

    def case(self, i: int, prompt_len: int) -> Case:
        a, b = self.rows(i)
        return "engine_decode" if b - a == 1 and int(self.computed[i]) >= prompt_len else "engine_prefill"

    def select(self, indices: np.ndarray, prompt_lens: np.ndarray) -> Selected:
        """Requests ``indices`` (batch order, int64) with these prompt lengths, at once: their flat
        rows concatenated, each one's first row among them and count, and whether it decodes
        (:meth:`case`)."""
        starts = self.query_start[indices]
        counts = self.query_start[indices + 1] - starts
        firsts = np.cumsum(counts) - counts
        total = int(counts.sum())
        if total == indices.size:  # one row each (decode steps): the rows are their starts
            rows = starts.copy()
        else:
            rows = np.repeat(starts - firsts, counts) + np.arange(total, dtype=np.int64)
        decode = (counts == 1) & (self.computed[indices] >= prompt_lens)
        return Selected(rows, firsts, counts, decode)


@dataclass(frozen=True)
class Selected:
    """The selected requests of a forward (:meth:`ForwardRows.select`): ``rows`` int64 [total]
    their flat rows, concatenated in batch order; per request ``firsts``/``counts`` (its rows are
    ``rows[firsts[k]:firsts[k] + counts[k]]``) and ``decode``."""

    rows: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    decode: np.ndarray


def read_forward_rows(runner: Any) -> ForwardRows:
    """The layout of the forward ``runner`` is about to run (read between its input preparation and
    the model call: the input batch and ``query_start_loc`` then describe exactly this batch)."""
    batch = runner.input_batch
    n = int(batch.num_reqs)
    req_ids: Sequence[str] = batch.req_ids[:n]
    query_start = np.array(runner.query_start_loc.np[: n + 1], dtype=np.int64)
    computed = np.array(batch.num_computed_tokens_cpu[:n], dtype=np.int64)
    return ForwardRows(tuple(map(str, req_ids)), query_start, computed)
