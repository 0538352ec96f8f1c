"""The cached launch (isoaudit.kernels._triton.CachedLauncher): the argument layout it hands Triton's C
launcher, the scratch rule, the fallbacks, and the host-side shortcuts gemm takes. The CPU tests
drive fake launchers; the `gpu` ones compare bits and host time against Triton's own launch."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from isoaudit.kernels import _triton
from isoaudit.kernels._triton import (
    CachedLauncher,
    aligned,
    as_rows,
    launch_layout,
    tma_ready,
)

from bench.common import host_us

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton

_FIELDS = dict(
    num_ctas=1,
    global_scratch_size=0,
    global_scratch_align=1,
    profile_scratch_size=0,
    launch_cooperative_grid=False,
    launch_pdl=False,
)


class _Calls:
    """A stand-in C ``launch`` that records its positional arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args) -> None:
        self.calls.append(args)


def _launcher_36(**fields):
    class CudaLauncher:  # the name and __call__ signature of Triton 3.6's launcher
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            raise AssertionError("the direct launch must not go through __call__")

    run = CudaLauncher()
    run.launch = _Calls()
    for k, v in {**_FIELDS, **fields}.items():
        setattr(run, k, v)
    return run


def _launcher_39(**fields):
    class CudaLauncher:  # Triton 3.9's
        def __call__(
            self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
            launch_enter_hook, launch_exit_hook, *args,
        ):  # fmt: skip
            raise AssertionError("the direct launch must not go through __call__")

    run = CudaLauncher()
    run.launch = _Calls()
    run.arg_annotations, run.kernel_signature, run.gsan_enabled = ["ann"], b"sig", False
    for k, v in {**_FIELDS, **fields}.items():
        setattr(run, k, v)
    return run


