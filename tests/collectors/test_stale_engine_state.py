"""Stale engine state in isoaudit's reference engine: its CUDA-graph decode keeps reading weights a
reload replaced, while the parameters (and so the held-weight digests) are the new ones.

The plant is the failure of vLLM #52626 in miniature: the reload rebinds one parameter to new
storage (``param.data = new``) instead of copying into the storage the captured graphs read, and the
old storage stays alive. The engine's canary replays the graph and recomputes the same decode
eagerly from the parameters: they differ, and the comparator says ``stale_engine_state``, where
held digests alone say nothing and the verdict would be ``numerical``. A later proper reload
(copying in place) does not cure it: the graphs still read the storage the bad reload replaced, so
the next version is stale too; re-capturing the graphs (``engine.drop_graphs()``) does. On the CPU
the engine replays no graphs, the same swap is harmless, and nothing is diagnosed stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from isoaudit.audit.compare import compare_sample
from isoaudit.audit.stale_state import canary_of
from isoaudit.collectors.engine_capture import EngineCollector
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import TrainerCollector

RUN = "stale-engine"
TARGET = "model.layers.1.mlp.down_proj.weight"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda-graphs",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def _next_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (p.detach().float().cpu() + 0.05 * torch.randn(p.shape, generator=generator)).to(p.dtype)
        for name, p in model.named_parameters()
    }


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor], rebind: str | None = None) -> list[Any]:
    """Copy ``weights`` into ``model`` in place, except ``rebind``: given new storage (the old one is
    returned, kept alive as a graph pool would)."""
    kept = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            new = weights[name].to(param.device)
            if name == rebind:
                kept.append(param.data)
                param.data = new.clone()
            else:
                param.copy_(new)
    return kept


def _flow(load: Callable[[str], torch.nn.Module], device: str) -> dict[int, list[Any]]:
    from isoaudit.kernels.adapters import HFCausalLM
    from isoaudit.kernels.engine import RolloutEngine

    trainer_model = load("qwen3").to(device=device, dtype=torch.bfloat16)
    engine_model = load("qwen3").to(device=device, dtype=torch.bfloat16)
    engine = RolloutEngine(HFCausalLM(engine_model), max_len=64)
    t_sink, r_sink = MemorySink(), MemorySink()
    trainer = TrainerCollector(trainer_model, run=RUN, sink=t_sink, regions=None, strict=True)
    trainer.weights_changed(0)
    rollout = EngineCollector(engine, run=RUN, sink=r_sink, regions=None, strict=True, weight_version=0)
    kept: list[Any] = []
    out: dict[int, list[Any]] = {}
    for step in range(4):
        if step:
            weights = _next_weights(trainer_model, seed=step)
            _load(trainer_model, weights)
            kept += _load(engine_model, weights, rebind=TARGET if step == 1 else None)
            if step == 3:  # the cure: capture again, from the storage the parameters hold now
                engine.drop_graphs()
            trainer.weights_changed(step)
            rollout.weights_changed(step)
        completions = engine.generate(PROMPTS, [6, 6, 6], seed=step)
        rollout.record_step(step, completions)
        with torch.no_grad():
            trainer.record_step(step, StepBatch.padded(PROMPTS, [c.tokens for c in completions]))
        assert t_sink.flush(30) and r_sink.flush(30)
        t_samples = {s.sample_key: s for s in t_sink.of_kind("sample") if s.step == step}
        r_samples = {s.sample_key: s for s in r_sink.of_kind("sample") if s.step == step}
        out[step] = [
            compare_sample(
                t_samples[key],
                r_samples[key],
                trainer_manifests=t_sink.of_kind("manifest"),
                rollout_manifests=r_sink.of_kind("manifest"),
            )
            for key in sorted(t_samples.keys() & r_samples.keys())
        ]
        assert len(out[step]) == len(PROMPTS)
    out[-1] = [rollout.stats(), trainer.stats(), r_sink.of_kind("manifest"), engine.graphed()]
    trainer.detach()
    rollout.detach()
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_reading_replaced_storage_are_stale_engine_state(load, device: str) -> None:
    out = _flow(load, device)
    rollout_stats, trainer_stats, manifests, graphed = out[-1]
    assert rollout_stats["errors"] == 0 and trainer_stats["errors"] == 0
    canaries = {m.weight_version: canary_of(m) for m in manifests if canary_of(m) is not None}
    assert set(canaries) >= {"0", "1", "2", "3"}
    for step in (0, 3):  # the checkpoint, then graphs captured again: never stale
        kinds = {c.diagnosis.kind for c in out[step]}
        assert "stale_engine_state" not in kinds, [c.diagnosis.sentence for c in out[step]]
    stale, still = [c.diagnosis for c in out[1]], [c.diagnosis for c in out[2]]
    if not graphed:  # eager everywhere: the rebound parameter is what the forward reads
        assert graphed == (device == "cuda")
        assert all(c.reference is None for c in canaries.values())
        assert all(d.kind != "stale_engine_state" for d in stale + still), [d.sentence for d in stale]
        return
    assert all(d.kind == "stale_engine_state" for d in still), [d.sentence for d in still]
    assert canaries["3"].reference.digest == canaries["3"].output.digest  # graph == eager when fresh
    assert canaries["1"].reference.digest != canaries["1"].output.digest
    assert canaries["2"].reference.digest != canaries["2"].output.digest  # an in-place reload: still
    for diagnosis in stale:
        assert diagnosis.kind == "stale_engine_state", diagnosis.sentence
        assert diagnosis.evidence["cause"] == "canary_differs_from_own_reference"
        assert diagnosis.evidence["side"] == "rollout"
        assert "CUDA-graph decode" in diagnosis.evidence["canary_path"]
        assert diagnosis.evidence["max_abs_logprob_diff"] > 0
