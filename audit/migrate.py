"""Apply and inspect the Alembic revisions in ``migrations/`` from code and from the CLI."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine

from audit.store import make_engine


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config that needs no alembic.ini: our script location and the store's URL."""
    from migrations import SCRIPT_LOCATION

    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if url:
        config.set_main_option("sqlalchemy.url", url)
    return config


def upgrade(engine: Engine | str | None = None, revision: str = "head") -> None:
    """Bring the database up to ``revision`` (idempotent: an up-to-date schema is left alone)."""
    engine = engine if isinstance(engine, Engine) else make_engine(engine)
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def current_revision(engine: Engine | str | None = None) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = engine if isinstance(engine, Engine) else make_engine(engine)
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    """The newest revision in ``migrations/versions`` (what ``upgrade`` brings a database to)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head
