"""``isoaudit dashboard``: serve the Dash dashboard over a store."""

from __future__ import annotations

import ipaddress
from typing import Annotated

import typer

from isoaudit.cli.common import DatabaseOption, console


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """``user:password`` -> (user, password); the password may itself contain ':'."""
    if value is None or value == "":
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise typer.BadParameter("expected user:password (both non-empty)", param_hint="--auth")
    return user, password


app = typer.Typer()


@app.command("dashboard")
def dashboard(
    database: DatabaseOption = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8050,
    auth: Annotated[
        str | None,
        typer.Option(
            "--auth",
            envvar="ISOAUDIT_DASHBOARD_AUTH",
            help="user:password for HTTP basic auth (required unless bound to loopback).",
            show_default=False,
        ),
    ] = None,
    live_interval_ms: Annotated[int, typer.Option(help="How often live pages poll (ms).", min=250)] = 5000,
) -> None:
    """Serve the dashboard: runs, heatmaps, samples, contracts, alerts and the remediation toggle."""
    credentials = parse_auth(auth)
    if credentials is None and not is_loopback(host):
        console.print(
            f"[red]refusing to serve the dashboard on {host} without credentials[/red]: it can change a "
            "run's remediation mode. Give --auth user:password (or ISOAUDIT_DASHBOARD_AUTH), or bind to 127.0.0.1."
        )
        raise typer.Exit(2)
    from isoaudit.dashboard import create_app  # the CLI is the composition root (see the import contract)

    dash_app = create_app(database, auth=credentials, live_interval_ms=live_interval_ms)
    console.print(f"isoaudit dashboard on http://{host}:{port}" + (" (basic auth)" if credentials else ""))
    dash_app.run(host=host, port=port, debug=False)
