"""``isoaudit diff RUN_A[@STEP] [RUN_B[@STEP]] [--sides]``: what changed in the environment and the
runtime facts (versions, backends, flags, environment pins, the rest of the runtime), key by key with
old → new, between two steps or runs (each side against the same side), between the two sides of a
step (``--sides``), or, given one run alone, since each side's previous manifest.

Exit codes: 0 nothing changed, 2 something did, 1 bad input.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from isoaudit.cli.common import DatabaseOption, console, open_store

app = typer.Typer()


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(1)


@app.command("diff")
def diff(
    old: Annotated[str, typer.Argument(metavar="RUN_A[@STEP]", help="A run, or a step of it.")],
    new: Annotated[
        str | None, typer.Argument(metavar="[RUN_B[@STEP]]", help="Compare with this run or step.")
    ] = None,
    sides: Annotated[
        bool,
        typer.Option(
            "--sides", help="Compare the trainer with the rollout of RUN_A (at its STEP, if given)."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    database: DatabaseOption = None,
) -> None:
    """Name what changed between two steps, runs or sides: library versions, backends, flags,
    environment pins and runtime facts, each with old → new."""
    from isoaudit.audit.db.reads.environment import Point, UnknownPoint, environment_diff
    from isoaudit.audit.environment import shown

    try:
        a = Point.parse(old)
        b = Point.parse(new) if new is not None else None
    except ValueError as exc:
        raise _fail(f"RUN_A/RUN_B: {exc}") from None
    if sides and b is not None:
        raise _fail("--sides compares the two sides of one run: give one RUN_A[@STEP]")
    store = open_store(database)
    try:
        report = environment_diff(store, a, b, sides=sides)
    except UnknownPoint as exc:
        raise _fail(str(exc)) from None
    code = 2 if report.n_changes else 0
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
        raise typer.Exit(code)
    for part in report.diffs:
        title = f"{part.title}: {part.old_label} → {part.new_label}"
        if part.old is None or part.new is None:
            missing = part.old_label if part.old is None else part.new_label
            console.print(f"[yellow]{escape(title)}: no manifest at {escape(missing)}[/yellow]")
            continue
        groups = part.diff.by_group()
        if not groups:
            console.print(f"{escape(title)}: nothing changed")
            continue
        table = Table("group", "key", "old", "new", title=escape(title))
        for group, changes in groups.items():
            for change in changes:
                table.add_row(group, escape(change.key), escape(shown(change.old)), escape(shown(change.new)))
        console.print(table)
        if part.diff.unrecorded:
            console.print(
                "[yellow]no environment recorded in: "
                + ", ".join(part.old_label if u == "old" else part.new_label for u in part.diff.unrecorded)
                + " (runtime facts compared only)[/yellow]"
            )
    raise typer.Exit(code)
