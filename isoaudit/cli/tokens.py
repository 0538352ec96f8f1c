"""``isoaudit tokens``: bearer tokens of the API."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from isoaudit.cli.common import DatabaseOption, console, open_store

app = typer.Typer(help="Bearer tokens of the API, one or more per project.", no_args_is_help=True)


@app.command("create")
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


@app.command("list")
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


@app.command("revoke")
def tokens_revoke(
    token: Annotated[
        str,
        typer.Argument(
            help="The token itself (iso_<id>_<secret>, e.g. the one that leaked) or its id, as `tokens list` "
            "shows it.",
            metavar="TOKEN_OR_ID",
        ),
    ],
    database: DatabaseOption = None,
) -> None:
    """Revoke a token: requests with it get 401 from now on. The secret is never printed."""
    from isoaudit.audit.auth import TokenNotRecognised, revoke_token, token_id_of

    store = open_store(database)
    try:
        token_id = token_id_of(store, token)
    except TokenNotRecognised as exc:
        raise typer.BadParameter(str(exc), param_hint="TOKEN_OR_ID") from None
    if not revoke_token(store, token_id):
        console.print(f"no live token with id {token_id}")
        raise typer.Exit(1)
    console.print(f"revoked token {token_id}")
