"""``isoaudit dashboard``: serve the Dash dashboard over a store, through gunicorn (Flask's
development server only with ``--dev``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any

import typer

from isoaudit.cli.common import DatabaseOption, console, open_store

if TYPE_CHECKING:
    from flask import Flask


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


def bind_address(host: str, port: int) -> str:
    """gunicorn's ``host:port`` (an IPv6 address in brackets)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def gunicorn_server(app_factory: Callable[[], Flask], options: Mapping[str, Any]) -> Any:
    """A gunicorn application serving what ``app_factory`` builds, configured by ``options``
    (gunicorn's setting names). The factory runs in each worker after the fork, so every worker
    opens its own database connections (a pooled connection must never cross a fork)."""
    from gunicorn.app.base import BaseApplication

    class DashboardServer(BaseApplication):  # gunicorn ships no type hints: Any to mypy
        def load_config(self) -> None:
            for key, value in options.items():
                if key in self.cfg.settings:  # a setting newer than the installed gunicorn is skipped
                    self.cfg.set(key, value)

        def load(self) -> Flask:
            return app_factory()

    return DashboardServer()


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
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            envvar="ISOAUDIT_DASHBOARD_WORKERS",
            min=1,
            help="gunicorn worker processes (each serves --threads requests at once).",
        ),
    ] = 2,
    threads: Annotated[int, typer.Option("--threads", min=1, help="Threads per worker process.")] = 4,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev", help="Serve with Flask's development server (one process) instead of gunicorn."
        ),
    ] = False,
) -> None:
    """Serve the dashboard: runs, heatmaps, samples, contracts, alerts and the remediation toggle,
    through gunicorn with --workers processes (--dev: Flask's development server)."""
    credentials = parse_auth(auth)
    if credentials is None and not is_loopback(host):
        console.print(
            f"[red]refusing to serve the dashboard on {host} without credentials[/red]: it can change a "
            "run's remediation mode. Give --auth user:password (or ISOAUDIT_DASHBOARD_AUTH), or bind to 127.0.0.1."
        )
        raise typer.Exit(2)
    from isoaudit.dashboard import create_app  # the CLI is the composition root (see the import contract)

    # Open the store once here: a bad URL or a schema to upgrade is said before anything serves, and
    # an embedded SQLite file gets its schema before the workers open it.
    store = open_store(database)
    url = store.engine.url.render_as_string(hide_password=False)
    shown = f"isoaudit dashboard on http://{bind_address(host, port)}" + (
        " (basic auth)" if credentials else ""
    )
    if dev:
        dash_app = create_app(store, auth=credentials, live_interval_ms=live_interval_ms)
        console.print(f"{shown}, Flask's development server (--dev)")
        dash_app.run(host=host, port=port, debug=False)
        return
    store.dispose()

    def build() -> Flask:
        return create_app(url, auth=credentials, live_interval_ms=live_interval_ms).server

    options = {
        "bind": bind_address(host, port),
        "workers": workers,
        "worker_class": "gthread",
        "threads": threads,
        "timeout": 120,  # a page over a large run may take a while to draw; a hung worker is replaced
        "graceful_timeout": 20,
        "proc_name": "isoaudit-dashboard",
        # gunicorn's runtime control socket sits at one path per user: two dashboards would share it.
        "control_socket_disable": True,
        "errorlog": "-",
        "loglevel": "info",
    }
    console.print(f"{shown}, gunicorn with {workers} worker{'s' if workers != 1 else ''} x {threads} threads")
    gunicorn_server(build, options).run()
