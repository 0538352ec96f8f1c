"""``isoaudit compare RUN``: the per-step table, each sample's first divergence and its diagnosis.

Exit codes, for scripts and CI gates: 0 clean, 2 divergence, 3 inconclusive, 1 bad input. A sample
diagnosed ``off_policy`` (a weight lag the run declared) is expected, not a divergence. ``--names
verl`` adds a table of the run's figures under that framework's names. For bounds on figures, see
``isoaudit gate``.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from isoaudit.cli.common import DatabaseOption, console, open_store

SHOWN_METRICS = ("kl_k3", "kl_k1", "logprob_abs_diff_mean", "logprob_abs_diff_max", "exact_match_fraction")
DIVERGENT = {
    "contract",
    "weights",
    "stale_engine_state",
    "semantics",
    "quantization",
    "inference_path",
    "numerical",
}


class ExitCode(IntEnum):
    CLEAN = 0
    BAD_INPUT = 1
    DIVERGENCE = 2
    INCONCLUSIVE = 3


def verdict(kinds: list[str]) -> ExitCode:
    """Divergence wins over inconclusive; no compared sample at all is inconclusive."""
    if any(kind in DIVERGENT for kind in kinds):
        return ExitCode.DIVERGENCE
    if not kinds or "inconclusive" in kinds:
        return ExitCode.INCONCLUSIVE
    return ExitCode.CLEAN


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {message}")
    return typer.Exit(ExitCode.BAD_INPUT)


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


app = typer.Typer()


@app.command("compare")
def compare(
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="Run id (see `isoaudit runs list`).")],
    step: Annotated[int | None, typer.Option(help="Only this step.", min=0)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    names: Annotated[
        str | None,
        typer.Option(
            "--names",
            help="Also show the figures under this framework's names "
            "(verl, slime, skyrl, trl, openrlhf, nemo-rl, tinker, prime-rl).",
        ),
    ] = None,
    database: DatabaseOption = None,
) -> None:
    """Compare the trainer and rollout sides of a run and say where and why they diverge."""
    from isoaudit.audit.metric_names import FRAMEWORKS
    from isoaudit.audit.worker import ComparisonWorker

    if names is not None and names not in FRAMEWORKS:
        raise _fail(f"--names: {names!r} is not one of {', '.join(FRAMEWORKS)}")
    store = open_store(database)
    run = store.get_run(run_id)
    if run is None:
        raise _fail(f"RUN: no run {run_id!r} in the store (`isoaudit runs list` shows the recorded ones)")
    stored_steps = [s.step for s in store.steps(run_id)]
    if step is not None and step not in stored_steps:
        raise _fail(f"--step: run {run_id!r} has no step {step} (steps: {_span(stored_steps)})")

    with console.status("comparing queued samples…", spinner="dots"):
        ComparisonWorker(store).run_once(run_id)

    steps = store.step_results(run_id, step, step)
    samples = [r for r in store.sample_results(run_id, step)]
    code = verdict([r.diagnosis for r in samples])
    if as_json:
        body = _as_json(run_id, steps, samples, code, names)
        if names is not None:
            body["framework"] = framework_used(run.config, names)
        print(json.dumps(body, indent=2, default=str))
        raise typer.Exit(code)

    table = Table("step", "samples", *SHOWN_METRICS, "diagnoses", "first divergence", title=f"run {run_id}")
    for row in steps:
        first = row.diagnoses.get("first_divergence")
        counts = ", ".join(f"{k} {v}" for k, v in row.diagnoses.get("counts", {}).items())
        where = f"{first['region']} @ {first['position']}" if first else "—"
        table.add_row(
            str(row.step),
            str(row.n_samples),
            *(_fmt(row.metrics.get(m)) for m in SHOWN_METRICS),
            counts,
            where,
        )
    console.print(table)
    detail = Table("step", "sample", "diagnosis", "first divergence", "mean |Δ|", "why", title="samples")
    for sample in samples:
        where = (
            f"{sample.first_divergence_region} @ {sample.first_divergence_position}"
            if sample.first_divergence_region
            else "—"
        )
        detail.add_row(
            str(sample.step),
            sample.sample_key[:12],
            sample.diagnosis,
            where,
            _fmt(sample.metrics.get("logprob_abs_diff_mean")),
            sample.diagnosis_detail.get("sentence", ""),
        )
    console.print(detail)
    if names is not None:
        console.print(framework_table(run_id, steps, names))
        used = framework_used(run.config, names)
        settings = ", ".join(f"{k}={v['value']!r} ({v['origin']})" for k, v in used["settings"].items())
        console.print(
            f"{names}: figures as its code at {used['version'] or 'its newest code'} computes them "
            f"(era {used['era']}, {used['commit'][:10]}){'; ' + settings if settings else ''}"
        )
    missing = [s for s in store.steps(run_id, step, step) if s.compared_samples == 0]
    for s in missing:
        console.print(
            f"step {s.step}: nothing to compare yet (trainer {s.trainer_samples}, rollout {s.rollout_samples} samples)"
        )
    console.print(f"verdict: [bold]{code.name.lower()}[/bold] (exit {int(code)})")
    raise typer.Exit(code)


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


#: At most this many steps (the latest) are columns of the --names table.
NAMED_STEPS_SHOWN = 6


def framework_table(run_id: str, steps: list[Any], framework: str) -> Table:
    """The run's figures as ``framework`` logs them: one row per name, one column per step (latest)."""
    from isoaudit.audit.metric_names import framework_aliases, lookup

    shown = steps[-NAMED_STEPS_SHOWN:]
    more = f" (latest {len(shown)} of {len(steps)} steps)" if len(shown) < len(steps) else ""
    table = Table(
        f"{framework} name",
        "isoaudit",
        *(f"step {s.step}" for s in shown),
        title=f"run {run_id} in {framework}'s names{more}",
    )
    for alias in framework_aliases(framework):
        values = [lookup(s.metrics, alias.key) for s in shown]
        if all(v is None for v in values):
            continue  # not logged at this run's release and settings
        table.add_row(alias.name, escape(alias.same_as or alias.key), *(_fmt(v) for v in values))
    return table


def framework_used(config: dict[str, Any], framework: str) -> dict[str, Any]:
    """Which release's code and which settings ``framework``'s figures of a run follow (its declared
    framework at its release and settings; any other at its newest code and defaults)."""
    from isoaudit.audit.frameworks import declaration_of, used_settings

    try:
        declared = declaration_of(config)
    except ValueError:
        declared = None
    return used_settings(declared)[framework]


def _as_json(
    run_id: str, steps: list[Any], samples: list[Any], code: ExitCode, framework: str | None = None
) -> dict[str, Any]:
    from isoaudit.audit.metric_names import as_framework

    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in samples:
        by_step.setdefault(row.step, []).append(
            {
                "sample_key": row.sample_key,
                "diagnosis": row.diagnosis,
                "sentence": row.diagnosis_detail.get("sentence"),
                "evidence": row.diagnosis_detail.get("evidence"),
                "first_divergence": (
                    {"region": row.first_divergence_region, "position": row.first_divergence_position}
                    if row.first_divergence_region
                    else None
                ),
                "metrics": row.metrics,
            }
        )
    return {
        "run_id": run_id,
        "verdict": code.name.lower(),
        "exit_code": int(code),
        "steps": [
            {
                "step": s.step,
                "n_samples": s.n_samples,
                "metrics": s.metrics,
                **({"as": {framework: as_framework(s.metrics, framework)}} if framework else {}),
                "diagnoses": s.diagnoses,
                "samples": by_step.get(s.step, []),
            }
            for s in steps
        ],
    }
