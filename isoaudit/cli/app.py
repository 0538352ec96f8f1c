"""The root ``isoaudit`` command: each command or group is a module of this package with its own
``typer.Typer``; this module adds them (nothing imports it back)."""

from __future__ import annotations

from typing import Annotated

import typer

from isoaudit import __version__
from isoaudit.cli import alerts, compare, dashboard, db, demo, gate, metrics, runs, service, tokens
from isoaudit.cli.common import console

app = typer.Typer(
    help="isoaudit: find where a trainer and a rollout engine stop computing the same numbers.",
    no_args_is_help=True,
    add_completion=False,
)
# Single commands (their modules' apps carry one command each, added at the top level) ...
for single in (compare, gate, service, dashboard, demo):
    app.add_typer(single.app)
# ... and the command groups.
app.add_typer(db.app, name="db")
app.add_typer(runs.app, name="runs")
app.add_typer(tokens.app, name="tokens")
app.add_typer(alerts.app, name="alerts")
app.add_typer(metrics.app, name="metrics")


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
