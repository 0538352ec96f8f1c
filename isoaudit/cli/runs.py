"""``isoaudit runs``: runs recorded in the store."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from isoaudit.cli.common import DatabaseOption, console, open_store

app = typer.Typer(help="Runs recorded in the store.", no_args_is_help=True)


@app.command("list")
def runs_list(
    database: DatabaseOption = None,
    project: Annotated[str | None, typer.Option(help="Only this project's runs.")] = None,
) -> None:
    """List runs, newest first."""
    store = open_store(database)
    runs = store.list_runs(project)
    if not runs:
        console.print("no runs recorded yet")
        return
    table = Table("run", "name", "project", "started", "steps", "last step")
    for run in runs:
        started = run.started_at.strftime("%Y-%m-%d %H:%M:%S")
        last = "" if run.last_step is None else str(run.last_step)
        table.add_row(run.run_id, run.name, run.project, started, str(run.n_steps), last)
    console.print(table)
