"""The print buffer: the selected rows of many engine steps, fingerprinted together.

The region hooks copy only the rows of the requests chosen for fingerprinting into a
:class:`StepRows` (hidden-state regions straight into one staging tensor per step). Those copies
wait here and are fingerprinted many steps at a time, one
:func:`~isoaudit.collectors.fingerprints.fingerprint_rows` call per (dtype, width) group and one
device-to-host transfer, when they exceed ``flush_bytes`` or when the driver drains: per-call
overhead then hardly counts, and a GPU is not synchronised every step. The results are filed as
:class:`~isoaudit.collectors.vllm.worker.requests.Piece`\\ s under each request of the
:class:`~isoaudit.collectors.vllm.worker.requests.RequestBook`, whose row budget bounds the buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from isoaudit.collectors.counting import Counters
from isoaudit.collectors.fingerprint_op import slot_rows
from isoaudit.collectors.fingerprints import RowFingerprints, device_tensors, fingerprint_rows, host_rows
from isoaudit.collectors.transfer import to_host
from isoaudit.collectors.vllm.worker.requests import Piece, RequestBook, RequestTrace
from isoaudit.collectors.vllm.worker.rows import ForwardRows

#: ``fingerprinter(rows [n, width]) -> RowFingerprints``: the pass a flush runs per group.
Fingerprinter = Callable[[torch.Tensor], RowFingerprints]


@dataclass
class Member:
    """A selected request in one forward: its rows ``[first, first + count)`` of the selection."""

    trace: RequestTrace
    index: int  # position in the batch (its logits row)
    row: int  # position among the forward's selected requests (its row of the selected logits)
    first: int
    count: int
    decode: bool
    positions: np.ndarray | None  # None: read from the forward's positions at the flush


@dataclass
class StepRows:
    """The selected rows of the forward in flight, and later of a step waiting to be fingerprinted."""

    layout: ForwardRows
    members: list[Member]
    index: torch.Tensor | None  # flat rows of the selected requests, concatenated in batch order
    logits_index: torch.Tensor | None  # their batch indices (logits rows)
    positions: torch.Tensor | None  # the forward's own positions of those rows
    # Hidden-state regions write their selected rows straight into one staging tensor
    # [slots, selected rows, width] (no small allocations, one tensor per step to concatenate).
    stage: torch.Tensor | None = None
    filled: list[int] = field(default_factory=list)  # regions written into the stage
    # A compiled engine's graph taps fingerprint the selected rows in the forward itself: their
    # (int64 [slots, rows, w], float32 [slots, rows, w']) rows (fingerprint_op's layout), with the
    # ladder they were written with; ``printed_regions``' slots are read from them.
    printed: tuple[torch.Tensor, torch.Tensor] | None = None
    printed_bits: tuple[int, ...] = ()
    printed_regions: list[int] = field(default_factory=list)
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # logits, and odd shapes
    host_positions: np.ndarray | None = None  # ``positions`` on the host, once kept (a CPU engine)

    @property
    def selected_rows(self) -> int:
        return int(self.index.numel()) if self.index is not None else 0


#: The forward in flight when nothing of it is recorded (hooks return at once on it).
IDLE = StepRows(ForwardRows((), np.zeros(1, np.int64), np.zeros(0, np.int64)), [], None, None, None)


def select_rows(
    parts: Sequence[torch.Tensor], index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A tap's value at the selected rows only, as a copy (vLLM's fused norms later overwrite the
    module outputs in place). Rows are selected *before* a SUM tap adds hidden + residual: the add
    then runs on a few rows, not the whole batch; elementwise, the bits are the same."""
    index = index.to(parts[0].device)
    if out is None:
        out = parts[0].index_select(0, index)
    else:
        torch.index_select(parts[0], 0, index, out=out)
    if len(parts) > 1:
        out.add_(parts[1].index_select(0, index))
    return out


