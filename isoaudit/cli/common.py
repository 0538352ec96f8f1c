"""What every command shares: the console, the --database-url / --rules / --webhook / --alertmanager
options, and
opening the store with an error a user can act on."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from isoaudit.audit.config import database_url

if TYPE_CHECKING:
    from isoaudit.audit.db import Store

# Piped output (CI logs, scripts) gets wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 160)
DatabaseOption = Annotated[
    str | None,
    typer.Option("--database-url", envvar="ISOAUDIT_DATABASE_URL", help="SQLAlchemy URL of the store."),
]
RulesOption = Annotated[
    str | None, typer.Option("--rules", envvar="ISOAUDIT_ALERT_RULES", help="YAML file of alert rules.")
]
WebhookOption = Annotated[
    str | None,
    typer.Option(
        "--webhook",
        envvar="ISOAUDIT_ALERT_WEBHOOK_URL",
        help="Slack-compatible webhook(s) for alerts: one URL, or several separated by commas (each its own destination).",
    ),
]

AlertmanagerOption = Annotated[
    str | None,
    typer.Option(
        "--alertmanager",
        envvar="ISOAUDIT_ALERTMANAGER_URL",
        help="Alertmanager base URL(s) for alerts (posted to /api/v2/alerts, re-posted while firing): one URL, or several separated by commas (each its own destination).",
    ),
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
            f"[red]database: cannot open {redact(database_url(database))}: {cause.__class__.__name__}: {getattr(cause, 'orig', cause)}[/red]"
        )
    except StoreError as exc:
        console.print(f"[red]{exc}[/red]")
    raise typer.Exit(1)


def redact(url: str) -> str:
    """The URL without its password, for printing."""
    from isoaudit.audit.db import redacted_url

    return redacted_url(url)
