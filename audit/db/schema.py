"""The schema's version: apply and inspect the Alembic revisions in ``migrations/`` from code and from
the CLI (``isoaudit db upgrade``), and decide whether a store may open a database (:func:`ensure_schema`)."""

from __future__ import annotations

import re
from functools import cache

from alembic import command
from alembic.config import Config
from isoaudit.audit.config import database_url
from isoaudit.audit.db.engine import StoreError, make_engine
from isoaudit.audit.db.models import Base
from isoaudit.migrations import SCRIPT_LOCATION
from sqlalchemy import Engine

#: The partitions of the tables PostgreSQL partitions by run (``samples_p00``...): the migrations
#: create them, the ORM maps their parent alone.
_PARTITION = re.compile(r"^(samples|fingerprints)_p\d+$")


def include_name(name: str | None, type_: str, _parents: object) -> bool:
    """Alembic's ``include_name`` for comparing the database with the ORM: leaves partitions out."""
    return not (type_ == "table" and name is not None and _PARTITION.match(name))


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config that needs no alembic.ini: the scripts' location, the models' metadata (for
    autogenerate) and the store's URL (its driver form, as the store opens it)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["target_metadata"] = Base.metadata
    config.attributes["include_name"] = include_name
    if url:
        config.set_main_option("sqlalchemy.url", database_url(url))
    return config


def upgrade(engine: Engine | str | None = None, revision: str = "head") -> None:
    """Bring the database up to ``revision`` (idempotent: an up-to-date schema is left alone).

    On SQLite the whole upgrade is one ``BEGIN IMMEDIATE`` transaction: processes opening a fresh
    file at the same moment (a job's sinks and its comparer) take turns, and each after the first
    finds the schema at head, instead of creating the same tables twice."""
    engine = engine if isinstance(engine, Engine) else make_engine(engine)
    config = alembic_config()
    with engine.begin() as connection:
        if engine.dialect.name == "sqlite":
            connection.exec_driver_sql("BEGIN IMMEDIATE")  # the driver issues no BEGIN before DDL
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def current_revision(engine: Engine | str | None = None) -> str | None:
    """The revision the database is at (None: no schema yet)."""
    from alembic.runtime.migration import MigrationContext

    engine = engine if isinstance(engine, Engine) else make_engine(engine)
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


@cache
def _revisions() -> tuple[str, frozenset[str]]:
    """The head revision and every revision this version of isoaudit ships, read together once."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config())
    head = scripts.get_current_head()
    assert head is not None
    return head, frozenset(script.revision for script in scripts.walk_revisions())


def head_revision() -> str:
    """The newest revision in ``migrations/versions`` (what ``upgrade`` brings a database to)."""
    return _revisions()[0]


def known_revisions() -> frozenset[str]:
    """Every revision this version of isoaudit ships."""
    return _revisions()[1]


def ensure_schema(engine: Engine, *, may_upgrade: bool) -> None:
    """Return if the database is at the head revision; else upgrade it when ``may_upgrade``, or raise
    :class:`StoreError` saying what to run. A schema newer than this isoaudit knows is always refused
    (an older client must not write into tables it does not understand)."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    if current is not None and current not in known_revisions():
        raise StoreError(
            f"database: schema revision {current!r} is newer than this isoaudit knows (its newest is "
            f"{head!r}); upgrade isoaudit"
        )
    if not may_upgrade:
        at = f"revision {current!r}" if current else "no schema (an empty database)"
        raise StoreError(
            f"database: at {at}, but this isoaudit needs revision {head!r}: run `isoaudit db upgrade` "
            "(with the same ISOAUDIT_DATABASE_URL or --database-url)"
        )
    try:
        upgrade(engine)
    except Exception:
        # Another process may have upgraded the same database at the same moment: fine if it is done.
        if current_revision(engine) != head:
            raise
