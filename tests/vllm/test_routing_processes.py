"""MoE routing captured inside vLLM worker processes (reached through the isoaudit worker extension
and ``collective_rpc``) on a tiny Qwen3-MoE: every sample's routes are in the store on both sides,
and they equal what an in-process engine captures for the same requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from isoaudit.audit.db import Store  # noqa: E402
from isoaudit.audit.records import SampleLogprobs  # noqa: E402
from isoaudit.collectors.layout import StepBatch  # noqa: E402
from isoaudit.collectors.routing_vllm import VllmRoutes  # noqa: E402
from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model  # noqa: E402

import isoaudit  # noqa: E402
from tests.vllm.conftest import engine, generate, prompts_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LENGTHS = [5, 9, 17, 30]
MAX_TOKENS = 10


def _record(path: Path, url: str, run: str, *, processes: bool) -> dict[str, Any]:
    model, _ = load_tiny_model(path, dtype=torch.bfloat16)
    with engine(path, processes=processes) as llm:
        with isoaudit.session(run, database_url=url, strict=True, report=False) as audit:
            rollout = audit.watch_vllm(llm, fingerprint=None)
            routes = audit.watch_routing(rollout)
            assert isinstance(routes, VllmRoutes)
            trainer = audit.watch_trainer(model, async_transfer=False)
            assert audit.watch_routing(trainer) is not None
            outputs = generate(llm, prompts_of(LENGTHS, seed=4), max_tokens=MAX_TOKENS)
            rollout.record_step(0, outputs)
            prompts = [list(o.prompt_token_ids) for o in outputs]
            completions = [list(o.outputs[0].token_ids) for o in outputs]
            trainer.record_step(0, StepBatch.padded(prompts, completions, temperature=0.7))
            mode = rollout.link_mode
        stats = routes.stats()
    return {"mode": mode, "stats": stats, "samples": Store(url).samples(run, 0)}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-moe-processes")
    path = make_tiny_model("qwen3_moe", root / "qwen3_moe", hidden=128, seed=3, dtype="bfloat16")
    url = f"sqlite:///{root / 'store.db'}"
    return {
        "processes": _record(path, url, "moe-processes", processes=True),
        "in_process": _record(path, url, "moe-inprocess", processes=False),
    }


def _routes(samples: list[Any], side: str) -> dict[str, Any]:
    out = {s.sample_key: s.routes for s in samples if isinstance(s, SampleLogprobs) and s.side == side}
    assert len(out) == len(LENGTHS)
    return out


def test_worker_processes_route_every_sample_on_both_sides(both: dict[str, dict[str, Any]]) -> None:
    run = both["processes"]
    assert run["mode"] == "worker_extension"
    assert run["stats"]["attached"] == len(LENGTHS)
    assert run["stats"]["unmatched"] == 0 and run["stats"]["errors"] == 0
    assert run["stats"]["workers"] and run["stats"]["workers"][0]["errors"] == 0
    for side in ("rollout", "trainer"):
        for sample in (s for s in run["samples"] if s.side == side):
            assert sample.routes is not None, f"{side} sample {sample.sample_key} has no routes"
            assert sample.routes.layers == [0, 1] and sample.routes.top_k == 2
    for sample in (s for s in run["samples"] if s.side == "rollout"):
        # every position the engine ran: the prompt and each sampled token but the last
        assert sample.routes.positions.tolist() == list(range(sample.token_ids.size - 1))


def test_worker_processes_capture_what_the_in_process_engine_captures(
    both: dict[str, dict[str, Any]],
) -> None:
    assert both["in_process"]["mode"] == "in_process"
    for side in ("rollout", "trainer"):
        a = _routes(both["processes"]["samples"], side)
        b = _routes(both["in_process"]["samples"], side)
        assert a.keys() == b.keys()  # the same seeded requests sampled the same tokens
        for key, routes in a.items():
            other = b[key]
            assert routes.layers == other.layers
            np.testing.assert_array_equal(routes.positions, other.positions)
            np.testing.assert_array_equal(routes.experts, other.experts)