class PrintBuffer:
    """Steps waiting for their fingerprint pass, bounded by ``flush_bytes`` and the book's rows.

    ``logits``: for each region (by index), whether it is the logits region (one row per request);
    the others are hidden-state regions, staged together. Counts ``fingerprinted_forwards``,
    ``rows`` and ``dropped_rows`` on ``counters``."""

    def __init__(
        self,
        logits: Sequence[bool],
        book: RequestBook,
        counters: Counters,
        *,
        flush_bytes: int,
        fingerprinter: Fingerprinter = fingerprint_rows,
    ) -> None:
        self.logits = list(logits)
        self.book = book
        self.counters = counters
        self.flush_bytes = flush_bytes
        self.fingerprinter = fingerprinter
        hidden = [i for i, is_logits in enumerate(self.logits) if not is_logits]
        self._slots = {region: slot for slot, region in enumerate(hidden)}
        self._slots_count = max(1, len(hidden))
        self._steps: list[StepRows] = []
        self._bytes = 0

    def add_logits(self, step: StepRows, region: int, parts: Sequence[torch.Tensor]) -> None:
        """The logits rows of the selected requests (in fp32)."""
        assert step.logits_index is not None
        step.pending.append((region, select_rows(parts, step.logits_index).float()))

    def add_hidden(self, step: StepRows, region: int, parts: Sequence[torch.Tensor]) -> None:
        """A hidden-state region's selected rows: into the step's staging tensor when they fit it."""
        assert step.index is not None
        first = parts[0]
        if step.stage is None:
            shape = (self._slots_count, step.selected_rows, first.shape[-1])
            step.stage = torch.empty(shape, dtype=first.dtype, device=first.device)
        stage = step.stage
        if (stage.dtype, stage.shape[-1], stage.device) == (first.dtype, first.shape[-1], first.device):
            select_rows(parts, step.index, out=stage[self._slots[region]])
            step.filled.append(region)
        else:
            step.pending.append((region, select_rows(parts, step.index)))

    def keep(self, step: StepRows) -> None:
        """Keep a finished step's rows for a later, batched pass (one pass over many steps costs far
        less than one per step and, on a GPU, does not synchronise every step). A request whose rows
        find no room in the book is marked truncated and its rows are dropped (counted)."""
        if step is IDLE or not (step.pending or step.filled or step.printed_regions):
            return
        logits = sum(1 for i, _ in step.pending if self.logits[i])
        hidden = len(step.filled) + len(step.printed_regions) + len(step.pending) - logits
        kept = []
        for member in step.members:
            needed = member.count * hidden + logits
            if self.book.reserve(member.trace, needed):
                kept.append(member)
            else:
                member.trace.truncated = True
                self.counters.dropped_rows += needed
        if not kept:
            return
        step.members = kept
        if step.positions is not None and step.positions.device.type == "cpu":
            step.host_positions = step.positions.numpy()
            step.positions = None
        self._steps.append(step)
        staged = [step.stage] if step.stage is not None else []
        staged += list(step.printed) if step.printed is not None else []
        self._bytes += sum(t.numel() * t.element_size() for t in staged + [t for _, t in step.pending])
        if self._bytes >= self.flush_bytes:
            self.flush()

    def clear(self) -> None:
        """Drop every waiting step, unprinted."""
        self._steps.clear()
        self._bytes = 0

    def flush(self) -> None:
        """Fingerprint every step kept since the last flush, in one pass per (dtype, width) group with
        one device-to-host transfer, and file the results under each request still in the book."""
        steps, self._steps, self._bytes = self._steps, [], 0
        steps = [s for s in steps if any(self.book.live(m.trace) for m in s.members)]
        if not steps:
            return
        # Chunks to fingerprint, grouped by (dtype, width, logits?): (step, tensor, [(region, slot)]):
        # a chunk holds its regions' rows one after another, a row count (``unit``) each.
        groups: dict[
            tuple[torch.dtype, int, bool], list[tuple[int, torch.Tensor, list[tuple[int, int]]]]
        ] = {}
        for k, step in enumerate(steps):
            if step.stage is not None and step.filled:
                stage = step.stage.reshape(-1, step.stage.shape[-1])
                entries = [(region, self._slots[region]) for region in step.filled]
                groups.setdefault((stage.dtype, int(stage.shape[-1]), False), []).append((k, stage, entries))
            for region, rows in step.pending:
                key = (rows.dtype, int(rows.shape[-1]), self.logits[region])
                groups.setdefault(key, []).append((k, rows, [(region, 0)]))
        tensors: dict[str, torch.Tensor] = {}
        # per step, per group: where its rows lie (_Filed)
        where: list[dict[int, _Filed]] = [{} for _ in steps]
        bits: list[tuple[int, ...]] = []
        for g, (key, items) in enumerate(groups.items()):
            stacked = torch.cat([rows for _, rows, _ in items]) if len(items) > 1 else items[0][1]
            prints = self.fingerprinter(stacked)
            bits.append(prints.ladder_bits)
            tensors.update(device_tensors([prints], prefix=f"g{g}."))
            base = 0
            for k, rows, entries in items:
                unit = int(rows.shape[0]) if key[2] else steps[k].selected_rows
                filed = where[k].get(g)
                if filed is None:
                    filed = where[k][g] = _Filed(base, unit, key[2])
                first = (base - filed.base) // max(unit, 1)
                for region, slot in entries:
                    filed.add(region, first + slot)
                base += int(rows.shape[0])
        # Steps fingerprinted inside the graph: their rows concatenated per ladder, no pass here.
        printed: dict[tuple[int, ...], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for k, step in enumerate(steps):
            if step.printed is not None and step.printed_regions:
                printed.setdefault(step.printed_bits, []).append((k, *step.printed))
        for j, items_p in enumerate(printed.values()):
            g = len(groups) + j
            base = 0
            for k, ints, _ in items_p:
                n = int(ints.shape[1])
                filed = where[k].setdefault(g, _Filed(base, n, False))
                for region in steps[k].printed_regions:
                    filed.add(region, self._slots[region])
                base += int(ints.shape[0]) * n
            for name, parts in (("ints", [i for _, i, _ in items_p]), ("floats", [f for _, _, f in items_p])):
                flat = [t.reshape(-1, t.shape[-1]) for t in parts]
                tensors[f"p{j}.{name}"] = torch.cat(flat) if len(flat) > 1 else flat[0]
        for k, step in enumerate(steps):
            if step.positions is not None:
                tensors[f"pos{k}"] = step.positions
        host = to_host(tensors)  # the flush's one device-to-host transfer
        blocks = [host_rows(host, [bits[g]], prefix=f"g{g}.")[0] for g in range(len(groups))]
        blocks += [slot_rows(host[f"p{j}.ints"], host[f"p{j}.floats"], b) for j, b in enumerate(printed)]
        self.counters.fingerprinted_forwards += len(steps)
        filed_rows = 0
        interned: dict[tuple[tuple[int, ...], tuple[int, ...], bool], int] = {}
        for k, step in enumerate(steps):
            filed_k = [(blocks[g], filed, filed.seal(interned)) for g, filed in where[k].items()]
            positions_k = step.host_positions if step.host_positions is not None else host.get(f"pos{k}")
            for member in step.members:
                trace = member.trace
                if not self.book.live(trace):
                    continue
                positions = member.positions
                if positions is None:
                    assert positions_k is not None
                    positions = positions_k[member.first : member.first + member.count]
                rows = positions.tolist()
                if not member.decode and rows:
                    trace.prefill_positions.add(int(rows[-1]))
                for block, filed, sig in filed_k:
                    piece_key = (id(block), sig)
                    piece = trace.pieces.get(piece_key)
                    if piece is None:
                        piece = trace.pieces[piece_key] = Piece(
                            block, filed.regions_key, np.asarray(filed.mults, dtype=np.int64)
                        )
                    if filed.logits:  # one row per request: its last position
                        piece.add(filed.base + member.row, filed.unit, rows[-1:], member.decode)
                        filed_rows += len(filed.regions)
                    else:
                        piece.add(filed.base + member.first, filed.unit, rows, member.decode)
                        filed_rows += member.count * len(filed.regions)
        self.counters.rows += filed_rows


@dataclass
class _Filed:
    """Where one forward's rows lie in one fingerprinted group: region ``regions[i]``'s rows start at
    ``base + mults[i] * unit`` (``unit``: the forward's selected rows, or its logits rows), a
    request's at its first row among them (its logits row)."""

    base: int
    unit: int
    logits: bool
    regions: list[int] = field(default_factory=list)
    mults: list[int] = field(default_factory=list)
    regions_key: tuple[int, ...] = ()
    key: tuple[tuple[int, ...], tuple[int, ...], bool] = ((), (), False)

    def add(self, region: int, mult: int) -> None:
        """Region ``region``'s rows start ``mult`` units past ``base``."""
        self.regions.append(region)
        self.mults.append(mult)

    def seal(self, interned: dict[tuple[tuple[int, ...], tuple[int, ...], bool], int]) -> int:
        """Every region added: the keys a request's piece of these rows is filed under, and their
        number in ``interned`` (a cheap dict key per request)."""
        self.regions_key = tuple(self.regions)
        self.key = (self.regions_key, tuple(self.mults), self.logits)
        return interned.setdefault(self.key, len(interned))
