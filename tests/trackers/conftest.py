"""Fixtures of the tracker tests: W&B in offline mode under a temporary directory, MLflow's local
file store, a run whose two sides differ by a known amount, and `isoaudit compare --json --names`
(the real CLI) as the reference every logged figure is checked against."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("wandb", reason="isoaudit[wandb] is not installed")
pytest.importorskip("mlflow", reason="isoaudit[mlflow] is not installed")

#: Samples per step, and the prompt every sample of a step shares.
SAMPLES = 4
PROMPT = [5, 6, 7]


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B offline (nothing leaves the machine), writing under a directory of this test."""
    directory = tmp_path / "wb"
    directory.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(directory))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield directory
    import wandb

    if wandb.run is not None:  # a test that failed half-way leaves no run open for the next
        wandb.run.finish()
    wandb.teardown()  # W&B keeps its settings (WANDB_DIR) for the process: the next test sets its own


@pytest.fixture
def mlflow_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """MLflow's local file store (MLflow 3 keeps it in maintenance mode behind this variable)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    yield uri
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


class TwoSides:
    """Both sides of a run through ``watch_given``: the trainer's logprobs are the rollout's minus
    ``delta * (step + 1)`` on every other token, so KL grows step by step (k3 passes 1e-2, the
    default critical rule, from step 2 on)."""

    def __init__(self, audit: Any, *, delta: float = 0.05) -> None:
        from isoaudit.collectors.integrations.given import watch_given

        self.rollout = watch_given(audit, "rollout", framework="test")
        self.trainer = watch_given(audit, "trainer", framework="test")
        self.delta = delta
        self.rng = np.random.default_rng(7)

    def record(self, step: int) -> None:
        import torch

        from isoaudit import StepBatch

        completions = [[10 + step, 11 + i, 12 + (i * step) % 5][: 2 + i % 2] for i in range(SAMPLES)]
        batch = StepBatch.padded([PROMPT] * SAMPLES, completions)
        rollout_lp = [(-self.rng.uniform(0.1, 3.0, len(c))).astype(np.float32) for c in completions]
        trainer_lp = torch.zeros(SAMPLES, max(len(c) for c in completions))
        for i, lp in enumerate(rollout_lp):
            shift = np.where(np.arange(len(lp)) % 2 == 0, self.delta * (step + 1), 0.0)
            trainer_lp[i, : len(lp)] = torch.from_numpy((lp - shift).astype(np.float32))
        self.rollout.record_step(step, batch, rollout_lp)
        self.trainer.record_step(step, batch, trainer_lp, logprobs_layout="completion")


def compare_names(database_url: str, run_id: str, framework: str | None) -> dict[int, dict[str, float]]:
    """Per compared step, the finite figures of ``isoaudit compare RUN --json --names FRAMEWORK``
    (the real CLI, in its own process); without a framework, the step's canonical metrics."""
    command = [
        sys.executable,
        "-m",
        "isoaudit.cli",
        "compare",
        run_id,
        "--json",
        "--database-url",
        database_url,
    ]
    command += ["--names", framework] if framework else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert done.returncode in (0, 2, 3), done.stderr[-2000:]
    table = json.loads(done.stdout)
    out = {}
    for step in table["steps"]:
        figures = step["as"][framework] if framework else step["metrics"]
        out[step["step"]] = {k: float(v) for k, v in figures.items() if _finite(v)}
    return out


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def mlflow_figures(uri: str, mlflow_run_id: str) -> dict[int, dict[str, float]]:
    """Per step, the ``isoaudit/*`` metrics of an MLflow run, read back through MlflowClient's
    metric histories (the last value per step and name)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(mlflow_run_id).data.metrics:
        if not key.startswith("isoaudit/"):
            continue
        for point in sorted(client.get_metric_history(mlflow_run_id, key), key=lambda m: m.timestamp):
            out.setdefault(point.step, {})[key.removeprefix("isoaudit/")] = point.value
    return out


def wandb_figures(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per isoaudit step, the ``isoaudit/*`` figures of W&B history rows (the last row per step)."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        if "isoaudit/step" in row:
            out[row["isoaudit/step"]] = {
                k.removeprefix("isoaudit/"): v
                for k, v in row.items()
                if k.startswith("isoaudit/") and k != "isoaudit/step"
            }
    return out
