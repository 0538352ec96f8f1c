"""The root ``isoaudit`` command: each command or group is a module of this package with its own
``typer.Typer``; this module adds them (nothing imports it back)."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer
from typer.models import CommandInfo, TyperInfo

from isoaudit import __version__
from isoaudit.cli import (
    alerts,
    compare,
    dashboard,
    db,
    demo,
    diff,
    gate,
    metrics,
    retention,
    runs,
    service,
    tokens,
)
from isoaudit.cli.common import console

app = typer.Typer(
    help="isoaudit: find where a trainer and a rollout engine stop computing the same numbers.",
    no_args_is_help=True,
    add_completion=False,
)
# Single commands (their modules' apps carry one command each, added at the top level) ...
for single in (compare, diff, gate, service, dashboard, demo):
    app.add_typer(single.app)
# ... and the command groups.
app.add_typer(db.app, name="db")
app.add_typer(runs.app, name="runs")
app.add_typer(tokens.app, name="tokens")
app.add_typer(alerts.app, name="alerts")
app.add_typer(metrics.app, name="metrics")
app.add_typer(retention.app, name="retention")


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


def _unwrapped(text: object) -> str | None:
    """Help text with its source's line breaks joined inside each paragraph (paragraphs stay apart;
    one that starts with ``\\b`` stays as written, as click has it)."""
    if not isinstance(text, str):
        return None
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split("\n")) for p in paragraphs)


def _unwrap_help(typer_app: typer.Typer) -> None:
    """Give every command and group of ``typer_app`` its docstring or help as paragraphs without
    hard line breaks, so rich wraps it to the terminal: typer's rich mode keeps a docstring's
    single line breaks in a group's command list and in later paragraphs."""
    infos: list[CommandInfo | TyperInfo] = [*typer_app.registered_commands, typer_app.info]
    if typer_app.registered_callback is not None:
        infos.append(typer_app.registered_callback)
    for info in infos:
        text = _unwrapped(info.help) or _unwrapped(
            inspect.getdoc(info.callback) if callable(info.callback) else None
        )
        if text is not None:
            info.help = text
    for group in typer_app.registered_groups:
        text = _unwrapped(group.help)
        if text is not None:
            group.help = text
        if group.typer_instance is not None:
            _unwrap_help(group.typer_instance)


_unwrap_help(app)