@pytest.fixture
def fake_cuda(monkeypatch):
    """The torch CUDA queries the direct launch makes, answered without CUDA (device 0, stream 77)."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 77, raising=False)


def test_launch_layout_known_releases() -> None:
    assert launch_layout(_launcher_36(), "3.6.0") == "3.6"
    assert launch_layout(_launcher_39(), "3.9.1") == "3.9"
    assert launch_layout(_launcher_36(), "3.7.0") is None  # a release whose layout was not read
    assert launch_layout(_launcher_36(), "3.9.0") is None  # the signature is not that release's
    assert launch_layout(_launcher_39(), "3.6.0") is None


def test_launch_layout_refuses_the_unexpected() -> None:
    assert launch_layout(_launcher_36(profile_scratch_size=64), "3.6.0") is None
    run = _launcher_39()
    run.gsan_enabled = True
    assert launch_layout(run, "3.9.0") is None
    run = _launcher_36()
    del run.launch_pdl
    assert launch_layout(run, "3.6.0") is None
    run = _launcher_39()
    del run.kernel_signature
    assert launch_layout(run, "3.9.0") is None

    class Other:
        def __call__(self, gridX, gridY, gridZ, stream, function, *args): ...

    other = Other()
    for k, v in {**_FIELDS, "launch": _Calls()}.items():
        setattr(other, k, v)
    assert launch_layout(other, "3.6.0") is None


def test_direct_launch_argument_layouts(fake_cuda) -> None:
    """The positions each release's C launcher reads (from its driver.py): grid, stream,
    function, cooperative, pdl, scratch and metadata in their places, constexprs after the args."""
    run = _launcher_36(launch_cooperative_grid=True)
    call = _triton._direct_launch(run, "fn", (4, 1, 0), ("C1", "C2"), "3.6")
    call((2, 3, 1), (10, 11))
    assert run.launch.calls == [
        (2, 3, 1, 77, "fn", True, False, None, None, (4, 1, 0), None, None, None, 10, 11, "C1", "C2")
    ]
    run = _launcher_39(launch_pdl=True)
    call = _triton._direct_launch(run, "fn", (4, 1, 0), ("C1",), "3.9")
    call((5, 1, 1), (10, 11))
    assert run.launch.calls == [
        (
            5,
            1,
            1,
            77,
            "fn",
            False,
            True,
            (4, 1, 0),
            None,
            None,
            None,
            None,
            None,
            ["ann"],
            b"sig",
            (10, 11, "C1"),
        )
    ]


def test_direct_launch_scratch_from_the_process_allocator(fake_cuda) -> None:
    """A launch that needs global scratch asks the allocator Triton would (here a foreign one) for
    grid * num_ctas * size bytes at Triton's alignment, on the launch's stream."""
    import contextvars

    asked = []

    def foreign(size: int, alignment: int, stream):
        asked.append((size, alignment, stream))
        return "buffer"

    def body():
        _triton.triton.set_allocator(foreign)
        run = _launcher_36(global_scratch_size=128, global_scratch_align=64, num_ctas=2)
        _triton._direct_launch(run, "fn", (4, 1, 0), (), "3.6")((3, 2, 1), (1,))
        return run.launch.calls

    calls = contextvars.copy_context().run(body)
    assert asked == [(3 * 2 * 2 * 128, 64, 77)]
    assert calls[0][7:9] == ("buffer", None)


class _FakeCompiled:
    def __init__(self, run) -> None:
        self.run, self.function, self.packed_metadata = run, "fn", (4, 1, 0)


class _FakeKernel:
    """Stands for a _LazyKernel: ``kernel[grid](*args, **constexprs)`` 'compiles' and records."""

    def __init__(self, run) -> None:
        self.compiled, self.launched = _FakeCompiled(run), []
        self.arg_names = ["x", "n", "BLOCK"]

    def built(self):
        return self

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((grid, args, kwargs))
            return self.compiled

        return launch


@pytest.fixture
def compiled_mode(monkeypatch, fake_cuda):
    """The launcher as on CUDA with Triton 3.6 (not the interpreter the CPU tests run under)."""
    monkeypatch.setattr(_triton, "interpreting", lambda: False)
    monkeypatch.setattr(_triton.triton, "__version__", "3.6.0")
    yield
    CachedLauncher.enabled = True


def test_cached_launcher_fills_then_launches_directly(compiled_mode) -> None:
    run = _launcher_36()
    kernel = _FakeKernel(run)
    launcher = CachedLauncher(kernel)
    launcher("key", (2, 1, 1), ("x0", 5), {"BLOCK": 64}, num_warps=4)  # the first call: Triton's
    assert len(kernel.launched) == 1 and run.launch.calls == []
    assert launcher._cache["key"].direct
    launcher("key", (3, 1, 1), ("x1", 6), {"BLOCK": 64}, num_warps=4)
    assert launcher.launch_cached("key", (4, 1, 1), (123, 7))  # raw pointers on a hit
    assert not launcher.launch_cached("other", (4, 1, 1), (123, 7))
    assert len(kernel.launched) == 1
    assert [c[:3] + c[13:] for c in run.launch.calls] == [(3, 1, 1, "x1", 6, 64), (4, 1, 1, 123, 7, 64)]


def test_cached_launcher_unknown_layout_goes_through_run(compiled_mode, monkeypatch) -> None:
    monkeypatch.setattr(_triton.triton, "__version__", "3.8.0")
    seen = []

    class CudaLauncher:
        def __call__(self, *args):
            seen.append(args)

    kernel = _FakeKernel(CudaLauncher())
    launcher = CachedLauncher(kernel)
    launcher("key", (2, 1, 1), ("x0", 5), {"BLOCK": 64})
    launcher("key", (3, 1, 1), ("x1", 6), {"BLOCK": 64})
    assert not launcher._cache["key"].direct
    assert seen == [(3, 1, 1, 77, "fn", (4, 1, 0), None, None, None, "x1", 6, 64)]


def test_cached_launch_failure_warns_and_falls_back(compiled_mode) -> None:
    run = _launcher_36()
    kernel = _FakeKernel(run)
    launcher = CachedLauncher(kernel)
    launcher("key", (2, 1, 1), ("x0", 5), {"BLOCK": 64})

    def broken(*args):
        raise TypeError("another layout")

    run.launch = broken
    launcher._cache["key"] = _triton._direct_launch(run, "fn", (4, 1, 0), (64,), "3.6")
    with pytest.warns(UserWarning, match="cached launch failed"):
        launcher("key", (3, 1, 1), ("x1", 6), {"BLOCK": 64})
    assert not CachedLauncher.enabled
    assert kernel.launched[-1][:2] == ((3, 1, 1), ("x1", 6))  # Triton's own launch served it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later calls go to Triton quietly
        launcher("key", (3, 1, 1), ("x2", 6), {"BLOCK": 64})
    assert len(kernel.launched) == 3


def test_direct_opt_out(compiled_mode, monkeypatch) -> None:
    monkeypatch.setattr(CachedLauncher, "direct", False)
    launcher = CachedLauncher(_FakeKernel(_launcher_36()))
    launcher("key", (2, 1, 1), ("x0", 5), {"BLOCK": 64})
    assert not launcher._cache["key"].direct


def test_as_rows_is_reshape() -> None:
    """``as_rows(x, k)`` has the shape and strides of ``x.reshape(-1, k)``, a view exactly when
    reshape's is (strides are part of Triton's specialisation)."""
    rng = random.Random(0)
    views = 0
    for _ in range(4000):
        nd = rng.choice([1, 2, 2, 2, 3])
        shape = [rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(nd)]
        strides = [rng.choice([0, 1, 2, 3, 7, 64]) for _ in range(nd)]
        x = torch.randn(2000).as_strided(shape, strides)
        k = shape[-1] if rng.random() < 0.9 else rng.choice([1, 2, 3])
        try:
            want = x.reshape(-1, k)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                as_rows(x, k)
            continue
        got = as_rows(x, k)
        views += got is x
        assert (got.shape, got.stride(), got.data_ptr() == x.data_ptr()) == (
            want.shape,
            want.stride(),
            want.data_ptr() == x.data_ptr(),
        ), (shape, strides, k)
    assert views > 500


def test_tma_ready_and_alignment_bits() -> None:
    assert tma_ready(1024, (4096, 1), 2)
    assert not tma_ready(1026, (4096, 1), 2)  # base
    assert not tma_ready(1024, (4097, 1), 2)  # rows
    assert not tma_ready(1024, (1, 4096), 2)  # inner stride
    assert tma_ready(1024, (4, 1), 4)
    base = torch.empty(64, dtype=torch.int8)
    for offs in [(0, 0, 0), (1, 0, 16), (0, 3, 0), (8, 16, 5)]:
        ts = [base[o:] for o in offs]
        pa, pw, pb = (t.data_ptr() for t in ts)
        # the key bits gemm computes inline from raw pointers
        assert (pa % 16 == 0) | (pw % 16 == 0) << 1 | (pb % 16 == 0) << 2 == aligned(*ts)


def test_gemm_out_strides_rule() -> None:
    for m, n in [(1, 0), (3, 0), (1, 1), (5, 1), (1, 7), (4, 4096)]:
        assert torch.empty(m, n).stride() == (max(n, 1), 1)


# -- on CUDA ------------------------------------------------------------------------------


def _gemm_module():
    import importlib

    return importlib.import_module("isoaudit.kernels.gemm")


def _triton_launch(fn):
    """``fn()`` with every launch through Triton's own ``kernel[grid](...)``."""
    CachedLauncher.enabled = False
    try:
        return fn()
    finally:
        CachedLauncher.enabled = True


