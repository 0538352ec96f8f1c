"""Every figure isoaudit shows under a framework's name equals what that framework's own code returns
on the same inputs (tests/fixtures/parity: produced by scripts/parity/*.py from the framework's code
at a pinned commit), within 1e-6 relative."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from isoaudit.audit.frameworks import FRAMEWORK_TABLES, StepTokens, framework_table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "parity"
INPUTS = json.loads((FIXTURES / "inputs.json").read_text())["steps"]
FIXTURE_FILES = sorted(FIXTURES.glob("*/*.json"))
REL = 1e-6


def step_tokens(samples: list[dict[str, Any]]) -> StepTokens:
    """A step as isoaudit records it: each sample's masked-in tokens only."""
    keep = [np.asarray(s["mask"], dtype=bool) for s in samples]
    return StepTokens.of(
        [np.asarray(s["trainer"], np.float32)[k] for s, k in zip(samples, keep, strict=True)],
        [np.asarray(s["rollout"], np.float32)[k] for s, k in zip(samples, keep, strict=True)],
        advantages=[s["advantage"] for s in samples],
        ranks=[s["rank"] for s in samples],
    )


def close(got: float | None, expected: float | None) -> bool:
    if expected is None:
        return got is None or not math.isfinite(got)
    if got is None or not math.isfinite(got):
        return False
    return abs(got - expected) <= REL * max(abs(expected), abs(got)) or abs(got - expected) <= 1e-12


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[f"{p.parent.name}/{p.stem}" for p in FIXTURE_FILES])
def test_figures_equal_the_frameworks_own(path: Path) -> None:
    fixture = _load(path)
    table = framework_table(fixture["framework"])
    era = table.era(fixture["version"])
    assert era.since == fixture["era"], f"{path.name}: version {fixture['version']} runs era {era.since}"
    settings, _ = table.settings_of(era, fixture["settings"])
    wrong = []
    for step, expected in fixture["values"].items():
        got = era.compute(step_tokens(INPUTS[step]), settings)
        missing = sorted(set(expected) - set(got))
        assert not missing, f"{step}: isoaudit computes no {missing}"
        unproven = sorted(set(got) - set(expected))
        assert not unproven, f"{step}: {unproven} have no value from {fixture['framework']}'s code"
        wrong += [
            f"{step} {name}: isoaudit {got[name]!r}, {fixture['framework']} {value!r}"
            for name, value in expected.items()
            if not close(got[name], value)
        ]
    assert not wrong, "\n".join(wrong)


def test_every_figure_of_every_era_has_a_fixture() -> None:
    """The golden tests cover every name isoaudit shows, at every era it can select."""
    proven: dict[tuple[str, str], set[str]] = {}
    for path in FIXTURE_FILES:
        fixture = _load(path)
        names = proven.setdefault((fixture["framework"], fixture["era"]), set())
        for values in fixture["values"].values():
            names |= set(values)
    uncovered = []
    for table in FRAMEWORK_TABLES.values():
        for era in table.eras:
            names = {f.name for f in era.figures}
            missing = names - proven.get((table.name, era.since), set())
            if missing:
                uncovered.append(f"{table.name} {era.since}: {sorted(missing)}")
    assert not uncovered, "figures without a fixture from the framework's own code:\n" + "\n".join(uncovered)


def test_fixtures_name_their_commit_and_functions() -> None:
    for path in FIXTURE_FILES:
        fixture = _load(path)
        assert len(fixture["commit"]) == 40 and fixture["functions"], path.name
        assert fixture["generated_by"].startswith("scripts/parity/"), path.name
        assert set(fixture["values"]) <= set(INPUTS), path.name


def test_same_as_figures_equal_their_canonical_metric() -> None:
    """A figure that says it equals a canonical metric does, on every input step."""
    from isoaudit.audit.metrics import step_metrics

    wrong = []
    for table in FRAMEWORK_TABLES.values():
        for era in table.eras:
            settings, _ = table.settings_of(era, None)
            for step, samples in INPUTS.items():
                tokens = step_tokens(samples)
                ours = step_metrics(
                    tokens.trainer.astype(np.float32), tokens.rollout.astype(np.float32), tokens.offsets
                )
                got = era.compute(tokens, settings)
                for figure in era.figures:
                    if (
                        figure.same_as
                        and figure.name in got
                        and not close(got[figure.name], ours[figure.same_as])
                    ):
                        wrong.append(f"{table.name} {era.since} {figure.name} != {figure.same_as} on {step}")
    assert not wrong, "\n".join(wrong)
