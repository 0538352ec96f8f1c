"""The root ``isoaudit`` command, with the database and runs groups. Other groups live in their own
modules of this package and register themselves on ``app`` (see the imports at the bottom)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from isoaudit import __version__
from isoaudit.audit.config import database_url

if TYPE_CHECKING:
    from isoaudit.audit.db import Store

app = typer.Typer(
    help="isoaudit: find where a trainer and a rollout engine stop computing the same numbers.",
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="The store's schema.", no_args_is_help=True)
runs_app = typer.Typer(help="Runs recorded in the store.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(runs_app, name="runs")

# Piped output (CI logs, scripts) gets wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 160)
DatabaseOption = Annotated[
    str | None,
    typer.Option("--database-url", envvar="ISOAUDIT_DATABASE_URL", help="SQLAlchemy URL of the store."),
]


def open_store(database: str | None) -> Store:
    """The store at ``database`` (or the configured default); a store that cannot be opened (schema
    behind this isoaudit, a newer schema, an unreachable server) exits 1 with the reason, no traceback."""
    from isoaudit.audit.db import Store, StoreError, StoreUnavailable

    try:
        return Store(database)
    except StoreUnavailable as exc:
        cause = exc.__cause__ or exc
        console.print(
            f"[red]database: cannot open {_redact(database_url(database))}: {cause.__class__.__name__}: {getattr(cause, 'orig', cause)}[/red]"
        )
    except StoreError as exc:
        console.print(f"[red]{exc}[/red]")
    raise typer.Exit(1)


def _version(value: bool) -> None:
    if value:
        console.print(f"isoaudit {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """isoaudit: numerical-mismatch diagnostics for RL on LLMs."""


@db_app.command("upgrade")
def db_upgrade(
    database: DatabaseOption = None,
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Apply the schema migrations (safe to run again)."""
    from isoaudit.audit.db.schema import current_revision, upgrade

    url = database_url(database)
    upgrade(url, revision)
    console.print(f"database at revision [bold]{current_revision(url)}[/bold] ({_redact(url)})")


@runs_app.command("list")
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


def _redact(url: str) -> str:
    """The URL without its password, for printing."""
    from isoaudit.audit.db import redacted_url

    return redacted_url(url)


# Command groups defined in sibling modules register themselves on `app` when imported.
# (one import line per module; keep them at the bottom, after `app` exists)
from isoaudit.cli import compare as _compare  # noqa: E402,F401
from isoaudit.cli import dashboard as _dashboard  # noqa: E402,F401
from isoaudit.cli import demo as _demo  # noqa: E402,F401
from isoaudit.cli import gate as _gate  # noqa: E402,F401
from isoaudit.cli import metrics as _metrics  # noqa: E402,F401
from isoaudit.cli import service as _service  # noqa: E402,F401
