"""The frameworks' figures of a step computed on threads are those computed in turn, bit for bit and
in the same order, and a step's shared arrays are made once whichever thread asks first."""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest
from isoaudit.audit.frameworks import StepTokens, framework_figures, parse_declaration


def step(seed: int) -> StepTokens:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 400, 96)
    trainer = [-rng.exponential(1.0, n) for n in lengths]
    rollout = [t + rng.normal(0, 0.05, t.size) * (rng.random(t.size) < 0.3) for t in trainer]
    rollout[3][5] = -np.inf  # non-finite tokens take their own branches
    rollout[7][:4] += 30.0  # |Δ| past the clamp bounds
    return StepTokens.of(
        trainer,
        rollout,
        advantages=[None if i % 11 == 0 else float(a) for i, a in enumerate(rng.normal(size=lengths.size))],
        ranks=[i % 3 for i in range(lengths.size)],
    )


def bits(figures: dict[str, float]) -> list[tuple[str, bytes]]:
    return [(name, struct.pack("<d", value)) for name, value in figures.items()]


@pytest.mark.parametrize("declared", [None, "verl==0.7.1"])
def test_figures_on_threads_are_those_computed_in_turn(declared: str | None) -> None:
    declaration = parse_declaration(declared) if declared else None
    for seed in (0, 1):
        alone = framework_figures(step(seed), declaration, threads=1)
        assert len(alone) > 40
        for threads in (2, 4, 8):
            assert bits(framework_figures(step(seed), declaration, threads=threads)) == bits(alone)


def test_a_shared_array_asked_for_by_many_threads_is_one_array() -> None:
    tokens = step(2)
    barrier = threading.Barrier(8)
    got: list[np.ndarray] = []

    def ask() -> None:
        barrier.wait()
        got.append(tokens.exp_clamped_delta(20.0))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(a is got[0] for a in got)
    assert got[0].tobytes() == np.exp(np.clip(tokens.delta, -20.0, 20.0)).tobytes()
