"""The trainer manifest states what the head computes in: the weight's dtype natively, fp32 while
:mod:`kernels` routes (the invariant head, as the execution contract says)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from isoaudit.collectors.control import FixedControl
from isoaudit.collectors.manifest import runtime_signature, trainer_runtime
from isoaudit.collectors.remediation import apply_kernels_mode
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import attach

from isoaudit import kernels
from tests.collectors.test_trainer import make_batch


def test_lm_head_dtype_is_what_the_head_computes_in(load: Callable[[str], torch.nn.Module]) -> None:
    model = load("qwen3").to(torch.bfloat16)
    native = trainer_runtime(model)
    assert native.dtype == native.lm_head_dtype == "bfloat16"
    with kernels.enable():
        invariant = trainer_runtime(model)
        signature = runtime_signature(model)
    assert invariant.dtype == "bfloat16" and invariant.lm_head_dtype == "float32"
    # The signature moves with it, so a job that enables kernels itself re-sends its manifest.
    assert signature != runtime_signature(model)
    assert trainer_runtime(model).lm_head_dtype == "bfloat16"  # kernels off again


def test_the_kernels_bit_settings_are_in_the_manifest(load: Callable[[str], torch.nn.Module]) -> None:
    """The GEMM's split policy sets bits, so each side's manifest states the one its kernels run
    (the contract handshake then refuses a trainer and a rollout that disagree); nothing is said
    while the kernels are off."""
    from isoaudit.kernels import gemm_policy

    model = load("qwen3")
    assert "gemm_split" not in (trainer_runtime(model).model_extra or {})
    previous = gemm_policy.set_split_policy(gemm_policy.DEFAULT_SPLIT)
    try:
        with kernels.enable():
            extra = trainer_runtime(model).model_extra
            assert extra["gemm_split"] == "N<=1024,K>=2048,spans=4,align=128,sm_90"
            assert extra["gemm_split_k"] is True
            gemm_policy.set_split_policy(gemm_policy.NO_SPLIT)
            extra = trainer_runtime(model).model_extra
            assert (extra["gemm_split"], extra["gemm_split_k"]) == ("off", False)
    finally:
        gemm_policy.set_split_policy(previous)


def test_manifest_after_the_switch_reports_the_fp32_head(load: Callable[[str], torch.nn.Module]) -> None:
    model = load("qwen3").to(torch.bfloat16)
    sink, control = MemorySink(), FixedControl("r")
    handle = attach(model, run="r", sink=sink, control=control, remediation_hook=apply_kernels_mode)
    try:
        batch = make_batch("packed", n=2)
        handle.record_step(0, batch)
        control.set("invariant")
        handle.record_step(1, batch)
        handle.record_step(2, batch)
        sink.flush()
    finally:
        handle.detach()
        kernels.disable()
    seen = [(m.runtime.remediation, m.runtime.lm_head_dtype) for m in sink.of_kind("manifest")]
    assert seen[0] == ("native", "bfloat16") and seen[-1] == ("invariant", "float32")


def test_an_unchanged_environment_is_built_once_and_a_pin_set_mid_run_is_sent(
    load: Callable[[str], torch.nn.Module], monkeypatch
) -> None:
    """Every step's manifest check (``record_step``'s, before the step's records) reads the
    environment: while nothing in it changed the same object comes back (nothing is built), and an
    allow-listed variable set mid-run, or a torch switch flipped, is a new environment and a new
    manifest naming it. ``begin_step`` sends one only when the mode changed."""
    from isoaudit.collectors.environment import process_environment

    monkeypatch.delenv("NCCL_ALGO", raising=False)
    first = process_environment()
    assert process_environment() is first and process_environment(batch_invariant=True) is not first
    model = load("qwen3")
    sink = MemorySink()
    handle = attach(model, run="r", sink=sink, strict=True)
    batch = make_batch("packed", n=2)
    try:
        handle.begin_step(0)
        handle.record_step(0, batch)
        assert sink.flush(30)
        sent = len(sink.of_kind("manifest"))
        handle.begin_step(1)  # nothing changed: nothing sent
        handle.record_step(1, batch)
        assert sink.flush(30) and len(sink.of_kind("manifest")) == sent
        monkeypatch.setenv("NCCL_ALGO", "Tree")
        assert process_environment() is not first and process_environment().env["NCCL_ALGO"] == "Tree"
        handle.begin_step(2)
        assert sink.flush(30) and len(sink.of_kind("manifest")) == sent  # no mode change: not yet
        handle.record_step(2, batch)
        assert sink.flush(30)
        manifests = sink.of_kind("manifest")
        assert len(manifests) == sent + 1 and manifests[-1].environment.env["NCCL_ALGO"] == "Tree"
        monkeypatch.delenv("NCCL_ALGO")
        assert process_environment() is first  # the earlier state's environment again
        handle.begin_step(3)
        handle.record_step(3, batch)
        assert sink.flush(30)
        assert "NCCL_ALGO" not in sink.of_kind("manifest")[-1].environment.env
    finally:
        handle.detach()
