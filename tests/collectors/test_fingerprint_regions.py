"""Regions held for the forward's end and fingerprinted together: grouping, the kernel's table,
mutation detection, the byte cap, and the op; every slot the bits of the region fingerprinted alone."""

from __future__ import annotations

import pytest
import torch
from isoaudit.collectors.fingerprint_op import INT_WIDTH, FingerprintBuffers
from isoaudit.collectors.fingerprint_regions import (
    TABLE_WIDTH,
    HeldRegions,
    Region,
    fingerprint_regions_into,
    groups,
    plan_regions,
)
from isoaudit.collectors.fingerprints import (
    FLOAT_WIDTH,
    _constants,
    _format,
    default_ladder_bits,
    fingerprint_rows_into,
)
from isoaudit.kernels._triton import HAVE_TRITON, use_triton

FP32 = default_ladder_bits(torch.float32)


def _regions() -> list[Region]:
    """fp32 rows of two widths (two groups), one of them a row-strided view, and a column-strided
    view the kernel cannot read where it lies."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 96, generator=g)
    b = torch.randn(6, 2 * 96, generator=g)
    c = torch.randn(6, 40, generator=g)
    d = torch.randn(40, 6, generator=g).t()  # column stride 6
    return [
        Region(4, a, FP32),
        Region(0, c, FP32),
        Region(2, b[:, 96:], FP32),
        Region(1, d, FP32),
        Region(3, c * 2, FP32),
    ]


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and bool(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
    )


def test_groups_by_dtype_width_and_ladder_and_builds_the_table() -> None:
    regions = _regions()
    if not (HAVE_TRITON and use_triton(regions[0].rows)):
        pytest.skip("needs Triton's interpreter on the CPU")
    found = groups(regions, impl="triton")
    assert [(k[1], [r.slot for r in v]) for k, v in found.items()] == [(96, [4, 2]), (40, [0, 3])]
    assert groups(regions) == {}  # the CPU without forcing: no kernel, every region alone
    plan = plan_regions(regions, impl="triton")  # the 96-wide group is listed first
    values = plan.table_values([regions[i].rows.data_ptr() for i in plan.fused])[
        : 3 * len(found[(torch.float32, 96, FP32)])
    ]
    assert values == [regions[0].rows.data_ptr(), 96, 4, regions[2].rows.data_ptr(), 192, 2]


@pytest.mark.parametrize("table", [False, True])
def test_fused_slots_equal_each_region_alone(table: bool) -> None:
    """Under the interpreter (fp32): fused groups and the region left alone land in their slots
    with the bits of the per-region kernel (fused) or the per-region torch path (alone)."""
    regions = _regions()
    if not (HAVE_TRITON and use_triton(regions[0].rows)):
        pytest.skip("needs Triton's interpreter on the CPU")
    from isoaudit.kernels.fingerprint import fingerprint_rows

    buffers = FingerprintBuffers(5, 6, "cpu")
    given = torch.zeros(5, TABLE_WIDTH, dtype=torch.int64) if table else None
    values = fingerprint_regions_into(regions, buffers.ints, buffers.floats, given, impl="triton")
    assert len(values) == 4 * TABLE_WIDTH  # the column-strided one went alone
    if given is not None:
        assert given.reshape(-1)[: len(values)].tolist() == values
    r = len(FP32)
    for region in regions:
        ints, floats = buffers.views(region.slot)
        if region.slot == 1:  # alone: the torch path into fresh buffers
            want_i = torch.zeros(6, INT_WIDTH, dtype=torch.int64)
            want_f = torch.zeros(6, FLOAT_WIDTH, dtype=torch.float32)
            fingerprint_rows_into(region.rows, want_i, want_f, FP32)
            assert _bits_equal(ints[:, : 1 + r], want_i[:, : 1 + r]) and _bits_equal(floats, want_f)
            continue
        hidden = region.rows.shape[1]
        want = fingerprint_rows(
            region.rows, *_constants(hidden, torch.device("cpu"), _format(torch.float32), FP32), impl="triton"
        )
        assert _bits_equal(ints[:, 0], want.digest), region.slot
        assert _bits_equal(ints[:, 1 : 1 + r], want.ladder), region.slot
        assert _bits_equal(floats[:, :16], want.sketch), region.slot
        assert _bits_equal(floats[:, 16], want.l2) and _bits_equal(floats[:, 17], want.maxabs), region.slot


def test_the_op_equals_the_per_region_path_on_the_cpu() -> None:
    """The registered multi-region op (what compiled forwards call): on the CPU each region through
    the per-region torch path, the same bits as the single-region op's."""
    regions = _regions()
    xs = [r.rows.reshape(2, 3, -1) for r in regions if r.rows.is_contiguous()]
    slots = [4, 0, 3]
    got = FingerprintBuffers(5, 6, "cpu")
    torch.ops.isoaudit.fingerprint_regions_(xs, slots, got.ints, got.floats)
    want = FingerprintBuffers(5, 6, "cpu")
    for x, slot in zip(xs, slots, strict=True):
        want.write(slot, x)
    assert _bits_equal(got.ints, want.ints) and _bits_equal(got.floats, want.floats)


