"""``isoaudit metrics list``: every metric, its framework aliases and its one-line definition."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from isoaudit.cli.common import console

app = typer.Typer(help="The mismatch metrics and their names in each framework.", no_args_is_help=True)


@app.command("list")
def metrics_list(
    framework: Annotated[
        str | None, typer.Option("--framework", help="Only the metrics this framework logs, under its names.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every metric with its aliases (framework:name) and its definition."""
    from isoaudit.audit.metric_names import FRAMEWORKS, catalogue

    if framework is not None and framework not in FRAMEWORKS:
        console.print(f"[red]error:[/red] --framework: {framework!r} is not one of {', '.join(FRAMEWORKS)}")
        raise typer.Exit(1)
    rows = catalogue()
    if framework is not None:
        rows = [
            {**row, "aliases": [a for a in row["aliases"] if a["framework"] == framework]}
            for row in rows
            if any(a["framework"] == framework for a in row["aliases"])
        ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    longest = max((len(f"{a['framework']}:{a['name']}") for row in rows for a in row["aliases"]), default=8)
    table = Table(title="isoaudit metrics", show_lines=True)
    table.add_column("metric", overflow="fold")
    table.add_column("aliases", no_wrap=True, min_width=longest)
    table.add_column("definition", ratio=1)
    for row in rows:
        aliases = "\n".join(escape(f"{a['framework']}:{a['name']}") for a in row["aliases"])
        notes = "".join(
            f"\n[dim]{escape(a['framework'])}: {escape(a['note'])}[/dim]"
            for a in {a["note"]: a for a in row["aliases"] if a["note"]}.values()
        )
        table.add_row(escape(row["key"]), aliases, escape(row["definition"]) + notes)
    console.print(table)
    console.print(
        f"{len(rows)} metrics; step metrics also per completion length (name/len_lo_hi) and per policy lag "
        "(name/lag_N); threshold figures take parameters as name\\[k=v]."
    )
