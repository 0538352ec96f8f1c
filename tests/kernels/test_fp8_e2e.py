"""End to end in the ``invariant-fp8`` mode: the rollout engine (prefill, chunked prefill, decode in
CUDA graphs) and the trainer's recompute run every linear layer through the invariant W8A8 linear;
their sampled-token logprobs are equal bit for bit, and the trainer's batch 1 equals its batch N.
With per-tensor dynamic activation scales instead, rollout and trainer disagree (the batch-mates
set each row's scale)."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels import dispatch
from isoaudit.kernels import fp8 as F8

from isoaudit import kernels

from .conftest import bits_equal, gpu, needs_triton
from .test_e2e import LENS, NEW, _hf, _report, _requests, run_pair

pytestmark = needs_triton


def _trainer_rows(model, seqs: list[list[int]]) -> torch.Tensor:
    """The trainer's last-position-but-one logprobs of each sequence, the batch padded on the right."""
    dev = model.lm_head_weight.device
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    hidden = model.full_hidden(ids, mask)
    rows = torch.arange(len(seqs), device=dev)
    last = torch.tensor([len(s) - 2 for s in seqs], device=dev)
    tgt = torch.tensor([s[-1] for s in seqs], device=dev)
    return dispatch.token_logprobs(hidden[rows, last], model.lm_head_weight, tgt)


def _trainer_batch_invariant(model, vocab: int) -> None:
    prompts, _ = _requests(vocab, [7, 30, 19, 44], [0, 0, 0, 0])
    with kernels.enable(fp8=True), torch.no_grad():
        assert dispatch.mode() == "invariant-fp8"
        full = _trainer_rows(model, prompts)
        for i, p in enumerate(prompts):
            assert bits_equal(_trainer_rows(model, [p]), full[i : i + 1]), f"sequence {i} alone"


