"""``isoaudit retention``: each project's retention policy, what its runs hold on disk, and applying it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from isoaudit.cli.common import DatabaseOption, console, open_store

if TYPE_CHECKING:
    from isoaudit.audit.db import Store

app = typer.Typer(
    help="Bounded storage: per project, how long sample arrays and fingerprints are kept, and the disk "
    "they take per run and per step. Compared results, summaries and alerts are always kept.",
    no_args_is_help=True,
)

ProjectOption = Annotated[
    str | None, typer.Option("--project", help="Only this project (default: every one).")
]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _kept(value: int | None, unit: str) -> str:
    return "for ever" if value is None else f"{value} {unit}"


def _print_disk_use(store: Store, project: str | None, run: str | None) -> None:
    table = Table(
        "run",
        "project",
        "steps",
        "samples",
        "sample arrays",
        "fingerprints",
        "fingerprint arrays",
        "per step",
    )
    for use in store.disk_use(project=project, run_id=run):
        table.add_row(
            use.run_id,
            use.project,
            str(use.steps),
            str(use.samples),
            _size(use.sample_bytes),
            str(use.fingerprints),
            _size(use.fingerprint_bytes),
            _size(use.bytes_per_step),
        )
    console.print(table)
    if run is not None:
        steps = Table("step", "samples", "sample arrays", "fingerprints", "fingerprint arrays", "total")
        for step in store.step_disk_use(run):
            steps.add_row(
                str(step.step),
                str(step.samples),
                _size(step.sample_bytes),
                str(step.fingerprints),
                _size(step.fingerprint_bytes),
                _size(step.total_bytes),
            )
        console.print(steps)


@app.command("show")
def retention_show(
    project: ProjectOption = None,
    run: Annotated[str | None, typer.Option("--run", help="One run, with its disk use step by step.")] = None,
    database: DatabaseOption = None,
) -> None:
    """The stored policies, and the disk each run's sample and fingerprint arrays take (as stored)."""
    store = open_store(database)
    policies = [store.retention_policy(project)] if project else store.retention_policies()
    table = Table("project", "sample arrays kept", "fingerprints kept in full", "last applied")
    for policy in policies:
        applied = policy.applied_at.strftime("%Y-%m-%d %H:%M") if policy.applied_at else "never"
        table.add_row(
            policy.project,
            _kept(policy.raw_days, "days"),
            _kept(policy.fingerprint_steps, "newest steps"),
            applied,
        )
    console.print(table if policies else "no retention policy: every project keeps everything")
    _print_disk_use(store, project, run)


@app.command("set")
def retention_set(
    project: Annotated[str, typer.Option("--project", help="The project the policy is for.")],
    raw_days: Annotated[
        int | None,
        typer.Option(
            "--raw-days",
            min=0,
            help="Delete sample records (token and logprob arrays) this many days "
            "after they were stored, once their step is compared. Omitted: keep them for ever.",
        ),
    ] = None,
    fingerprint_steps: Annotated[
        int | None,
        typer.Option(
            "--fingerprint-steps",
            min=0,
            help="Keep every fingerprint of a run's newest N compared "
            "steps; older steps keep those of samples that diverged and one clean control. Omitted: keep all.",
        ),
    ] = None,
    database: DatabaseOption = None,
) -> None:
    """Store a project's policy (what is omitted is kept for ever). Workers apply it once an hour."""
    policy = open_store(database).set_retention_policy(
        project, raw_days=raw_days, fingerprint_steps=fingerprint_steps
    )
    console.print(
        f"{policy.project}: sample arrays kept {_kept(policy.raw_days, 'days')}, fingerprints kept in full "
        f"for {_kept(policy.fingerprint_steps, 'newest steps')}"
    )


@app.command("apply")
def retention_apply(project: ProjectOption = None, database: DatabaseOption = None) -> None:
    """Apply the stored policies now (one project's, or every one's), printing what each freed."""
    store = open_store(database)
    projects = [project] if project else [p.project for p in store.retention_policies()]
    table = Table("project", "samples deleted", "fingerprints deleted", "before", "after", "freed")
    for name in projects:
        outcome = store.apply_retention(name)
        table.add_row(
            name,
            str(outcome.samples_deleted),
            str(outcome.fingerprints_deleted),
            _size(outcome.bytes_before),
            _size(outcome.bytes_after),
            _size(outcome.bytes_freed),
        )
    console.print(table)
    _print_disk_use(store, project, None)
