"""Write the shared input steps of the framework-parity golden tests (tests/fixtures/parity/inputs.json).

Each step is a list of samples; a sample holds its response's trainer and rollout logprobs, its
loss mask (0 on interior spans a framework masks out, e.g. tool output), its advantage and the rank
of the process that recorded it. The scripts beside this one pad the samples into the [batch, T]
tensors a framework's own metric function takes (padding filled with garbage, masked out) and run
that function; isoaudit gets the masked-in tokens only, as its integrations record them.
Values are float32-representable so that isoaudit's float32 records hold them exactly.

    python scripts/parity/inputs.py        # rewrites the file (deterministic)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "parity" / "inputs.json"
#: What the padded positions and masked-out spans hold: finite, far from any real logprob, so a
#: framework that forgot a mask would show it.
GARBAGE = (-31.5, 7.25)


def _f32(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float32)]


def _sample(
    rng: np.random.Generator,
    length: int,
    scale: float,
    *,
    masked_span: tuple[int, int] | None = None,
    advantage: float = 0.0,
    rank: int = 0,
    equal: bool = False,
) -> dict:
    rollout = -rng.uniform(0.01, 6.0, length)
    delta = rng.normal(0.0, scale, length)
    trainer = rollout if equal else np.minimum(rollout + delta, -1e-4)
    mask = np.ones(length, dtype=int)
    trainer, rollout = np.asarray(trainer, np.float32), np.asarray(rollout, np.float32)
    if masked_span is not None:
        a, b = masked_span
        mask[a:b] = 0
        trainer[a:b] = GARBAGE[0]
        rollout[a:b] = GARBAGE[1]
    return {
        "trainer": _f32(trainer),
        "rollout": _f32(rollout),
        "mask": mask.tolist(),
        "advantage": float(np.float32(advantage)),
        "rank": rank,
    }


def build() -> dict[str, list[dict]]:
    rng = np.random.default_rng(20261205)
    steps: dict[str, list[dict]] = {}
    # Ragged lengths and a spread wide enough that every cap and bound of the frameworks' figures
    # catches some tokens (|Δ| up to ~2: ρ from ~0.1 to ~7).
    steps["ragged"] = [
        _sample(rng, n, 0.6, advantage=a)
        for n, a in zip(
            (1, 3, 17, 40, 9, 64, 2, 25), (1.0, -0.5, 0.25, -1.5, 0.0, 2.0, -0.75, 0.5), strict=True
        )
    ]
    # Multi-turn: spans masked out inside the response (their values are garbage).
    steps["interior_masked"] = [
        _sample(rng, 30, 0.4, masked_span=(8, 15), advantage=0.8),
        _sample(rng, 48, 0.4, masked_span=(20, 40), advantage=-0.3),
        _sample(rng, 12, 0.4, masked_span=(0, 4), advantage=1.1),
        _sample(rng, 21, 0.4, masked_span=(18, 21), advantage=-1.0),
    ]
    # Outliers beyond ±20 in Δ, where clamps and their placement decide the figures.
    outliers = [_sample(rng, n, 0.3, advantage=a) for n, a in zip((16, 11, 7), (0.5, -0.5, 1.0), strict=True)]
    outliers[0]["rollout"][3], outliers[0]["trainer"][3] = -29.75, -1.5  # Δ = +28.25
    outliers[1]["rollout"][5], outliers[1]["trainer"][5] = -0.5, -26.0  # Δ = −25.5
    outliers[2]["rollout"][0], outliers[2]["trainer"][0] = -40.0, -0.25  # Δ = +39.75
    steps["outliers"] = outliers
    # Every sample one token long (sample std of one value, per-sample means of one token).
    steps["length_one"] = [_sample(rng, 1, 0.5, advantage=a) for a in (1.0, -1.0, 0.5, -0.5, 0.0)]
    # Both sides bit-identical.
    steps["all_equal"] = [
        _sample(rng, n, 0.0, equal=True, advantage=a) for n, a in ((12, 1.0), (5, -1.0), (30, 0.3))
    ]
    # Four processes of unequal sizes (frameworks that log a mean of per-process means).
    steps["multi_rank"] = [
        _sample(rng, n, 0.5, advantage=a, rank=r)
        for n, a, r in (
            (10, 1.0, 0),
            (33, -0.5, 0),
            (4, 0.2, 1),
            (19, -1.2, 2),
            (27, 0.9, 2),
            (8, -0.1, 2),
            (50, 0.4, 3),
        )
    ]
    return steps


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"garbage": GARBAGE, "steps": build()}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
