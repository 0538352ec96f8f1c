"""Every region of a forward fingerprinted together at the forward's end: one kernel launch per
group of regions sharing dtype, width and ladder, instead of one launch (and one op dispatch) per
region (DESIGN.md, "Fingerprints"; docs/design.md, "Fingerprints in compiled graphs").

A forward with every region fingerprinted has over a hundred regions; at decode row counts each
region's pass is a single program, so a per-region launch costs its whole latency serially, and
under ``torch.compile`` each region is a Python-dispatched op. Here the taps only *hold* each
region's rows (a reference: no copy) and :func:`fingerprint_regions_into` fingerprints all of them
in one launch per group through :func:`isoaudit.kernels.fingerprint.fingerprint_regions`, which
shares its per-row arithmetic with the per-region kernel: the same bits by construction.

Held rows must still hold the tap's values at the end of the forward: a region whose tensor was
written in place after its tap (its version counter moved) cannot be deferred.
:class:`HeldRegions` finds those in the forwards it sees and writes them at their tap from then
on. Where the kernel does not run (the CPU, fp64, rows that are not a plain strided view) each
region goes through :func:`isoaudit.collectors.fingerprints.fingerprint_rows_into`, as before.

``torch.ops.isoaudit.fingerprint_regions_`` is the group as one registered op (a ``Tensor[]``
input, mutating the two buffers) for compiled forwards: the host dispatches it once per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import torch
from isoaudit.collectors.fingerprints import (
    _constants,
    _format,
    _triton_pass,
    default_ladder_bits,
    fingerprint_rows_into,
)
from isoaudit.kernels._triton import use_triton

#: The multi-region op's qualified name (namespace ``isoaudit``).
OP_NAME = "isoaudit::fingerprint_regions_"

#: Int64 columns per region in the kernel's table: address, row stride, output slot.
TABLE_WIDTH = 3


@dataclass(frozen=True)
class Region:
    """One region's rows held for the end of the forward: ``rows`` [n, hidden] written to ``slot``
    with rungs ``bits``."""

    slot: int
    rows: torch.Tensor
    bits: tuple[int, ...]


def fused_rows(rows: torch.Tensor, impl: str | None = None) -> bool:
    """Whether the multi-region kernel reads ``rows`` where they lie: 2-D, unit column stride, a
    fused dtype, and the kernel runs there (``impl=None``: on CUDA where the Triton pass imports, as
    :func:`~isoaudit.collectors.fingerprints.fingerprint_rows_into` decides; ``"triton"``: wherever
    Triton runs, the CPU under its interpreter included; ``"torch"``: never)."""
    if rows.dim() != 2 or rows.stride(1) != 1 or rows.dtype not in _FUSED_DTYPES or impl == "torch":
        return False
    if impl == "triton":
        return use_triton(rows)
    return rows.device.type == "cuda" and _triton_pass() is not None


_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

GroupKey = tuple[torch.dtype, int, tuple[int, ...]]


def groups(regions: Sequence[Region], impl: str | None = None) -> dict[GroupKey, list[Region]]:
    """The fused regions by (dtype, width, rungs), in first-seen order: one launch each (the digest
    weights, sketch and masks are per width and dtype). Regions the kernel cannot read
    (:func:`fused_rows`) are left out."""
    out: dict[GroupKey, list[Region]] = {}
    for region in regions:
        if fused_rows(region.rows, impl):
            out.setdefault((region.rows.dtype, int(region.rows.shape[1]), region.bits), []).append(region)
    return out


@dataclass(frozen=True)
class RegionsPlan:
    """How :func:`run_plan` fingerprints a list of regions laid out one way (their rows' shapes,
    strides, dtypes and devices, and their slots): which go alone, which are listed in the table,
    and one launch per :func:`groups` entry. It depends on nothing else, so a caller whose layout
    repeats (a compiled forward, step after step) works it out once."""

    alone: tuple[tuple[int, int, tuple[int, ...]], ...]  # (region, slot, rungs), one by one
    fused: tuple[int, ...]  # the regions listed in the table, in its order
    row_strides: tuple[int, ...]  # of each fused region's rows, in table order
    slots: tuple[int, ...]  # of each fused region, in table order
    #: per group: (first table row, regions, rows each, width, dtype, rungs)
    launches: tuple[tuple[int, int, int, int, torch.dtype, tuple[int, ...]], ...]

    def table_values(self, addresses: Sequence[int]) -> list[int]:
        """The kernel's table rows, flattened, for the fused regions' data ``addresses``."""
        values = [0] * (TABLE_WIDTH * len(self.fused))
        values[0::TABLE_WIDTH] = addresses
        values[1::TABLE_WIDTH] = self.row_strides
        values[2::TABLE_WIDTH] = self.slots
        return values


def plan_regions(regions: Sequence[Region], impl: str | None = None) -> RegionsPlan:
    """The :class:`RegionsPlan` of ``regions`` (``impl``: as for :func:`fused_rows`)."""
    fused = groups(regions, impl)
    index = {id(region): i for i, region in enumerate(regions)}
    ordered = [index[id(r)] for members in fused.values() for r in members]
    listed = set(ordered)
    launches = []
    start = 0
    for (dtype, hidden, bits), members in fused.items():
        launches.append((start, len(members), int(members[0].rows.shape[0]), hidden, dtype, bits))
        start += len(members)
    return RegionsPlan(
        alone=tuple((i, r.slot, r.bits) for i, r in enumerate(regions) if i not in listed),
        fused=tuple(ordered),
        row_strides=tuple(int(regions[i].rows.stride(0)) for i in ordered),
        slots=tuple(regions[i].slot for i in ordered),
        launches=tuple(launches),
    )


def run_plan(
    plan: RegionsPlan,
    rows: Sequence[torch.Tensor],
    ints: torch.Tensor,
    floats: torch.Tensor,
    table: torch.Tensor | None = None,
    write_table: bool = True,
    values: list[int] | None = None,
) -> list[int]:
    """Fingerprint the regions ``plan`` was worked out for, whose rows are ``rows`` now (in the
    plan's order; one left alone may be given in any shape :func:`fingerprint_rows_into` takes),
    as :func:`fingerprint_regions_into` does (``values``: the table's, when the caller has them)."""
    for i, slot, bits in plan.alone:
        fingerprint_rows_into(rows[i], ints[slot], floats[slot], bits)
    if not plan.fused:
        return []
    from isoaudit.kernels.fingerprint import fingerprint_regions, rows_aligned

    if values is None:
        values = plan.table_values([rows[i].data_ptr() for i in plan.fused])
    device = rows[plan.fused[0]].device
    if table is None:
        host = torch.tensor(values, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=True).reshape(-1, TABLE_WIDTH)
    elif write_table:
        table.reshape(-1)[: len(values)].copy_(torch.tensor(values, dtype=torch.int64))
    for start, count, n, hidden, dtype, bits in plan.launches:
        weights, sketch, masks = _constants(hidden, device, _format(dtype), bits)
        stop = start + count
        aligned = rows_aligned(
            values[TABLE_WIDTH * start : TABLE_WIDTH * stop : TABLE_WIDTH],
            plan.row_strides[start:stop],
            dtype,
        )
        fingerprint_regions(
            table[start:], count, n, hidden, dtype, weights, sketch, masks, ints, floats, aligned
        )
    return values


def fingerprint_regions_into(
    regions: Sequence[Region],
    ints: torch.Tensor,
    floats: torch.Tensor,
    table: torch.Tensor | None = None,
    write_table: bool = True,
    impl: str | None = None,
) -> list[int]:
    """Fingerprint every region's rows into slot ``region.slot`` of ``ints``/``floats`` (int64 and
    float32 ``[slots, n, width]``, as :class:`~isoaudit.collectors.fingerprint_op.FingerprintBuffers`
    holds them): one launch per :func:`groups` entry, the others one by one. The same bits as
    :func:`~isoaudit.collectors.fingerprints.fingerprint_rows_into` of each region alone.

    ``table``: int64 ``[>= regions, 3]`` on the device to list the fused regions in (default: a
    fresh one per call, copied from pinned memory without a sync). ``write_table=False`` leaves it
    unwritten (a launch captured into a CUDA graph reads it at replay: the caller writes the
    returned values into it after the capture). ``impl``: as for :func:`fused_rows`. Returns the
    table's values, flattened (empty: nothing was fused)."""
    plan = plan_regions(regions, impl)
    return run_plan(plan, [r.rows for r in regions], ints, floats, table, write_table)


@dataclass
class HeldRegions:
    """The regions one forward's taps held, and what earlier forwards taught: which slots are
    written in place after their tap (so are written at their tap from then on).

    ``max_bytes`` bounds the activation memory held until the forward's end (the rows stay
    allocated: a captured graph's pool cannot reuse them, which is what keeps them readable at
    replay): rows x width x element size per region, summed; regions past it are written at their
    tap."""

    max_bytes: int = 256 << 20
    held: list[tuple[Region, int]] = field(default_factory=list)  # (region, version at tap)
    held_bytes: int = 0
    mutated: set[int] = field(default_factory=set)
    #: per reason, the regions written at their tap instead ("mutated", "over_cap")
    alone: dict[str, int] = field(default_factory=dict)

    def hold(self, slot: int, rows: torch.Tensor, bits: tuple[int, ...]) -> bool:
        """Hold ``rows`` for the end of the forward; False: write it now (written in place after
        its tap in an earlier forward, or over the byte cap)."""
        reason = None
        size = rows.numel() * rows.element_size()
        if slot in self.mutated:
            reason = "mutated"
        elif self.held_bytes + size > self.max_bytes:
            reason = "over_cap"
        if reason is not None:
            self.alone[reason] = self.alone.get(reason, 0) + 1
            return False
        self.held.append((Region(slot, rows, bits), rows._version))
        self.held_bytes += size
        return True

    def take(self) -> tuple[list[Region], list[Region]]:
        """End of the forward: (regions still holding their tap's values, regions written in place
        since, now known as mutated and written at their tap in later forwards). Forgets them."""
        held, self.held, self.held_bytes = self.held, [], 0
        keep, lost = [], []
        for region, version in held:
            if region.rows._version == version:
                keep.append(region)
            else:
                lost.append(region)
                self.mutated.add(region.slot)
        return keep, lost


# Registered through ``torch.library.Library`` (as fingerprint_op's row-index op): a list input and
# a few microseconds of dispatch.
_lib = torch.library.Library("isoaudit", "FRAGMENT")
_lib.define("fingerprint_regions_(Tensor[] xs, int[] slots, Tensor(a!) ints, Tensor(b!) floats) -> ()")


def _fingerprint_regions_op(
    xs: Sequence[torch.Tensor], slots: Sequence[int], ints: torch.Tensor, floats: torch.Tensor
) -> None:
    """Fingerprint ``xs[k]`` (rows = leading dims flattened; its dtype's default ladder) into slot
    ``slots[k]`` of ``ints``/``floats`` ([slots, rows, width]); the table is built per call, the
    plan once per layout of ``xs`` (:class:`_OpPlan`)."""
    key = (
        *map(_size, xs),
        *map(_stride, xs),
        *map(_dtype, xs),
        *map(_device, xs),
        *slots,
    )
    found = _OP_PLANS.get(key)
    if found is None:
        found = _OP_PLANS[key] = _OpPlan.of(xs, slots)
        while len(_OP_PLANS) > _MAX_OP_PLANS:  # the oldest layout goes
            del _OP_PLANS[next(iter(_OP_PLANS))]
    found.run(xs, ints, floats)


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows: leading dims flattened (a scalar: one row of one)."""
    return x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)


class _OpPlan:
    """The op's :class:`RegionsPlan` for one layout of its inputs, which fused inputs' rows are a
    copy (a reshape that cannot view them; the others are read where the input lies, so a step's
    call reads their addresses and reshapes nothing), and the kernel's table on the device: a
    compiled step's activations tend to land at the same addresses every step, so the table is
    copied over only when they moved, from a pinned buffer of its own."""

    def __init__(self, plan: RegionsPlan, copied: tuple[int, ...]) -> None:
        self.plan = plan
        self.copied = copied
        self._values: list[int] | None = None  # what the device table holds
        self._table: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None  # the last copy from _host, queued

    @classmethod
    def of(cls, xs: Sequence[torch.Tensor], slots: Sequence[int], impl: str | None = None) -> _OpPlan:
        """The plan of inputs laid out as ``xs`` (``impl``: as for :func:`fused_rows`)."""
        regions = [
            Region(int(slot), _rows_of(x), default_ladder_bits(x.dtype))
            for x, slot in zip(xs, slots, strict=True)
        ]
        plan = plan_regions(regions, impl)
        copied = tuple(i for i in plan.fused if regions[i].rows.data_ptr() != xs[i].data_ptr())
        return cls(plan, copied)

    def run(self, xs: Sequence[torch.Tensor], ints: torch.Tensor, floats: torch.Tensor) -> None:
        """The op's work on ``xs``, laid out as this plan's inputs were."""
        rows = list(xs)
        for i in self.copied:  # rows a reshape could not view: made again each call
            rows[i] = _rows_of(xs[i])
        table, values = None, None
        if self.plan.fused:
            device = rows[self.plan.fused[0]].device
            if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                values = self.plan.table_values([rows[i].data_ptr() for i in self.plan.fused])
                table = self._device_table(values, device)
        run_plan(self.plan, rows, ints, floats, table, write_table=False, values=values)

    def _device_table(self, values: list[int], device: torch.device) -> torch.Tensor:
        """The device table holding ``values`` (copied only if it held others)."""
        if self._table is None or self._host is None:
            self._table = torch.empty(len(values), dtype=torch.int64, device=device)
            self._host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        if values != self._values:
            if self._event is not None:
                self._event.synchronize()  # the last copy has left the pinned buffer (long since)
            self._host.numpy()[:] = values
            self._table.copy_(self._host, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._values = values
        return self._table.reshape(-1, TABLE_WIDTH)


#: Plans by layout of the op's inputs (shapes, strides, dtypes, devices, slots): a batch shape each.
_OP_PLANS: dict[tuple[object, ...], _OpPlan] = {}
_MAX_OP_PLANS = 64
_size, _stride = torch.Tensor.size, torch.Tensor.stride
_dtype, _device = attrgetter("dtype"), attrgetter("device")


_lib.impl("fingerprint_regions_", _fingerprint_regions_op, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME)
def _fingerprint_regions_fake(
    xs: Sequence[torch.Tensor], slots: Sequence[int], ints: torch.Tensor, floats: torch.Tensor
) -> None:
    """Shapes only: the op writes its buffers in place and returns nothing."""
    return None


def record_regions(
    xs: Sequence[torch.Tensor], slots: Sequence[int], ints: torch.Tensor, floats: torch.Tensor
) -> None:
    """Call the multi-region op on ``xs`` into ``slots`` of the two buffers. The tensors go in as
    they are (the op detaches them itself): a ``detach()`` here is one more alias of a graph
    intermediate in a traced training step, and the view replay of an output sharing its base
    (the logits) then reads garbage sizes."""
    torch.ops.isoaudit.fingerprint_regions_(list(xs), [int(s) for s in slots], ints, floats)
