"""Where the store lives: ``ISOAUDIT_DATABASE_URL``, else an SQLite file in the working directory."""

from __future__ import annotations

import os

DEFAULT_DATABASE_URL = "sqlite:///./isoaudit.db"


def database_url(explicit: str | None = None) -> str:
    """The URL to use: an explicit one wins, then the environment, then the SQLite default."""
    url = explicit or os.environ.get("ISOAUDIT_DATABASE_URL") or DEFAULT_DATABASE_URL
    # Users paste libpq URLs; SQLAlchemy needs the driver named to pick psycopg 3.
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url