@gpu
def test_direct_launch_bits_gpu() -> None:
    """gemm's cached launches (raw pointers into the C launcher) give the bits of Triton's own."""
    g = _gemm_module()
    torch.manual_seed(0)
    w = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    bias = torch.randn(4096, device="cuda").bfloat16()
    a = torch.randn(1024, 4096, device="cuda").bfloat16()
    for m in (1, 7, 64, 200, 1024):
        for b in (None, bias):
            want = _triton_launch(lambda m=m, b=b: g.gemm(a[:m], w, b))
            for _ in range(3):  # the first may fill the cache; the rest hit it
                assert bits_equal(g.gemm(a[:m], w, b), want), m
    x3 = torch.randn(2, 5, 4096, device="cuda").bfloat16()
    assert bits_equal(g.gemm(x3, w), _triton_launch(lambda: g.gemm(x3, w)))
    entries = list(g._LAUNCH._cache.values())
    assert entries
    for e in entries:  # the direct launch wherever the layout is known (on the H200: Triton 3.6)
        assert e.direct == (launch_layout(e.run) is not None)
    if _triton.triton.__version__.startswith(("3.6.", "3.9.")):
        assert all(e.direct for e in entries)


@gpu
def test_host_descriptor_launch_gpu() -> None:
    """The cached launch with host-built TMA descriptors (encoded once per buffer) gives the bits
    of kernel-built ones: the weight alone by TMA (one row, ``A_PTR``), all three operands, a
    4-byte output (the split epilogue), a bias, the split-K grid, calls repeated (cache hits),
    a new output buffer each call; and a default call captured into a CUDA graph (which takes
    host descriptors) replays the eager call's bits."""
    from dataclasses import replace

    g = _gemm_module()
    if not _triton.triton.__version__.startswith("3.6."):
        pytest.skip("host descriptors ride on Triton 3.6's launcher")
    torch.manual_seed(2)
    for n, k, ms in ((14336, 4096, (1, 200, 256)), (1024, 4096, (1, 256, 2048))):
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        bias = torch.randn(n, device="cuda").bfloat16()
        a = torch.randn(2048, k, device="cuda").bfloat16()
        cfg = g.gemm_config(n, k, torch.bfloat16, torch.cuda.get_device_capability())
        host, device = replace(cfg, device_descriptors=False), replace(cfg, device_descriptors=True)
        for m in ms:
            for b, odt in ((None, torch.bfloat16), (bias, torch.bfloat16), (None, torch.float32)):
                want = g.gemm(a[:m], w, b, out_dtype=odt, config=device)
                for _ in range(3):
                    assert bits_equal(g.gemm(a[:m], w, b, out_dtype=odt, config=host), want), (n, m)
    assert any(e.tma_meta for e in g._LAUNCH._cache.values())
    n, k = 14336, 4096
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    a = torch.randn(1200, k, device="cuda").bfloat16()
    static = a[:200].clone()
    eager = g._plan(200, n, k, torch.bfloat16, torch.bfloat16, False, static.device, None)[0]
    assert eager.tma and eager.device_descriptors  # eager calls: kernel-built descriptors
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        g.gemm(static, w)
    torch.cuda.current_stream().wait_stream(stream)
    before = sum(bool(e.tma_meta) for e in g._LAUNCH._cache.values())
    with torch.cuda.graph(graph):
        out = g.gemm(static, w)
    assert sum(bool(e.tma_meta) for e in g._LAUNCH._cache.values()) > before  # the captured plan
    for rows in ((1000, 1200), (0, 200)):
        static.copy_(a[rows[0] : rows[1]])
        graph.replay()
        torch.cuda.synchronize()
        assert bits_equal(out, g.gemm(a[rows[0] : rows[1]], w)), rows


