"""Bearer tokens in the database (``api_tokens``): created, found by their public id, listed and
revoked. Only a SHA-256 of each secret is ever stored; checking a token is ``audit.auth``'s work."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from datetime import datetime

from isoaudit.audit.db.alerts import utc
from isoaudit.audit.db.models import ApiTokenRow
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker


@dataclass(frozen=True)
class Token:
    """A token as listed: its public id, project, name and dates (never its secret)."""

    token_id: str
    project: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class HashedToken:
    """A token with the SHA-256 of its secret, for checking a presented one."""

    token: Token
    secret_sha256: str


def _token(row: ApiTokenRow) -> Token:
    revoked = row.revoked_at
    return Token(
        row.token_id, row.project, row.name, utc(row.created_at), None if revoked is None else utc(revoked)
    )


class TokenRepository:
    """The project tokens of the service."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def create(self, token_id: str, project: str, name: str, secret_sha256: str) -> None:
        with self.sessions.begin() as session:
            session.add(
                ApiTokenRow(token_id=token_id, project=project, name=name, secret_sha256=secret_sha256)
            )

    def find(self, token_id: str) -> HashedToken | None:
        """The token of that id with its secret's hash, revoked or not; None if there is none."""
        with self.sessions() as session:
            row = session.get(ApiTokenRow, token_id)
            return None if row is None else HashedToken(_token(row), row.secret_sha256)

    def revoke(self, token_id: str, at: datetime) -> bool:
        """Revoke a token as of ``at``; False if there is no such live token."""
        with self.sessions.begin() as session:
            row = session.get(ApiTokenRow, token_id)
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = at
            return True

    def list(self, project: str | None = None) -> builtins.list[Token]:
        """Tokens newest first, of one project or all."""
        query = select(ApiTokenRow).order_by(ApiTokenRow.created_at.desc())
        if project is not None:
            query = query.where(ApiTokenRow.project == project)
        with self.sessions() as session:
            return [_token(row) for row in session.scalars(query)]
