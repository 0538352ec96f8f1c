"""``isoaudit db``: the store's schema."""

from __future__ import annotations

from typing import Annotated

import typer

from isoaudit.audit.config import database_url
from isoaudit.cli.common import DatabaseOption, console, redact

app = typer.Typer(help="The store's schema.", no_args_is_help=True)


@app.command("upgrade")
def db_upgrade(
    database: DatabaseOption = None,
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Apply the schema migrations (safe to run again)."""
    from isoaudit.audit.db.schema import current_revision, upgrade

    url = database_url(database)
    upgrade(url, revision)
    console.print(f"database at revision [bold]{current_revision(url)}[/bold] ({redact(url)})")
