"""A tiny Qwen3-MoE on vLLM's default compilation (no ``enforce_eager``), engine in this process:
the router and combine regions inside the compiled decoder are recorded by the graph taps at every
position the engine computes, and what stays unobservable (the per-slot expert outputs inside the
fused-MoE kernel) is named in the manifest."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from isoaudit.collectors.sinks import MemorySink  # noqa: E402
from isoaudit.collectors.tiny_models import make_tiny_model  # noqa: E402

from tests.vllm.conftest import RUN, by_key, engine, generate, prompts_of, rows_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The first forward selects more rows than the CPU stage holds here (the prompts' prefill, 305 rows,
# past STAGE_ROWS): fingerprinted in the graph; the decode steps' 2 rows are staged (the router's
# always in the graph).
LENGTHS = [5, 300]
STAGE_ROWS = 256
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import isoaudit.collectors.vllm as cv
    from isoaudit.collectors.vllm.worker import graph

    path = make_tiny_model(
        "qwen3_moe",
        tmp_path_factory.mktemp("vllm-moe-compiled") / "qwen3_moe",
        hidden=128,
        seed=3,
        dtype="bfloat16",
    )
    with pytest.MonkeyPatch.context() as patch, engine(path, enforce_eager=False) as llm:
        patch.setattr(graph, "CPU_STAGE_ROWS", STAGE_ROWS)
        sink = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=sink, fingerprint="all", strict=True)
        prompts = prompts_of(LENGTHS, seed=4)
        outputs = generate(llm, prompts, max_tokens=MAX_TOKENS)
        handle.record_step(0, outputs)
        assert sink.flush(30)
        yield {
            "handle": handle,
            "sink": sink,
            "prompts": prompts,
            "stats": handle.stats(),
        }
        handle.detach()


def test_moe_regions_inside_the_compiled_decoder_are_tapped(recorded: dict[str, Any]) -> None:
    handle, sink = recorded["handle"], recorded["sink"]
    assert handle.refusal is None
    assert recorded["stats"]["errors"] == 0 and recorded["stats"]["engine"]
    assert all(c.get("errors", 0) == 0 and c.get("unmappable", 0) == 0 for c in recorded["stats"]["engine"])
    routers = [r for r in handle.regions if r.endswith(".router")]
    combines = [r for r in handle.regions if r.endswith(".combine")]
    assert routers and combines
    prints = by_key(sink, "fingerprints", 0)
    assert len(prints) == len(LENGTHS)
    for records in prints.values():
        computed = None
        for region in routers + combines + ["layers.0.out"]:
            rows = rows_of(records, region)
            # every position but the last sampled token's: the prompt and each decode step
            assert rows, region
            positions = sorted(rows)
            assert positions == list(range(len(positions))), region
            computed = computed or len(positions)
            assert len(positions) == computed, region
            assert len(set(rows.values())) > 1, region  # real rows, not one padding row repeated
        assert computed is not None and computed >= min(LENGTHS) + MAX_TOKENS - 1
    # the router's rows are its logits, one per expert: their own width, fingerprinted as they are
    router_records = [r for recs in prints.values() for r in recs if r.region == routers[0]]
    assert all(np.isfinite(r.l2).all() and (r.l2 > 0).all() for r in router_records)


def test_the_manifest_names_what_the_fused_moe_hides(recorded: dict[str, Any]) -> None:
    manifest = recorded["sink"].of_kind("manifest")[-1]
    hidden = {k: v for k, v in manifest.unobserved.items() if k.endswith(".experts")}
    assert hidden and all("fused-MoE kernel returns only the weighted combine" in v for v in hidden.values())
    assert not any(k.endswith((".router", ".combine")) for k in manifest.unobserved)
    graph = manifest.runtime.model_dump().get("compiled_graph")
    assert graph and graph["compiled_state"][0] is True and graph["tap_buffer_bytes"] > 0
    assert sum(LENGTHS) > graph["tap_stage_rows"] > len(LENGTHS)  # both paths ran
