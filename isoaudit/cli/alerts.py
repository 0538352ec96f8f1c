"""``isoaudit alerts``: alert rules (YAML) and alerts."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from isoaudit.cli.common import DatabaseOption, console, open_store

app = typer.Typer(help="Alert rules and alerts.", no_args_is_help=True)


@app.command("check")
def alerts_check(path: Annotated[str, typer.Argument(help="YAML rules file.")]) -> None:
    """Validate a rules file without touching the database; exits 1 naming the rule and field."""
    from isoaudit.audit.alerts import RulesFileError, load_rules

    try:
        rules = load_rules(path)
    except (RulesFileError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    for rule in rules:
        console.print(f"{rule.name}: {rule.condition()} for {rule.for_steps} steps ({rule.severity})")
    console.print(f"{len(rules)} rules OK")


@app.command("load")
def alerts_load(
    path: Annotated[str, typer.Argument(help="YAML rules file.")],
    database: DatabaseOption = None,
) -> None:
    """Install the file's rules (replacing rules of the same names), as `serve --rules` does."""
    from isoaudit.audit.alerts import RulesFileError, install_rules, load_rules

    try:
        rules = load_rules(path)
    except (RulesFileError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    console.print(f"installed {install_rules(open_store(database), rules, 'yaml', replace=True)} rules")


@app.command("rules")
def alerts_rules(database: DatabaseOption = None) -> None:
    """List the rules in the store."""
    from isoaudit.audit.alerts.rules import list_rule_rows, rule_from_row

    table = Table("rule", "condition", "for", "keep firing", "severity", "project", "source", "enabled")
    for row in list_rule_rows(open_store(database)):
        rule = rule_from_row(row)
        table.add_row(
            rule.name,
            rule.condition(),
            str(rule.for_steps),
            str(rule.keep_firing_for),
            rule.severity,
            rule.project or "(all)",
            row.source,
            "yes" if rule.enabled else "no",
        )
    console.print(table)


@app.command("list")
def alerts_list(
    database: DatabaseOption = None,
    run_id: Annotated[str | None, typer.Option("--run", help="Only this run's alerts.")] = None,
    open_only: Annotated[bool, typer.Option("--open", help="Only pending and firing alerts.")] = False,
) -> None:
    """List alerts, newest first."""
    from isoaudit.audit.alerts.history import list_alerts

    states = ["pending", "firing"] if open_only else None
    table = Table("id", "rule", "run", "state", "severity", "value", "started", "fired", "resolved")
    for alert in list_alerts(open_store(database), run_id=run_id, states=states):
        value = "" if alert.value is None else f"{alert.value:.4g}"
        steps = [alert.started_step, alert.fired_step, alert.resolved_step]
        table.add_row(
            str(alert.id),
            alert.rule,
            alert.run_id,
            alert.state,
            alert.severity,
            value,
            *("" if s is None else str(s) for s in steps),
        )
    console.print(table)