def test_qwen3_fp8_cpu(dev: str) -> None:
    model = _hf("qwen3", 2, 128, 32, 256, torch.float32, "cpu")
    prompts, new = _requests(256, [3, 9, 20], [6, 3, 5])
    for chunk in (None, 4):
        res = run_pair(model, True, prompts, new, chunk, fp8=True)
        _report(f"qwen3-cpu-fp32 invariant-fp8 chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
    _trainer_batch_invariant(model, 256)
    assert dispatch.mode() == "native"
    # the FP8 path is the one that ran: its logprobs are not the bf16-invariant mode's
    with torch.no_grad():
        with kernels.enable(fp8=True):
            a = _trainer_rows(model, prompts)
        with kernels.enable():
            b = _trainer_rows(model, prompts)
    assert not bits_equal(a, b)
    res = _per_tensor_pair(model, prompts, new)
    _report("qwen3-cpu-fp32 fp8 per-tensor activation scales", res)
    assert res["mean_abs_delta"] > 0


def _per_tensor_pair(model: torch.nn.Module, prompts: list[list[int]], new: list[int]) -> dict:
    """The FP8 rollout/recompute pair with per-tensor dynamic activation scales (the batch-mate
    dependence the per-token groups remove), the scaling restored after."""
    prev = F8.set_act_scaling("tensor")
    try:
        return run_pair(model, True, prompts, new, None, fp8=True)
    finally:
        F8.set_act_scaling(prev)


@gpu
@pytest.mark.parametrize("family,layers,hidden", [("qwen3", 4, 256), ("llama", 2, 512), ("qwen3", 2, 1024)])
def test_hf_fp8_gpu(family: str, layers: int, hidden: int) -> None:
    model = _hf(family, layers, hidden, 64, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, LENS, NEW)
    for chunk in (None, 16):
        res = run_pair(model, True, prompts, new, chunk, fp8=True)
        _report(f"{family}-{layers}L-h{hidden}-bf16 invariant-fp8 chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
    _trainer_batch_invariant(model, 1024)
    res = _per_tensor_pair(model, prompts, new)
    _report(f"{family}-{layers}L-h{hidden}-bf16 fp8 per-tensor activation scales", res)
    assert res["mean_abs_delta"] > 0


def test_mode_in_contract_and_manifest() -> None:
    """The ``invariant-fp8`` mode is a remediation mode of its own: the control record accepts it,
    the remediation hook applies it, the manifest names the FP8 arithmetic, and the contract's
    numerical policy differs from the bf16-invariant one (a handshake refuses a mixed pair)."""
    from isoaudit.audit.contract import identities, validate
    from isoaudit.audit.control import REMEDIATION_MODES
    from isoaudit.collectors.manifest import kernel_facts
    from isoaudit.collectors.policy import hf_contracts, kernel_ops
    from isoaudit.collectors.remediation import apply_kernels_mode

    assert "invariant-fp8" in REMEDIATION_MODES
    model = _hf("qwen3", 1, 128, 32, 256, torch.float32, "cpu").model
    try:
        apply_kernels_mode(model, "invariant-fp8")
        assert dispatch.mode() == "invariant-fp8"
        facts = kernel_facts()
        assert facts["fp8"].startswith("e4m3 w8a8") and facts["fp8_split_k"] is True
    finally:
        apply_kernels_mode(model, "native")
    assert dispatch.mode() == "native" and "fp8" not in kernel_facts()
    assert kernel_ops("cpu", fp8=True)["linear"].id == "kernels.fp8.fp8_linear"
    contracts = hf_contracts(model)
    fp8, bf16 = contracts("invariant-fp8"), contracts("invariant")
    assert validate(fp8) == []
    assert identities(fp8).numerical_policy != identities(bf16).numerical_policy
    assert fp8.model.lm_head_dtype == "float32"


def _moe_pair(model, prompts, new, chunk=None, fp8=True) -> dict:
    from isoaudit.kernels import moe

    from .test_moe_e2e import _Traced

    traced = _Traced(model)
    res = run_pair(traced, True, prompts, new, chunk, fp8=fp8)
    res["routing_agreement_min"] = min(moe.agreement(traced.engine, traced.trainer).values())
    return res


def test_qwen3_moe_fp8_cpu() -> None:
    """A Qwen3-MoE in the FP8 mode: attention and expert projections in W8A8 (the experts through
    the FP8 grouped GEMM's torch reference), the fp32 router as in ``invariant``; rollout = trainer
    bitwise."""
    from .test_moe_e2e import hf_moe

    model = hf_moe("qwen3_moe", 2, 128, 8, 2, 256, torch.float32, "cpu")
    prompts, new = _requests(256, [3, 9, 20], [6, 3, 5])
    for chunk in (None, 4):
        res = _moe_pair(model, prompts, new, chunk)
        _report(f"qwen3_moe-cpu-fp32 invariant-fp8 chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
        assert res["routing_agreement_min"] == 1.0


@gpu
def test_qwen3_moe_fp8_gpu() -> None:
    from .test_moe_e2e import hf_moe

    model = hf_moe("qwen3_moe", 4, 256, 16, 4, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, LENS, NEW)
    for chunk in (None, 16):
        res = _moe_pair(model, prompts, new, chunk)
        _report(f"qwen3_moe-4L-bf16 invariant-fp8 chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
        assert res["routing_agreement_min"] == 1.0


@gpu
def test_qwen3_moe_fp8_graphs_gpu() -> None:
    """A Qwen3-MoE rollout in the FP8 mode decoded in CUDA graphs (the adapter itself, no tracing
    wrapper: the engine captures its decode, experts through the FP8 grouped GEMM's host-sync-free
    path) against the trainer's FP8 recompute: every logprob bit for bit, graphs replayed. With
    per-tensor activation scales the experts leave that path: nothing is captured, and rollout and
    trainer disagree."""
    from .test_moe_e2e import hf_moe

    model = hf_moe("qwen3_moe", 4, 256, 16, 4, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, LENS, NEW)
    for chunk in (None, 16):
        res = run_pair(model, True, prompts, new, chunk, fp8=True)
        _report(f"qwen3_moe-4L-bf16 invariant-fp8 graphs chunk={chunk}", res)
        assert res["replays"] > 0
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
    _trainer_batch_invariant(model, 1024)
    res = _per_tensor_pair(model, prompts, new)
    _report("qwen3_moe-4L-bf16 fp8 per-tensor activation scales", res)
    assert res["replays"] == 0 and res["mean_abs_delta"] > 0
