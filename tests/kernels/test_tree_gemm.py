"""TP-invariant tree GEMM: simulated TP in {1, 2, 4, 8} gives the bits of TP=1; real NCCL on 2 GPUs."""

from __future__ import annotations

import importlib
import os
import tempfile

import pytest
import torch
from isoaudit.kernels.tree_gemm import (
    WIDE,
    reduce_roots,
    tree_gemm,
    tree_gemm_distributed,
    tree_plan,
    tree_reduce,
)

from .conftest import CUDA, bits_equal, gpu, needs_triton

pytestmark = needs_triton
tree_gemm_mod = importlib.import_module(
    "isoaudit.kernels.tree_gemm"
)  # the package exports a function of that name


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same tree in fp32 by another code (the torch reference against the interpreter, whose
    ``tl.dot`` rounds each leaf's sum once): each leaf's sum rounds differently, so the results agree
    to a few units in the last place of the output's scale, not of each (possibly cancelling) element."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2.0**-20 * float(want.abs().max()))


def test_plan_is_exact() -> None:
    p = tree_plan(k=11008, leaf=256, tp=8)
    assert (p.n_leaves, p.group_leaves, p.slots, p.slots_per_rank) == (43, 6, 64, 8)
    # Balanced: every rank but the last owns 6 leaves (1,536 columns); the last owns the 1 left.
    assert [p.k_range(r) for r in range(8)][5:] == [(7680, 9216), (9216, 10752), (10752, 11008)]
    # The 8B-class row-parallel shapes split evenly over 8 ranks.
    for k in (4096, 12288, 14336):
        assert {hi - lo for lo, hi in (tree_plan(k, 256, 8).k_range(r) for r in range(8))} == {k // 8}


def test_plan_rejects_bad_degrees() -> None:
    with pytest.raises(ValueError, match="tp must be a power of two"):
        tree_plan(4096, 256, 3)
    with pytest.raises(ValueError, match="exceeds the plan's max_tp"):
        tree_plan(4096, 256, 16)


@pytest.mark.parametrize("tma", [False, True], ids=["pointer-loads", "tma-loads"])
@pytest.mark.parametrize("k", [256, 200, 96, 640, 2000, 4000])  # groups of 1, 4, 8, 16 slots
def test_tp_invariant_cpu(dev: str, k: int, tma: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_gemm_mod, "_use_tma", lambda w: tma)
    torch.manual_seed(0)
    x, w = torch.randn(20, k, device=dev), torch.randn(24, k, device=dev)
    leaf = 64 if tma else 32  # two BLOCK_K steps per leaf, or one
    ref = tree_gemm(x, w, leaf=leaf, tp=1, impl="triton")
    for tp in (2, 4, 8):
        assert bits_equal(tree_gemm(x, w, leaf=leaf, tp=tp, impl="triton"), ref), f"tp={tp}"
    assert_fp32_close(ref, tree_gemm(x, w, leaf=leaf, tp=1, impl="torch"))
    # One group per program (its roots then added in torch) is the same tree: the same bits.
    monkeypatch.setattr(tree_gemm_mod, "MAX_PROGRAM_SLOTS", tree_plan(k, leaf).group_slots)
    assert bits_equal(tree_gemm(x, w, leaf=leaf, tp=1, impl="triton"), ref)
    torch.testing.assert_close(ref, x @ w.T, rtol=1e-4, atol=1e-4)


def test_wide_plan() -> None:
    # One leaf per group, a multiple of 128 columns: K=4096 over max_tp=2 is two leaves of 2048.
    p = tree_plan(4096, WIDE, tp=1, max_tp=2)
    assert (p.leaf, p.n_leaves, p.slots, p.slots_per_rank) == (2048, 2, 2, 2)
    assert tree_plan(896, WIDE, tp=2, max_tp=2).k_range(1) == (512, 896)
    # Which subtrees the GEMM path serves: two pairs of any leaves, four of wide ones.
    assert len(tree_gemm_mod._gemm_parts(tree_plan(8192, WIDE, 1, 8), 8192)) == 4
    assert tree_gemm_mod._gemm_parts(tree_plan(4096, WIDE, 1, 8), 4096) is None  # leaves of 512
    assert len(tree_gemm_mod._gemm_parts(tree_plan(4096, 256, 8), 512)) == 1
    with pytest.raises(ValueError, match="leaf >= 0"):
        tree_plan(4096, -1)


def test_reduce_roots_is_the_tree(dev: str) -> None:
    torch.manual_seed(0)
    for count in (1, 2, 4, 8, 16):
        roots = [torch.randn(5, 7, device=dev) * 10.0**i for i in range(count)]  # adds that round
        want = tree_reduce(torch.stack(roots))
        assert bits_equal(reduce_roots(roots), want), count
        if dev == "cuda":  # the interpreter's bf16 casts are not the hardware's
            assert bits_equal(reduce_roots(roots, torch.bfloat16), want.bfloat16()), count
    with pytest.raises(ValueError, match="power-of-two"):
        reduce_roots(roots[:3])


def _tps(max_tp: int) -> list[int]:
    return [t for t in (1, 2, 4, 8) if t <= max_tp]


# (k, max_tp, leaf): wide plans of max_tp 2 and 4 (the GEMM path at every TP), narrow plans whose
# TP 2-8 ranks take the GEMM path and TP 1 the register kernel, a short last leaf, padding slots.
GEMM_PATH_PLANS = [
    (512, 2, WIDE),
    (1000, 2, WIDE),
    (1024, 4, WIDE),
    (768, 8, 128),
    (2048, 8, 256),
    (1408, 4, 128),
    (8192, 8, WIDE),  # leaves of 1024: TP=1 is four pairs on the GEMM path
]


@pytest.mark.parametrize(("k", "max_tp", "leaf"), GEMM_PATH_PLANS)
def test_gemm_path_is_the_tree_cpu(
    dev: str, k: int, max_tp: int, leaf: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch-invariant GEMM with a one-leaf split-K computes a slot pair with the register
    kernel's adds: every TP, either path, the same bits (fp32 under the interpreter)."""
    monkeypatch.setattr(tree_gemm_mod, "_use_tma", lambda w: True)
    torch.manual_seed(0)
    x, w = torch.randn(20, k, device=dev), torch.randn(24, k, device=dev)
    monkeypatch.setattr(tree_gemm_mod, "GEMM_PATH", False)
    ref = tree_gemm(x, w, leaf=leaf, tp=1, impl="triton", max_tp=max_tp)
    monkeypatch.setattr(tree_gemm_mod, "GEMM_PATH", True)
    for tp in _tps(max_tp):
        assert bits_equal(tree_gemm(x, w, leaf=leaf, tp=tp, impl="triton", max_tp=max_tp), ref), f"tp={tp}"
    assert bits_equal(tree_gemm(x[:3], w, leaf=leaf, tp=1, impl="triton", max_tp=max_tp), ref[:3])
    assert_fp32_close(ref, tree_gemm(x, w, leaf=leaf, impl="torch", max_tp=max_tp))


@gpu
@pytest.mark.parametrize("k", [4096, 11008, 14336])
@pytest.mark.parametrize(("max_tp", "leaf"), [(2, WIDE), (4, WIDE), (8, WIDE), (8, 256)])
def test_gemm_path_is_the_tree_gpu(k: int, max_tp: int, leaf: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the H200: the GEMM path (one launch at TP=1 for max_tp=2) gives the register
    kernel's bits at every TP and every M, the split grid of small M included."""
    torch.manual_seed(0)
    x = torch.randn(300, k, device="cuda").bfloat16()
    w = (torch.randn(512, k, device="cuda") / k**0.5).bfloat16()
    monkeypatch.setattr(tree_gemm_mod, "GEMM_PATH", False)
    ref = tree_gemm(x, w, leaf=leaf, tp=1, max_tp=max_tp)
    monkeypatch.setattr(tree_gemm_mod, "GEMM_PATH", True)
    for tp in _tps(max_tp):
        assert bits_equal(tree_gemm(x, w, leaf=leaf, tp=tp, max_tp=max_tp), ref), f"tp={tp}"
        for m in (1, 7, 64):
            assert bits_equal(tree_gemm(x[:m], w, leaf=leaf, tp=tp, max_tp=max_tp), ref[:m]), f"tp={tp} m={m}"


@gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_gemm_path_captured_gpu(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide max_tp=2 plan captured into a CUDA graph (where its slot pairs' explicit GEMM
    configs take host-built TMA descriptors) replays the register kernel's eager bits, at the
    bench's M=256 and at a decode M."""
    torch.manual_seed(3)
    k = 4096
    x = torch.randn(256, k, device="cuda").bfloat16()
    w = (torch.randn(4096, k, device="cuda") / k**0.5).bfloat16()
    monkeypatch.setattr(tree_gemm_mod, "GEMM_PATH", False)
    ref = tree_gemm(x, w, leaf=WIDE, tp=1, max_tp=2)
    monkeypatch.setattr(tree_gemm_mod, "GEMM_PATH", True)
    for m in (256, 8):
        static = x[:m].clone()
        tree_gemm(static, w, leaf=WIDE, tp=tp, max_tp=2)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tree_gemm(static, w, leaf=WIDE, tp=tp, max_tp=2)
        static.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert not bits_equal(out, ref[:m])  # the replay read the zeroed input
        static.copy_(x[:m])
        graph.replay()
        torch.cuda.synchronize()
        assert bits_equal(out, ref[:m]), f"tp={tp} m={m}"


@gpu
@pytest.mark.parametrize("k", [4096, 11008, 14336])
def test_tp_invariant_gpu(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    x = torch.randn(300, k, device="cuda").bfloat16()
    w = (torch.randn(512, k, device="cuda") / k**0.5).bfloat16()
    ref = tree_gemm(x, w, leaf=256, tp=1)
    for tp in (2, 4, 8):
        assert bits_equal(tree_gemm(x, w, leaf=256, tp=tp), ref), f"tp={tp}"
    assert bits_equal(tree_gemm(x[:7], w, leaf=256, tp=4), ref[:7])
    monkeypatch.setattr(tree_gemm_mod, "MAX_PROGRAM_SLOTS", tree_plan(k, 256).group_slots)
    assert bits_equal(tree_gemm(x, w, leaf=256, tp=1), ref)  # one group per program: same tree


def _nccl_worker(rank: int, world: int, k: int, leaf: int, path: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}.rdv", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, k, generator=gen).bfloat16().cuda()
    w = (torch.randn(256, k, generator=gen) / k**0.5).bfloat16().cuda()
    plan = tree_plan(k, leaf, world)
    lo, hi = plan.k_range(rank)

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    y = tree_gemm_distributed(
        x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous(), k, leaf, world, rank, all_gather
    )
    ref = tree_gemm(x, w, leaf=leaf, tp=1)
    nccl_sum = x[:, lo:hi].float() @ w[:, lo:hi].float().T
    dist.all_reduce(nccl_sum)
    with open(f"{path}.{rank}", "w") as f:
        f.write(f"{int(bits_equal(y, ref))} {(nccl_sum.bfloat16() != ref).float().mean().item()}")
    dist.destroy_process_group()


@gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_real_nccl() -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tp")
        mp.spawn(_nccl_worker, args=(2, 4096, 256, path), nprocs=2, join=True)
        results = [open(f"{path}.{r}").read().split() for r in range(2)]
    print(
        "nccl all-gather tree == tp1:",
        [r[0] for r in results],
        "plain all-reduce mismatch fraction:",
        [r[1] for r in results],
    )
    assert all(r[0] == "1" for r in results)
