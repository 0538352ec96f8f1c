"""gemm's one launch path, on the CPU through fake launchers: per route (direct, host-built
descriptors, generic) which launch it takes and the arguments it hands over. Every route binds the
same kernel arguments, only in the form its launch takes (tensors, raw pointers, encoded
descriptors); the bits through each route are compared on the GPU (``test_launch_cache.py``)."""

from __future__ import annotations

import importlib

import pytest
import torch
from isoaudit.kernels.gemm_policy import GemmConfig

from .conftest import needs_triton

pytestmark = needs_triton

gemm_mod = importlib.import_module("isoaudit.kernels.gemm")  # (the package attribute is the function)


class _Entry:
    def __init__(self, calls: list, tma_meta: tuple | None) -> None:
        self.calls, self.tma_meta = calls, tma_meta

    def __call__(self, grid: tuple, args: tuple) -> None:
        self.calls.append(("entry", grid, args))


class _FakeLaunch:
    """Stands in for the module's CachedLauncher and its kernel; records every call."""

    def __init__(self, hit: bool, tma_meta: tuple | None = None) -> None:
        self.hit, self.tma_meta, self.calls = hit, tma_meta, []

    def launch_cached(self, key: tuple, grid: tuple, args: tuple) -> bool:
        self.calls.append(("cached", key, grid, args))
        return self.hit

    def entry(self, key: tuple) -> _Entry | None:
        return _Entry(self.calls, self.tma_meta) if self.hit else None

    def __call__(self, key: tuple, grid: tuple, args: tuple, constexprs: dict, **options: int) -> None:
        self.calls.append(("triton", key, grid, args))

    def __getitem__(self, grid: tuple):  # ``_gemm_kernel[grid](...)``: Triton's launch, uncached
        return lambda *args, **kw: self.calls.append(("kernel", None, grid, args))


def _run(monkeypatch, cfg: GemmConfig, route, hit: bool, tma_meta=None, m: int = 5, bias: bool = True):
    fake = _FakeLaunch(hit, tma_meta)
    monkeypatch.setattr(gemm_mod, "_LAUNCH", fake)
    monkeypatch.setattr(gemm_mod, "_gemm_kernel", fake)
    monkeypatch.setattr(
        gemm_mod, "tma_map", lambda ptr, rows, cols, stride, meta: ("map", ptr, rows, cols, stride, meta)
    )
    n, k = 64, 128
    a, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    out = torch.empty(m, n)
    gemm_mod._plan.cache_clear()
    plan = gemm_mod._plan(m, n, k, torch.float32, torch.float32, bias, torch.device("cpu"), cfg)
    gemm_mod._launch(a, w, b, out, plan, torch.device("cpu"), m, n, k, route)
    gemm_mod._plan.cache_clear()
    return fake.calls, (a, w, b, out), plan


def _ptr(x):
    return x.data_ptr() if isinstance(x, torch.Tensor) else x


POINTERS = GemmConfig(32, 32, 16, 4, 2)
KERNEL_DESC = GemmConfig(32, 32, 16, 4, 2, tma=True)
HOST_DESC = GemmConfig(32, 32, 16, 4, 2, tma=True, device_descriptors=False)


def test_route_follows_config_and_devices() -> None:
    w = torch.empty(4, 4)
    assert gemm_mod._route(HOST_DESC, w, None) is gemm_mod._Route.GENERIC  # a CPU tensor
    assert gemm_mod._route(POINTERS, w, None) is gemm_mod._Route.GENERIC


