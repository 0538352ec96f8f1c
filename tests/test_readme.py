"""README.md's "Using it in an RL job" snippet, extracted from the README and run as written against a
tiny Qwen3 and isoaudit's reference engine, writing to a real SQLite store (the default destination
when ``ISOAUDIT_DATABASE_URL`` names it): so the README can never be wrong again."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_snippet() -> str:
    """The first python block under the "Using it in an RL job" heading, exactly as written."""
    text = README.read_text()
    section = text.split("## Using it in an RL job", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "README.md: no python block under 'Using it in an RL job'"
    return found.group(1)


def test_the_snippet_is_about_a_dozen_lines() -> None:
    lines = [line for line in readme_snippet().splitlines() if line.strip()]
    assert 8 <= len(lines) <= 14


def test_the_readme_snippet_runs_and_both_sides_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from isoaudit.audit.db import Store
    from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model
    from isoaudit.kernels.adapters import HFCausalLM
    from isoaudit.kernels.engine import RolloutEngine

    url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    monkeypatch.delenv("ISOAUDIT_URL", raising=False)
    monkeypatch.setenv("ISOAUDIT_DATABASE_URL", url)
    directory = make_tiny_model(
        "qwen3", tmp_path / "model", num_layers=2, hidden=64, vocab=512, seed=3, dtype="float32"
    )
    policy, _ = load_tiny_model(directory)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 9, 3)]
    namespace = {
        "policy": policy,
        "engine": RolloutEngine(HFCausalLM(policy), max_len=64),
        "prompts": prompts,
        "max_new": [4, 6, 2],
        "steps": 2,
    }
    exec(compile(readme_snippet(), str(README), "exec"), namespace)

    assert "isoaudit run grpo-7: trainer sent" in capsys.readouterr().err  # the summary on close
    store = Store(url)
    try:
        for step in range(2):
            trainer = {s.sample_key: s for s in store.samples("grpo-7", step, side="trainer")}
            rollout = {s.sample_key: s for s in store.samples("grpo-7", step, side="rollout")}
            assert len(trainer) == 3 and trainer.keys() == rollout.keys()  # keys derived alike
            assert {s.weight_version for s in rollout.values()} == {None if step == 0 else str(step)}
            regions = {f.region for f in store.fingerprints("grpo-7", step, side="rollout")}
            assert "embed" in regions and "final_norm" in regions
        assert store.fingerprints("grpo-7", 0, side="trainer") and not store.fingerprints(
            "grpo-7", 1, side="trainer"
        )
        sides = {m.side for m in store.manifests("grpo-7")}
        assert sides == {"trainer", "rollout"}
        assert store.manifests("grpo-7", side="rollout")[-1].weight_version == "2"
    finally:
        store.dispose()
    assert not namespace["engine"].__dict__.get("generate")  # the session detached the engine