@gpu
def test_direct_launch_graph_replay_gpu() -> None:
    """A cached launch captured into a CUDA graph (its own scratch) and replayed between eager
    calls on the same stream (the shared scratch) keeps both results right."""
    g = _gemm_module()
    torch.manual_seed(1)
    w = (torch.randn(2048, 4096, device="cuda") / 64).bfloat16()
    xs = [torch.randn(8, 4096, device="cuda").bfloat16() for _ in range(4)]
    want = [_triton_launch(lambda x=x: g.gemm(x, w)) for x in xs]
    static = xs[0].clone()
    g.gemm(static, w)  # fill the cache outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        g.gemm(static, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = g.gemm(static, w)
    for i in range(12):
        static.copy_(xs[i % 4])
        graph.replay()
        eager = g.gemm(xs[(i + 1) % 4], w)
        assert bits_equal(captured, want[i % 4]), i
        assert bits_equal(eager, want[(i + 1) % 4]), i


@gpu
def test_direct_launch_host_time_gpu() -> None:
    """gemm()'s host time with the cache under that of Triton's own launch (and printed against
    torch.mm: the goal is a ratio under 1, not asserted, since it depends on the host)."""
    g = _gemm_module()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    a = torch.randn(1, 4096, device="cuda").bfloat16()
    cached = host_us(lambda: g.gemm(a, w))
    own = _triton_launch(lambda: host_us(lambda: g.gemm(a, w)))
    mm = host_us(lambda: torch.mm(a, w.T))
    print(
        f"host us/call: gemm {cached:.2f}  Triton launch {own:.2f}  torch.mm {mm:.2f}  ratio {cached / mm:.2f}"
    )
    assert cached < own