def test_the_ops_plan_serves_every_call_of_its_layout() -> None:
    """The op works its plan out once per layout of its inputs: later calls with other values (a
    region whose rows a reshape cannot view among them, copied each call) write the buffers
    bit for bit as the plan made afresh does; fused under Triton's interpreter where it runs."""
    from isoaudit.collectors import fingerprint_regions as fr

    g = torch.Generator().manual_seed(5)

    def inputs() -> list[torch.Tensor]:
        a = torch.randn(2, 3, 96, generator=g)
        b = torch.randn(3, 2, 96, generator=g).transpose(0, 1)  # [2, 3, 96]: its rows are a copy
        c = torch.randn(2, 3, 40, generator=g)
        return [a, b, c, a[..., :40] * 2]

    slots = [2, 0, 4, 1]
    first = inputs()
    impl = "triton" if HAVE_TRITON and use_triton(first[0]) else None
    plan = fr._OpPlan.of(first, slots, impl)
    if impl is not None:
        assert sorted(plan.plan.fused) == [0, 1, 2, 3] and plan.copied == (1,)
    for xs in (first, inputs()):
        got, want = FingerprintBuffers(5, 6, "cpu"), FingerprintBuffers(5, 6, "cpu")
        plan.run(xs, got.ints, got.floats)
        fresh = [Region(s, fr._rows_of(x), FP32) for x, s in zip(xs, slots, strict=True)]
        fingerprint_regions_into(fresh, want.ints, want.floats, impl=impl)
        assert _bits_equal(got.ints, want.ints) and _bits_equal(got.floats, want.floats)
    before = len(fr._OP_PLANS)
    for xs in (inputs(), inputs()):  # the registered op: one plan for both calls
        got, want = FingerprintBuffers(5, 6, "cpu"), FingerprintBuffers(5, 6, "cpu")
        torch.ops.isoaudit.fingerprint_regions_(xs, slots, got.ints, got.floats)
        for x, slot in zip(xs, slots, strict=True):
            want.write(slot, x)
        assert _bits_equal(got.ints, want.ints) and _bits_equal(got.floats, want.floats)
    assert len(fr._OP_PLANS) == min(before + 1, fr._MAX_OP_PLANS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_ops_device_table_is_copied_only_when_the_rows_moved() -> None:
    """On CUDA the op keeps its table on the device: the same rows again reuse it, rows elsewhere
    rewrite it, and every call's slots are the per-region path's bit for bit."""
    from isoaudit.collectors import fingerprint_regions as fr

    g = torch.Generator(device="cuda").manual_seed(6)
    slots = [1, 0, 2]

    def inputs() -> list[torch.Tensor]:
        return [torch.randn(4, 5, 96, generator=g, device="cuda", dtype=torch.bfloat16) for _ in slots]

    first = inputs()
    plan = fr._OpPlan.of(first, slots, "triton")
    copies = []
    for xs in (first, first, inputs(), inputs()):
        got, want = FingerprintBuffers(3, 20, "cuda"), FingerprintBuffers(3, 20, "cuda")
        event = plan._event
        plan.run(xs, got.ints, got.floats)
        copies.append(plan._event is not event)
        for x, slot in zip(xs, slots, strict=True):
            want.write(slot, x)
        assert _bits_equal(got.ints, want.ints) and _bits_equal(got.floats, want.floats)
    assert copies == [True, False, True, True]


def test_held_regions_learn_mutation_and_respect_the_cap() -> None:
    held = HeldRegions(max_bytes=3 * 4 * 8)  # three [2, 4] fp32 regions
    xs = [torch.randn(2, 4) for _ in range(4)]
    assert (
        held.hold(0, xs[0], FP32) and held.hold(1, xs[1].detach(), FP32) and held.hold(2, xs[2][:, :4], FP32)
    )
    assert not held.hold(3, xs[3], FP32) and held.alone == {"over_cap": 1}
    xs[1].add_(1)  # written in place after its tap (through the tensor the view came from)
    keep, lost = held.take()
    assert [r.slot for r in keep] == [0, 2] and [r.slot for r in lost] == [1]
    assert held.mutated == {1} and not held.held and held.held_bytes == 0
    assert not held.hold(1, xs[1], FP32) and held.alone == {"over_cap": 1, "mutated": 1}
    assert held.hold(3, xs[3], FP32)  # the cap counts this forward's rows only


class _Toy(torch.nn.Module):
    """Three regions; the second's output is written in place after its tap."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        a = self.a(h)
        b = self.b(a)
        a.mul_(2)
        return b + a


def test_compiled_forward_holds_regions_and_writes_a_mutated_one_at_its_tap() -> None:
    """An eager forward learns that region ``a`` is written in place after its tap; the compiled
    forward then fingerprints ``a`` at its tap and the others together at its end: every slot the
    bits of its tap's value."""
    from isoaudit.collectors.fingerprints import fingerprint_rows
    from isoaudit.collectors.hooks import ForwardCapture
    from isoaudit.collectors.regions import RegionSpec

    torch.manual_seed(0)
    model = _Toy()
    specs = [RegionSpec("embed", "embed"), RegionSpec("a", "a"), RegionSpec("b", "b")]
    capture = ForwardCapture(model, specs)
    ids = torch.randint(0, 16, (2, 3))
    try:
        with torch.no_grad():
            model(ids)  # eager: the taps' versions checked at the forward's end
            assert capture.mutated == {1}
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True)
            compiled(ids)  # traced: buffers come from the next step on
            capture.prepare_compiled(tuple(ids.shape), torch.device("cpu"))
            compiled(ids)
            got = capture.take_compiled(ids)
            h = model.embed(ids)
            a = model.a(h)
            want = {"embed": h, "a": a, "b": model.b(a)}
    finally:
        capture.remove()
        torch._dynamo.reset()
    assert got is not None and sorted(k for k, _ in got.prints) == ["a", "b", "embed"]
    for (name, _), prints in got.prints.items():
        ref = fingerprint_rows(want[name].reshape(-1, 8))
        for field in ("digest", "ladder", "l2", "maxabs"):
            assert _bits_equal(getattr(prints, field), getattr(ref, field)), (name, field)
