"""A full garbage collection that comes due inside a collector call walks only what was allocated
after the collector attached, not the job's whole heap (collectors/heap.py)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest
from isoaudit.collectors import heap
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import attach

from tests.collectors.conftest import random_samples

#: What a job holds before it attaches a collector (modules, the model, the framework): about
#: what `import torch, transformers, vllm` and a test session track (0.6-0.9 million objects).
JOB_HEAP_OBJECTS = 800_000


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Each test starts and ends with nothing frozen and no collector holding the heap."""
    gc.unfreeze()
    assert heap.holders() == 0
    yield
    gc.unfreeze()


def make_full_collection_due() -> list[list[None]]:
    """Bring the collector to the point where the next young collection turns into a full one, as
    it does now and then in a long job: ten young passes since the last full one and more than a
    quarter of the long-lived heap new since. Returns what must stay alive for that."""
    gc.collect()
    long_lived = len(gc.get_objects(2))  # frozen objects are not in any generation
    pending = [[None] for _ in range(long_lived // 4 + 1)]
    for _ in range(11):
        gc.collect(1)
    return pending


@pytest.mark.slow
def test_a_full_collection_due_in_a_collector_call_walks_only_what_came_after_attach(load, unfrozen):
    job_heap = [[None] for _ in range(JOB_HEAP_OBJECTS)]
    model = load("qwen3")
    started = time.perf_counter()
    gc.collect()
    whole = time.perf_counter() - started  # one full pass over the job's heap
    prompts, completions = random_samples(8, seed=3)
    batch = StepBatch.padded(prompts, completions)
    trainer = attach(model, run="heap", sink=MemorySink(keep=False, validate=False), strict=True)
    passes: list[tuple[int, float, bool]] = []  # generation, seconds, inside record_step
    state = {"inside": False, "t": 0.0}

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            state["t"] = time.perf_counter()
        else:
            passes.append((info["generation"], time.perf_counter() - state["t"], bool(state["inside"])))

    gc.callbacks.append(timed)
    calls = []
    thresholds = gc.get_threshold()
    try:
        trainer.record_step(0, batch)  # the first call warms up (its own forward's first run)
        pending = make_full_collection_due()
        # a young pass after a few allocations, so that the due full one comes inside the next call
        # whatever the collector allocates there (what it walks is the question, not when it runs)
        gc.set_threshold(10, *thresholds[1:])
        for step in range(1, 7):
            state["inside"] = True
            started = time.perf_counter()
            trainer.record_step(step, batch)
            calls.append(time.perf_counter() - started)
            state["inside"] = False
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(timed)
        trainer.detach()
    full = [seconds for generation, seconds, inside in passes if generation == 2 and inside]
    print(
        f"\nfull collection over the job's {len(job_heap) + len(pending)} objects: {1e3 * whole:.0f} ms; "
        f"the one due inside record_step: {', '.join(f'{1e3 * s:.1f} ms' for s in full)}; "
        f"record_step max {1e3 * max(calls):.1f} ms"
    )
    assert full, f"no full collection came due inside a collector call: {passes}"
    assert max(full) < whole / 5, (full, whole)


def test_the_heap_is_frozen_while_a_collector_is_attached_and_released_by_the_last(load, unfrozen):
    model = load("qwen3")
    first = attach(model, run="heap-1", sink=MemorySink(), strict=True)
    frozen = gc.get_freeze_count()
    assert frozen > 0 and heap.holders() == 1
    second = attach(model, run="heap-2", sink=MemorySink(), strict=True)
    assert heap.holders() == 2
    first.detach()
    first.detach()  # idempotent: released once
    assert heap.holders() == 1 and gc.get_freeze_count() >= frozen
    second.detach()
    assert heap.holders() == 0 and gc.get_freeze_count() == 0


def test_a_heap_frozen_by_someone_else_stays_frozen_after_detach(load, unfrozen):
    gc.freeze()  # vLLM's engine does this once it is up, in the same process
    theirs = gc.get_freeze_count()
    trainer = attach(load("qwen3"), run="heap", sink=MemorySink(), strict=True)
    trainer.detach()
    assert heap.holders() == 0 and gc.get_freeze_count() >= theirs


def test_freezing_is_off_with_the_environment_variable(load, unfrozen, monkeypatch):
    monkeypatch.setenv(heap.ENV_FREEZE, "0")
    trainer = attach(load("qwen3"), run="heap", sink=MemorySink(), strict=True)
    assert heap.holders() == 0 and gc.get_freeze_count() == 0
    trainer.detach()
    assert heap.holders() == 0
