"""Both engine modes, the same requests: workers in other processes (reached through the isoaudit
worker extension and ``collective_rpc``) record exactly what an in-process engine records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import collectors.vllm as cv  # noqa: E402
from collectors.sinks import MemorySink  # noqa: E402
from tests.vllm.conftest import RUN, engine, generate, perturbed_weights, prompts_of  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = prompts_of([5, 9, 17, 40], seed=11)


def _run(path: Path, processes: bool) -> dict[str, Any]:
    with engine(path, processes=processes) as llm:
        sink = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=sink, fingerprint=2, strict=True, validate=True)
        first = generate(llm, PROMPTS)
        handle.record_step(0, first)
        digest = cv.load_weights(llm, perturbed_weights(path), version=2)
        second = generate(llm, PROMPTS)
        handle.record_step(1, second)
        assert sink.flush(30)
        stats = handle.stats()
        mode = handle.mode
        handle.detach()
    return {
        "sink": sink,
        "mode": mode,
        "stats": stats,
        "digest": digest,
        "tokens": [[list(o.outputs[0].token_ids) for o in outs] for outs in (first, second)],
    }


@pytest.fixture(scope="module")
def runs(tiny_qwen3: Path) -> dict[str, dict[str, Any]]:
    return {"processes": _run(tiny_qwen3, True), "in_process": _run(tiny_qwen3, False)}


def _dump(sink: MemorySink, kind: str) -> list[dict[str, Any]]:
    return [r.model_dump(mode="json", exclude={"created_at"}) for r in sink.of_kind(kind)]


def test_modes(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["processes"]["mode"] == "worker_extension"
    assert runs["in_process"]["mode"] == "in_process"
    for run in runs.values():
        assert run["stats"]["errors"] == 0 and run["stats"]["missing_engine_info"] == 0


def test_both_modes_produce_the_same_records(runs: dict[str, dict[str, Any]]) -> None:
    a, b = runs["processes"]["sink"], runs["in_process"]["sink"]
    assert len(a.of_kind("sample")) == 8
    prints = _dump(a, "fingerprints")
    assert {p["sample_key"] for p in prints} and len(
        {p["sample_key"] for p in prints}
    ) == 4  # 1 in 2, two steps
    assert _dump(a, "sample") == _dump(b, "sample")
    assert prints == _dump(b, "fingerprints")


def test_manifests_differ_only_in_the_process(runs: dict[str, dict[str, Any]]) -> None:
    def normalised(sink: MemorySink) -> list[dict[str, Any]]:
        out = []
        for manifest in _dump(sink, "manifest"):
            manifest.pop("process")
            manifest["runtime"].pop("v1_multiprocessing")
            out.append(manifest)
        return out

    assert normalised(runs["processes"]["sink"]) == normalised(runs["in_process"]["sink"])
    assert [m.runtime.v1_multiprocessing for m in runs["processes"]["sink"].of_kind("manifest")][0] is True


def test_weight_updates_reach_worker_processes(runs: dict[str, dict[str, Any]]) -> None:
    for run in runs.values():
        first, second = run["tokens"]
        assert first != second  # the engine samples from the new weights
        samples = run["sink"].of_kind("sample")
        assert {s.weight_version for s in samples if s.step == 1} == {"2"}
        assert {s.weight_version for s in samples if s.step == 0} == {None}
        latest = max(run["sink"].of_kind("manifest"), key=lambda m: m.created_at)
        assert (latest.weight_version, latest.weight_digest) == ("2", run["digest"])
    assert runs["processes"]["tokens"] == runs["in_process"]["tokens"]
