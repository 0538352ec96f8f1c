"""``isoaudit serve`` (the HTTP API), ``isoaudit tokens ...`` (project bearer tokens) and
``isoaudit alerts ...`` (rules and alerts)."""

from __future__ import annotations

import signal
from typing import Annotated

import typer
from rich.table import Table

from isoaudit.cli.app import DatabaseOption, app, console, open_store

tokens_app = typer.Typer(help="Bearer tokens of the API, one or more per project.", no_args_is_help=True)
app.add_typer(tokens_app, name="tokens")


@app.command("serve")
def serve(
    database: DatabaseOption = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    open_reads: Annotated[
        bool,
        typer.Option(
            "--open-reads", help="Let GET endpoints answer without a token (ingest always needs one)."
        ),
    ] = False,
    rules: Annotated[
        str | None, typer.Option("--rules", envvar="ISOAUDIT_ALERT_RULES", help="YAML file of alert rules.")
    ] = None,
    webhook: Annotated[
        str | None,
        typer.Option(
            "--webhook",
            envvar="ISOAUDIT_ALERT_WEBHOOK_URL",
            help="Slack-compatible webhook(s) for alerts: one URL, or several separated by commas (each its own destination).",
        ),
    ] = None,
    no_worker: Annotated[
        bool, typer.Option("--no-worker", help="Do not run the comparison worker here.")
    ] = False,
    worker_thread: Annotated[
        bool,
        typer.Option(
            "--worker-thread",
            help="Run the comparison worker as a thread of the API process instead of a child process "
            "(it then shares the GIL with request handling: slower under load; for comparison).",
        ),
    ] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the ingest, query and control API (FastAPI under uvicorn) and, unless --no-worker, the
    comparison worker with alert evaluation as a child process it supervises: restarted if it
    exits, stopped with the API, killed by the kernel if the API dies."""
    import uvicorn

    from isoaudit.audit.api import ApiSettings, create_app
    from isoaudit.audit.api.app import install_configured_rules
    from isoaudit.audit.worker import WorkerProcess

    overrides: dict[str, object] = {
        "database_url": database,
        "alert_rules_file": rules,
        "webhook_url": webhook,
    }
    if open_reads:
        overrides["require_token_for_reads"] = False
    if no_worker:
        overrides["run_worker"] = False
    settings = ApiSettings.from_env(**overrides)
    child = None
    if settings.run_worker and not worker_thread:
        store = open_store(settings.database_url)  # rules first, so the child only evaluates them
        try:
            install_configured_rules(store, settings)
            url = store.engine.url.render_as_string(hide_password=False)
        finally:
            store.dispose()
        child = WorkerProcess(url, webhook_url=settings.webhook_url).start()
        settings = settings.model_copy(update={"run_worker": False})
    if child is None:
        uvicorn.run(create_app(settings=settings), host=host, port=port, log_level=log_level)
        return
    # uvicorn shuts down gracefully on SIGTERM, then raises it again with the handler it found:
    # this one, so the worker is stopped before the process ends as SIGTERM says.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    terminated = False
    try:
        uvicorn.run(create_app(settings=settings), host=host, port=port, log_level=log_level)
    except _Terminated:
        terminated = True
    finally:
        child.stop()
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


class _Terminated(Exception):
    """SIGTERM reached ``serve`` after uvicorn's own shutdown."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


@app.command("worker")
def worker(
    database: DatabaseOption = None,
    rules: Annotated[
        str | None, typer.Option("--rules", envvar="ISOAUDIT_ALERT_RULES", help="YAML file of alert rules.")
    ] = None,
    webhook: Annotated[
        str | None,
        typer.Option(
            "--webhook",
            envvar="ISOAUDIT_ALERT_WEBHOOK_URL",
            help="Slack-compatible webhook(s) for alerts: one URL, or several separated by commas (each its own destination).",
        ),
    ] = None,
) -> None:
    """Run a comparison worker and alert evaluation without the API, until SIGTERM or Ctrl-C. Start
    as many as the queue needs, beside `isoaudit serve --no-worker` replicas: they share one queue
    (each step is claimed by one worker under a lease, ISOAUDIT_WORKER_LEASE_S)."""
    import signal
    import threading

    from isoaudit.audit.api import ApiSettings
    from isoaudit.audit.api.app import default_alert_engine, install_configured_rules
    from isoaudit.audit.worker import ComparisonWorker, die_with_parent, tell_parent_ready

    die_with_parent()  # a child of `isoaudit serve` goes with it
    settings = ApiSettings.from_env(database_url=database, alert_rules_file=rules, webhook_url=webhook)
    store = open_store(settings.database_url)
    install_configured_rules(store, settings)
    engine = default_alert_engine(store, settings).start()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    comparison = ComparisonWorker(
        store, on_step=engine.evaluate, interval=settings.worker_interval_s, lease_s=settings.worker_lease_s
    ).start()
    console.print(f"comparison worker {comparison.name} on {store.engine.url.render_as_string()}")
    tell_parent_ready()
    stop.wait()
    comparison.stop()
    engine.close()
    store.dispose()
    console.print(f"compared {comparison.compared} samples in {comparison.steps_compared} steps")


@tokens_app.command("create")
def tokens_create(
    project: Annotated[str, typer.Option("--project", help="The project the token may read and write.")],
    name: Annotated[str, typer.Option(help="A note saying who or what uses it.")] = "",
    database: DatabaseOption = None,
) -> None:
    """Create a token and print it (only once: just its hash is stored)."""
    from isoaudit.audit.auth import create_token

    try:
        token = create_token(open_store(database), project, name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--project") from exc
    typer.echo(token)


@tokens_app.command("list")
def tokens_list(
    project: Annotated[str | None, typer.Option(help="Only this project's tokens.")] = None,
    database: DatabaseOption = None,
) -> None:
    """List tokens by id (secrets are never stored, so never shown)."""
    from isoaudit.audit.auth import list_tokens

    table = Table("token id", "project", "name", "created", "revoked")
    for row in list_tokens(open_store(database), project):
        revoked = row.revoked_at.strftime("%Y-%m-%d %H:%M") if row.revoked_at else ""
        table.add_row(row.token_id, row.project, row.name, row.created_at.strftime("%Y-%m-%d %H:%M"), revoked)
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="The id shown by `tokens list` (iso_<id>_...).")],
    database: DatabaseOption = None,
) -> None:
    """Revoke a token: requests with it get 401 from now on."""
    from isoaudit.audit.auth import revoke_token

    if not revoke_token(open_store(database), token_id):
        console.print(f"no live token {token_id!r}")
        raise typer.Exit(1)
    console.print(f"revoked {token_id}")


alerts_app = typer.Typer(help="Alert rules and alerts.", no_args_is_help=True)
app.add_typer(alerts_app, name="alerts")


@alerts_app.command("check")
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


@alerts_app.command("load")
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


@alerts_app.command("rules")
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


@alerts_app.command("list")
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
