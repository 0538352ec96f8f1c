"""Row-parallel layers on the tree GEMM: a real process group (torchrun) at TP in {1, 2, 4, 8} gives
the bits of TP=1 for the 8B-class row-parallel GEMMs and for a whole model's logits.

On the CPU the group is gloo (fp32, torch references); on CUDA it is NCCL with one GPU per rank,
for every TP degree the machine has GPUs for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from isoaudit.kernels.tensor_parallel import RowParallelLinear, shard_row_parallel
from isoaudit.kernels.tree_gemm import tree_gemm

from .conftest import CUDA, bits_equal, gpu

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(world: int, tmp_path: Path, small: bool) -> dict:
    out = tmp_path / f"tp{world}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: torch references
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "isoaudit.kernels.tp_check", "--json", str(out)] + (["--small"] if small else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    print(json.dumps(result))
    return result


def _assert_invariant(result: dict, world: int) -> None:
    assert result["world"] == world and result["ok"]
    assert [r["k"] for r in result["gemms"]] == [4096, 12288, 14336]
    assert all(r["tree_equals_tp1"] for r in result["gemms"])
    assert result["model"]["sharded_layers"] == 4 and result["model"]["logits_equal_tp1"]
    if world > 1:  # the check has teeth: the native all-reduce layer does differ from TP=1
        assert result["model"]["native_logits_mismatch_fraction"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_torchrun_gloo_cpu(world: int, tmp_path: Path) -> None:
    if CUDA:
        pytest.skip("on a GPU machine the NCCL test below runs instead")
    _assert_invariant(_torchrun(world, tmp_path, small=True), world)


@gpu
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_torchrun_nccl(world: int, tmp_path: Path) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _assert_invariant(_torchrun(world, tmp_path, small=False), world)


@pytest.mark.parametrize(("leaf", "max_tp"), [(64, 8), (0, 2)], ids=["leaf64", "wide-max-tp2"])
def test_single_rank_layer_is_the_tree_gemm(dev: str, leaf: int, max_tp: int) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(640, 48, bias=True, device=dev)
    x = torch.randn(5, 7, 640, device=dev)
    model = torch.nn.Sequential()
    model.add_module("down_proj", lin)
    assert shard_row_parallel(model, 0, 1, leaf=leaf, max_tp=max_tp) == 1
    want = tree_gemm(x, lin.weight.detach(), leaf=leaf, max_tp=max_tp) + lin.bias.detach()
    with torch.no_grad():
        assert bits_equal(model(x), want)


def test_layer_rejects_bad_arguments() -> None:
    w = torch.zeros(8, 512)
    with pytest.raises(ValueError, match="rank must be in"):
        RowParallelLinear(w, None, rank=2, tp=2)
    with pytest.raises(ValueError, match="mode must be"):
        RowParallelLinear(w, None, rank=0, tp=1, mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs an all_reduce"):
        RowParallelLinear(w, None, rank=0, tp=2, mode="native")