@pytest.mark.parametrize("cfg", [POINTERS, KERNEL_DESC])
def test_direct_route(monkeypatch, cfg: GemmConfig) -> None:
    """A hit takes raw pointers; a miss goes through Triton with the tensors in the same places,
    under the same key."""
    (hit,), (a, w, b, out), plan = _run(monkeypatch, cfg, gemm_mod._Route.DIRECT, hit=True)
    kind, key, grid, raw = hit
    assert kind == "cached" and key[0] is plan and grid == plan[1]
    pa, pw, po = a.data_ptr(), w.data_ptr(), out.data_ptr()
    sizes = (5, 64, 128, 128, 1, 128, 1, 64, 1, grid[0])  # m, n, k, a's, w's and out's strides, programs
    assert raw == (pa, pw, po, b.data_ptr(), *sizes, po, po)  # no split scratch: out stands in
    (cached, triton), (a, w, b, out), plan = _run(monkeypatch, cfg, gemm_mod._Route.DIRECT, hit=False)
    assert triton[0] == "triton" and triton[1][1:] == cached[1][1:] and triton[2] == cached[2]
    assert tuple(_ptr(x) for x in triton[3]) == (
        a.data_ptr(), w.data_ptr(), out.data_ptr(), b.data_ptr(), *cached[3][4:14],
        out.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    assert cached[3][:4] == (a.data_ptr(), w.data_ptr(), out.data_ptr(), b.data_ptr())


def test_host_descriptor_route(monkeypatch) -> None:
    """A hit with descriptor metadata takes each descriptor encoded and expanded as Triton's
    launcher expands it; a miss binds host-built descriptors through Triton, keyed (it fills the
    cache); off CUDA they go to Triton uncached."""
    metas = ("meta-a", "meta-w", "meta-c")
    (entry,), (a, w, b, out), plan = _run(
        monkeypatch, HOST_DESC, gemm_mod._Route.HOST_DESCRIPTORS, hit=True, tma_meta=metas, m=40
    )
    assert not plan[2]["A_PTR"]  # 40 rows: a full 32-row tile, descriptors for A and C too
    pa, pw, po = a.data_ptr(), w.data_ptr(), out.data_ptr()
    assert entry == (
        "entry",
        plan[1],
        (
            ("map", pa, 40, 128, 128, "meta-a"), 40, 128, 128, 1,
            ("map", pw, 64, 128, 128, "meta-w"), 64, 128, 128, 1,
            ("map", po, 40, 64, 64, "meta-c"), 40, 64, 64, 1,
            b.data_ptr(), 40, 64, 128, 128, 1, 128, 1, 64, 1, plan[1][0], po, po,
        ),
    )  # fmt: skip
    for route, kind in ((gemm_mod._Route.HOST_DESCRIPTORS, "triton"), (gemm_mod._Route.GENERIC, "kernel")):
        (call,), (a, w, b, out), plan = _run(monkeypatch, HOST_DESC, route, hit=False, m=40)
        assert call[0] == kind and (call[1] is None) == (kind == "kernel")
        descs, rest = call[3][:3], call[3][3:]
        assert [(d.base.data_ptr(), list(d.block_shape)) for d in descs] == [
            (a.data_ptr(), [32, 16]),
            (w.data_ptr(), [32, 16]),
            (out.data_ptr(), [32, 16]),  # a 4-byte output: the tile stored in halves
        ]
        assert tuple(_ptr(x) for x in rest) == (
            b.data_ptr(), 40, 64, 128, 128, 1, 128, 1, 64, 1, plan[1][0], out.data_ptr(), out.data_ptr(),
        )  # fmt: skip


def test_host_descriptor_route_with_a_by_pointers(monkeypatch) -> None:
    """Fewer rows than one tile (the interpreter takes pointers for A and C then): only the
    weight's descriptor is encoded."""
    metas = ("meta-w",)
    (entry,), (a, w, b, out), plan = _run(
        monkeypatch, HOST_DESC, gemm_mod._Route.HOST_DESCRIPTORS, hit=True, tma_meta=metas, m=5, bias=False
    )
    assert plan[2]["A_PTR"]
    pa, pw, po = a.data_ptr(), w.data_ptr(), out.data_ptr()
    assert entry[2][:8] == (pa, ("map", pw, 64, 128, 128, "meta-w"), 64, 128, 128, 1, po, pw)


def test_generic_route(monkeypatch) -> None:
    """Off CUDA: no cached launch is tried; Triton's launch, keyed as the direct route keys it."""
    calls, (a, w, b, out), plan = _run(monkeypatch, KERNEL_DESC, gemm_mod._Route.GENERIC, hit=True)
    assert [c[0] for c in calls] == ["triton"]
    key = calls[0][1]
    assert key[0] is plan and key[1:] == (128, 1, 128, 1, 0b111)
    assert calls[0][3][:4] == (a, w, out, b)
