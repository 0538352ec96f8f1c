"""Bearer tokens per project: created once (the secret is shown only then), stored hashed, checked in
constant time. No web framework here, so the CLI and tests can create tokens without the API.

A token reads ``iso_<token_id>_<secret>``. ``token_id`` is public and finds the row; the secret is
compared by SHA-256 with :func:`hmac.compare_digest`, so a wrong token takes the same time whatever
prefix of it is right, and the database never holds anything that would let someone authenticate.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from isoaudit.audit.db import Store
from isoaudit.audit.db.tokens import Token, TokenRepository
from isoaudit.audit.records import utcnow

TOKEN_PREFIX = "iso_"
_TOKEN_RE = re.compile(r"^iso_([0-9a-f]{16})_([A-Za-z0-9_-]{20,128})$")
#: A token's public id, bare or with the token's prefix (``iso_<id>``, as `tokens list` shows it).
_TOKEN_ID_RE = re.compile(r"^(?:iso_)?([0-9a-f]{16})$")
_PROJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

#: Compared against when the token id is unknown, so an unknown id costs the same as a wrong secret.
_DUMMY_SHA256 = hashlib.sha256(b"isoaudit: no such token").hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a verified token speaks for."""

    project: str
    token_id: str


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_project_name(project: str) -> str:
    """The project name, or ``ValueError`` naming what is wrong with it."""
    if not _PROJECT_RE.match(project):
        raise ValueError(f"project: {project!r} must be 1-128 of A-Z a-z 0-9 . _ : - (starting alphanumeric)")
    return project


def create_token(store: Store, project: str, name: str = "") -> str:
    """Create a token for ``project`` and return it; only its hash is stored, so this is the one
    chance to see it."""
    check_project_name(project)
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    TokenRepository(store.sessions).create(token_id, project, name, _sha256(secret))
    return f"{TOKEN_PREFIX}{token_id}_{secret}"


def verify_token(store: Store, token: str) -> Principal | None:
    """The project ``token`` belongs to, or ``None`` for a malformed, unknown, wrong or revoked one."""
    match = _TOKEN_RE.match(token.strip())
    token_id, secret = match.groups() if match else ("", token)
    found = TokenRepository(store.sessions).find(token_id) if match else None
    expected = found.secret_sha256 if found is not None else _DUMMY_SHA256
    if (
        not hmac.compare_digest(_sha256(secret), expected)
        or found is None
        or found.token.revoked_at is not None
    ):
        return None
    return Principal(project=found.token.project, token_id=found.token.token_id)


class TokenNotRecognised(ValueError):
    """What was given is no token of this store (malformed, or a secret that does not match its
    id); the message never repeats it, since it may hold a secret."""


def token_id_of(store: Store, token_or_id: str) -> str:
    """The public id of a token given whole (``iso_<id>_<secret>``: its secret must match the stored
    hash) or by its id (``<id>`` or ``iso_<id>``). Raises :class:`TokenNotRecognised`."""
    given = token_or_id.strip()
    by_id = _TOKEN_ID_RE.match(given)
    if by_id:
        return by_id.group(1)
    whole = _TOKEN_RE.match(given)
    if not whole:
        raise TokenNotRecognised(
            "token: expected a token (iso_<id>_<secret>) or its id (16 hex digits, as `isoaudit tokens "
            "list` shows it)"
        )
    token_id, secret = whole.groups()
    found = TokenRepository(store.sessions).find(token_id)
    if found is not None and not hmac.compare_digest(_sha256(secret), found.secret_sha256):
        raise TokenNotRecognised(
            f"token: its secret is not that of token {token_id}; nothing was revoked (give the id alone "
            "to revoke that token whatever its secret)"
        )
    return token_id


def revoke_token(store: Store, token_or_id: str) -> bool:
    """Revoke a token, given whole or by its public id (:func:`token_id_of`); ``False`` if there is
    no such live token."""
    return TokenRepository(store.sessions).revoke(token_id_of(store, token_or_id), utcnow())


def list_tokens(store: Store, project: str | None = None) -> list[Token]:
    """Tokens (ids, projects, names, dates; never secrets), newest first."""
    return TokenRepository(store.sessions).list(project)
