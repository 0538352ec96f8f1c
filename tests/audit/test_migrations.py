"""The Alembic revisions and the ORM describe the same schema, on SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from isoaudit.audit.db import Store, StoreError
from isoaudit.audit.db.engine import make_engine
from isoaudit.audit.db.models import Base
from isoaudit.audit.db.schema import current_revision, head_revision, include_name, upgrade
from sqlalchemy import text

from tests import factories


def test_migrated_schema_matches_the_orm(blank_database_url: str):
    engine = make_engine(blank_database_url)
    upgrade(engine)
    upgrade(engine)  # a second upgrade is a no-op
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "include_name": include_name}
        )
        differences = compare_metadata(context, Base.metadata)
    assert differences == []
    assert current_revision(engine) is not None
    engine.dispose()


def test_only_sqlite_upgrades_itself(blank_database_url: str):
    """The embedded SQLite default needs no set-up; any other database is migrated on purpose, by
    `isoaudit db upgrade`, and a store refuses one whose schema is behind, saying so."""
    if blank_database_url.startswith("sqlite"):
        with pytest.raises(StoreError, match="isoaudit db upgrade"):
            Store(blank_database_url, upgrade=False)
        Store(blank_database_url).dispose()
        assert current_revision(blank_database_url) == head_revision()
        return
    with pytest.raises(StoreError, match=r"no schema .* run `isoaudit db upgrade`"):
        Store(blank_database_url)
    assert current_revision(blank_database_url) is None  # nothing was created
    upgrade(blank_database_url, "0002")
    with pytest.raises(StoreError, match=r"revision '0002'.*run `isoaudit db upgrade`"):
        Store(blank_database_url)
    upgrade(blank_database_url)
    store = Store(blank_database_url)
    assert store.ingest([factories.run()]).stored["run"] == 1
    store.dispose()


def test_a_schema_newer_than_this_isoaudit_is_refused(database_url: str):
    Store(database_url).dispose()
    engine = make_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    for upgrade_flag in (None, True):
        with pytest.raises(StoreError, match="newer than this isoaudit knows"):
            Store(database_url, upgrade=upgrade_flag)


def test_stores_opening_one_fresh_sqlite_file_at_once_all_open_it(tmp_path):
    """A job's sinks and its comparer open the embedded store's new file at the same moment: each
    waits for the one creating the schema, none fails with "table already exists" or "locked"."""
    import threading

    for attempt in range(15):
        url = f"sqlite:///{tmp_path / f'fresh-{attempt}.db'}"
        errors: list[Exception] = []

        def open_it(url: str = url, errors: list[Exception] = errors) -> None:
            try:
                Store(url).dispose()
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=open_it) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [], f"attempt {attempt}: {errors[0]}"
        assert current_revision(make_engine(url)) == head_revision()
