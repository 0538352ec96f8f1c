"""The fingerprint custom op: the bits of ``fingerprint_rows``, kept by ``torch.compile`` (not
dead-code-eliminated, in program order, no graph break), recorded by CUDA-graph capture (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from isoaudit.collectors.fingerprint_op import INT_WIDTH, FingerprintBuffers, record, slot_rows
from isoaudit.collectors.fingerprints import (
    FLOAT_WIDTH,
    default_ladder_bits,
    fingerprint_rows,
    fingerprint_rows_into,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _assert_same(got, want) -> None:
    for name in ("digest", "ladder", "sketch", "l2", "maxabs"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), name
    assert tuple(got.ladder_bits) == tuple(want.ladder_bits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_writes_the_bits_of_fingerprint_rows(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 5, 96, generator=gen) * 3).to(dtype)
    buffers = FingerprintBuffers(slots=3, rows=10, device="cpu")
    buffers.write(1, x)
    bits = default_ladder_bits(dtype)
    got = buffers.to_host([bits, bits, bits])
    _assert_same(got[1], fingerprint_rows(x).to_host())
    assert not buffers.ints[0].any() and not buffers.ints[2].any()  # the other slots untouched


def test_explicit_ladder_and_direct_call() -> None:
    x = torch.randn(7, 33, dtype=torch.float32)
    ints = torch.zeros(7, INT_WIDTH, dtype=torch.int64)
    floats = torch.zeros(7, FLOAT_WIDTH, dtype=torch.float32)
    torch.ops.isoaudit.fingerprint_rows_(x, ints, floats, [20, 9, 0])
    got = slot_rows(ints.numpy(), floats.numpy(), [20, 9, 0])
    _assert_same(got, fingerprint_rows(x, [20, 9, 0]).to_host())


def test_buffers_that_do_not_fit_are_named() -> None:
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ints: expected torch.int64 \\[4, >= 5\\]"):
        fingerprint_rows_into(x, torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, FLOAT_WIDTH))
    with pytest.raises(ValueError, match="floats"):
        fingerprint_rows_into(x, torch.zeros(4, INT_WIDTH, dtype=torch.int64), torch.zeros(3, FLOAT_WIDTH))


def test_opcheck() -> None:
    """torch's own checks of a custom op: schema (declared mutation), fake tensor, dispatch."""
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    ints = torch.zeros(6, INT_WIDTH, dtype=torch.int64)
    floats = torch.zeros(6, FLOAT_WIDTH, dtype=torch.float32)
    torch.library.opcheck(
        torch.ops.isoaudit.fingerprint_rows_.default,
        (x, ints, floats, list(default_ladder_bits(x.dtype))),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


class _Block(torch.nn.Module):
    """Two regions whose outputs only the fingerprint op reads (nothing else uses ``a``)."""

    def __init__(self, buffers: FingerprintBuffers) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.buffers = buffers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        self.buffers.write(0, a)  # a region output the result does not depend on
        b = torch.relu(a) * 2
        self.buffers.write(1, b)
        a.add_(1.0)  # written after the fingerprint: the op must have read it before
        return b.sum(-1)


def test_compiled_graph_keeps_the_op_in_order_without_breaks() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    eager_buf = FingerprintBuffers(2, 8, "cpu")
    block = _Block(eager_buf)
    want = block(x)

    compiled_buf = FingerprintBuffers(2, 8, "cpu")
    block.buffers = compiled_buf
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    fn = torch.compile(block, backend="inductor", fullgraph=True)
    got = fn(x)
    torch.testing.assert_close(got, want)  # inductor's sum may round differently; regions are exact
    assert compiled_buf.ints.any(), "the op was dropped from the compiled graph"
    assert torch.equal(compiled_buf.ints, eager_buf.ints)
    assert torch.equal(compiled_buf.floats, eager_buf.floats)
    # a second call rewrites the same buffers (the graph's own storage), with no recompile
    compiled_buf.ints.zero_()
    fn(x)
    assert torch.equal(compiled_buf.ints, eager_buf.ints)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replay_writes_fingerprints(dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    lin = torch.nn.Linear(256, 256, device=dev, dtype=dtype)
    x = torch.randn(16, 256, device=dev, dtype=dtype)
    buffers = FingerprintBuffers(1, 16, dev)
    static_x = x.clone()

    def step() -> torch.Tensor:
        h = lin(static_x)
        buffers.write(0, h)
        return h

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for seed in (1, 2):
            static_x.copy_(
                torch.randn(
                    16, 256, device=dev, dtype=dtype, generator=torch.Generator(dev).manual_seed(seed)
                )
            )
            buffers.ints.zero_()
            graph.replay()
            got = buffers.to_host([default_ladder_bits(dtype)])[0]
            _assert_same(got, fingerprint_rows(out).to_host())


def test_record_defaults_the_ladder() -> None:
    x = torch.randn(3, 8, dtype=torch.float16)
    ints = torch.zeros(3, INT_WIDTH, dtype=torch.int64)
    floats = torch.zeros(3, FLOAT_WIDTH)
    record(x.requires_grad_(), ints, floats)
    _assert_same(
        slot_rows(ints.numpy(), floats.numpy(), default_ladder_bits(x.dtype)), fingerprint_rows(x).to_host()
    )


# ------------------------------------------------------------------ the row-index variant


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_index_rows_write_the_bits_of_the_selected_rows(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 4, 48, generator=gen) * 2).to(dtype)
    residual = (torch.randn(3, 4, 48, generator=gen) * 2).to(dtype) if with_residual else None
    index = torch.tensor([7, 0, 11, 3, 3, 0, 0, 0])  # 5 real rows, then padding
    count = torch.tensor([5])
    buffers = FingerprintBuffers(slots=2, rows=8, device="cpu")
    buffers.write_rows(1, x, index, count, residual)
    flat = x.reshape(-1, 48)
    rows = flat[index[:5]] + (residual.reshape(-1, 48)[index[:5]] if residual is not None else 0)
    bits = default_ladder_bits(dtype)
    got = buffers.to_host([bits, bits])[1]
    want = fingerprint_rows(rows).to_host()
    _assert_same(slot_rows(buffers.ints[1, :5].numpy(), buffers.floats[1, :5].numpy(), bits), want)
    assert not got.digest[5:].any() and not buffers.ints[0].any()  # past the count, other slots untouched
    # no count: every row of the (padded) index, a fixed amount of work as CUDA-graph replay needs
    buffers.write_rows(0, x, index, None, residual)
    padded = flat[index] + (residual.reshape(-1, 48)[index] if residual is not None else 0)
    _assert_same(buffers.to_host([bits, bits])[0], fingerprint_rows(padded).to_host())


def test_index_rows_count_zero_writes_nothing() -> None:
    x = torch.randn(4, 16)
    buffers = FingerprintBuffers(1, 4, "cpu")
    buffers.write_rows(0, x, torch.arange(4), torch.zeros(1, dtype=torch.long))
    assert not buffers.ints.any() and not buffers.floats.any()
    assert (
        buffers.nbytes == buffers.ints.nbytes + buffers.floats.nbytes == 4 * (INT_WIDTH * 8 + FLOAT_WIDTH * 4)
    )


def test_index_rows_opcheck() -> None:
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    r = torch.randn(6, 40, dtype=torch.bfloat16)
    ints = torch.zeros(6, INT_WIDTH, dtype=torch.int64)
    floats = torch.zeros(6, FLOAT_WIDTH, dtype=torch.float32)
    bits = list(default_ladder_bits(x.dtype))
    for args in (
        (x, r, torch.tensor([5, 1, 2]), torch.tensor([2]), ints, floats, bits),
        (x, None, torch.tensor([5, 1, 2]), None, ints, floats, bits),
    ):
        torch.library.opcheck(
            torch.ops.isoaudit.fingerprint_index_rows_.default,
            args,
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


def test_index_rows_in_a_compiled_graph() -> None:
    """Rows chosen by a buffer the host fills between calls, with the count in a tensor: one compile,
    the op kept, the bits of the eager op for each selection."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(32, 32)
    index = torch.zeros(8, dtype=torch.long)
    count = torch.zeros(1, dtype=torch.long)
    buffers = FingerprintBuffers(1, 8, "cpu")

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        buffers.write_rows(0, h, index, count)
        return h * 2

    fn = torch.compile(forward, backend="inductor", fullgraph=True)
    x = torch.randn(10, 32)
    for rows in ([3, 1], [9, 0, 4, 5, 2]):
        index[: len(rows)] = torch.tensor(rows)
        count[0] = len(rows)
        buffers.ints.zero_()
        with torch.no_grad():
            fn(x)
            want = fingerprint_rows(lin(x)[rows]).to_host()
        bits = default_ladder_bits(torch.float32)
        n = len(rows)
        _assert_same(slot_rows(buffers.ints[0, :n].numpy(), buffers.floats[0, :n].numpy(), bits), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_with_a_padded_index() -> None:
    """No count: the fixed-length index is captured once; the host refills it between replays."""
    dev = torch.device("cuda")
    lin = torch.nn.Linear(256, 256, device=dev, dtype=torch.bfloat16)
    static_x = torch.randn(16, 256, device=dev, dtype=torch.bfloat16)
    index = torch.zeros(6, dtype=torch.long, device=dev)
    buffers = FingerprintBuffers(1, 6, dev)

    def step() -> torch.Tensor:
        h = lin(static_x)
        buffers.write_rows(0, h, index)
        return h

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for rows in ([3, 15, 0], [1, 2, 4, 8, 9, 10]):
            index.copy_(torch.tensor(rows + [0] * (6 - len(rows)), device=dev))
            graph.replay()
            got = buffers.to_host([default_ladder_bits(torch.bfloat16)])[0]
            want = fingerprint_rows(out[index]).to_host()
            _assert_same(got, want)
