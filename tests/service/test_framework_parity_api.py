"""The frameworks' own values, through the paths users read them: every parity fixture's steps
ingested over the API as a run declared at the fixture's release and settings, compared by the
worker, then read back by ``isoaudit compare --names FW --json`` (every step) and
``/metrics?framework=FW`` (the latest step), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from isoaudit.audit.api.prometheus import _sanitize
from isoaudit.audit.records import Batch, Run, SampleLogprobs
from isoaudit.audit.worker import ComparisonWorker
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from isoaudit.cli import app

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "parity"
INPUTS = json.loads((FIXTURES / "inputs.json").read_text())["steps"]
STEP_NAMES = list(INPUTS)
runner = CliRunner()


def _one_per_era() -> list[dict[str, Any]]:
    """Of each framework's era, the fixture with the most figures (its settings exercise the most);
    tests/audit/test_framework_parity.py checks every fixture's values on the figures themselves."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(FIXTURES.glob("*/*.json")):
        fixture = json.loads(path.read_text())
        size = sum(len(v) for v in fixture["values"].values())
        key = (fixture["framework"], fixture["era"])
        if key not in best or size > sum(len(v) for v in best[key]["values"].values()):
            best[key] = fixture
    return list(best.values())


FIXTURES_SHOWN = _one_per_era()


def close(got: float | None, expected: float | None) -> bool:
    if expected is None:
        return got is None or not math.isfinite(got)
    if got is None or not math.isfinite(got):
        return False
    return abs(got - expected) <= 1e-6 * max(abs(expected), abs(got)) or abs(got - expected) <= 1e-12


def step_records(run_id: str, step: int, samples: list[dict[str, Any]]) -> list[SampleLogprobs]:
    """Both sides of one input step as collectors record them: the masked-in tokens of each sample,
    the trainer's advantage, each sample's rank."""
    rng = np.random.default_rng(step)
    out = []
    for sample in samples:
        keep = np.asarray(sample["mask"], dtype=bool)
        tokens = rng.integers(0, 50_000, 3 + int(keep.sum())).astype(np.int32)
        for side in ("trainer", "rollout"):
            out.append(
                SampleLogprobs(
                    run_id=run_id,
                    step=step,
                    side=side,
                    prompt_len=3,
                    token_ids=tokens,
                    logprobs=np.asarray(sample[side], np.float32)[keep],
                    rank=sample["rank"],
                    advantage=sample["advantage"] if side == "trainer" else None,
                )
            )
    return out


def declared(fixture: dict[str, Any]) -> dict[str, Any]:
    spec = fixture["framework"] + (f"=={fixture['version']}" if fixture["version"] else "")
    return {"framework": spec, "framework_config": fixture["settings"]}


def test_compare_names_and_metrics_give_the_frameworks_values(api, store, database_url):
    fixtures = FIXTURES_SHOWN
    runs = []
    for n, fixture in enumerate(fixtures):
        run_id = f"parity-{n}"
        records: list[Any] = [Run(run_id=run_id, name=run_id, config=declared(fixture))]
        for step, name in enumerate(STEP_NAMES):
            if name in fixture["values"]:
                records += step_records(run_id, step, INPUTS[name])
        reply = api.post("/v1/ingest", content=Batch(records=records).model_dump_json())
        assert reply.status_code == 200, reply.text
        runs.append(run_id)
    worker = ComparisonWorker(store)
    for run_id in runs:
        worker.run_once(run_id)

    reply = api.get("/metrics", params={"framework": sorted({f["framework"] for f in fixtures})})
    assert reply.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(reply.text)}
    wrong = []
    checked = 0
    for run_id, fixture in zip(runs, fixtures, strict=True):
        framework = fixture["framework"]
        result = runner.invoke(
            app, ["compare", run_id, "--names", framework, "--json", "--database-url", database_url]
        )
        body = json.loads(result.stdout)
        assert body["framework"]["era"] == fixture["era"], (run_id, body["framework"])
        for key, value in fixture["settings"].items():
            assert body["framework"]["settings"][key] == {"value": value, "origin": "declared"}
        by_step = {s["step"]: s["as"][framework] for s in body["steps"]}
        for step, name in enumerate(STEP_NAMES):
            for figure, value in fixture["values"].get(name, {}).items():
                checked += 1
                if not close(by_step[step].get(figure), value):
                    wrong.append(
                        f"compare {framework}@{fixture['era']} {name} {figure}: {by_step[step].get(figure)} != {value}"
                    )

        last = max(step for step, name in enumerate(STEP_NAMES) if name in fixture["values"])
        for figure, value in fixture["values"][STEP_NAMES[last]].items():
            family = families.get(_sanitize(f"{framework}_{figure}"))
            samples = [s for s in family.samples if s.labels["run_id"] == run_id] if family else []
            got = samples[0].value if samples else None
            if not close(got, value):
                wrong.append(f"/metrics {framework}@{fixture['era']} {figure}: {got} != {value}")
    assert not wrong, "\n".join(wrong)
    assert checked > 1000 and len(fixtures) >= 30, (checked, len(fixtures))
