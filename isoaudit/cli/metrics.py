"""``isoaudit metrics list``: every metric, its framework aliases and its one-line definition; with
``--framework verl@0.6``, what that framework logs at that release and what changes by release."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from isoaudit.cli.common import console

app = typer.Typer(help="The mismatch metrics and their names in each framework.", no_args_is_help=True)


@app.command("list")
def metrics_list(
    framework: Annotated[
        str | None,
        typer.Option(
            "--framework",
            help="Only what this framework logs, under its names, at a release: verl, verl@0.6, "
            "verl==0.7.1 (none: its newest code). Shows what changed between its releases.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every metric with its aliases (framework:name) and its definition."""
    from isoaudit.audit.metric_names import catalogue, framework_catalogue

    if framework is not None:
        try:
            body = framework_catalogue(framework)
        except ValueError as exc:
            console.print(f"[red]error:[/red] --{escape(str(exc))}")
            raise typer.Exit(1) from None
        if as_json:
            print(json.dumps(body, indent=2))
            return
        _print_framework(body)
        return
    rows = catalogue()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    longest = max((len(f"{a['framework']}:{a['name']}") for row in rows for a in row["aliases"]), default=8)
    table = Table(title="isoaudit metrics", show_lines=True)
    table.add_column("metric", overflow="fold")
    table.add_column("aliases", no_wrap=True, min_width=min(longest, 48), overflow="fold")
    table.add_column("definition", ratio=1)
    for row in rows:
        aliases = "\n".join(escape(f"{a['framework']}:{a['name']}") for a in row["aliases"])
        table.add_row(escape(row["key"]), aliases, escape(row["definition"]))
    console.print(table)
    console.print(
        f"{len(rows)} metrics; step metrics also per completion length (name/len_lo_hi) and per policy lag "
        "(name/lag_N); threshold figures take parameters as name\\[k=v]. A framework's figures follow "
        "its own code at the run's declared release: `isoaudit metrics list --framework verl@0.6`."
    )


def _print_framework(body: dict[str, Any]) -> None:
    release = body["version"] or "its newest code"
    table = Table(
        title=f"{body['framework']} at {release}: code of era {body['era']} ({body['commit'][:10]})",
        show_lines=True,
    )
    table.add_column("name", overflow="fold")
    table.add_column("definition", ratio=1)
    table.add_column("settings", overflow="fold")
    for figure in body["figures"]:
        also = "".join(f"\n[dim]{escape(a)}[/dim]" for a in figure["also"])
        same = f"\n[dim]= isoaudit {escape(figure['same_as'])}[/dim]" if figure["same_as"] else ""
        needs = f"\n[dim]needs {', '.join(figure['needs'])}[/dim]" if figure["needs"] else ""
        table.add_row(
            escape(figure["name"]) + also,
            escape(figure["definition"]) + same + needs,
            escape(", ".join(figure["settings"])),
        )
    console.print(table)
    if body["defaults"]:
        shown = ", ".join(
            f"{k}={'(required: no default)' if k in body['required'] else repr(v)}"
            for k, v in body["defaults"].items()
        )
        console.print(f"settings (declare them in the run's framework_config): {escape(shown)}")
    eras = Table(title=f"{body['framework']}'s releases isoaudit follows", show_lines=False)
    for column in ("since", "commit", "date", "what changed", "figures"):
        eras.add_column(column, overflow="fold")
    previous: set[str] = set()
    for era in body["eras"]:
        names = set(era["figures"])
        delta = [f"+{n}" for n in sorted(names - previous)] + [f"-{n}" for n in sorted(previous - names)]
        mark = " ◀" if era["selected"] else ""
        since = era["since"] + ("" if era["released"] else " (unreleased)") + mark
        eras.add_row(
            escape(since),
            era["commit"][:10],
            era["date"],
            escape(era["change"]),
            escape(" ".join(delta) if previous else f"{len(names)} figures"),
        )
        previous = names
    console.print(eras)
