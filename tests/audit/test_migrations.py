"""The Alembic revisions and the ORM describe the same schema, on SQLite and on PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from audit.migrate import current_revision, upgrade
from audit.models import Base
from audit.store import make_engine


def test_migrated_schema_matches_the_orm(database_url: str):
    engine = make_engine(database_url)
    upgrade(engine)
    upgrade(engine)  # a second upgrade is a no-op
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        differences = compare_metadata(context, Base.metadata)
    assert differences == []
    assert current_revision(engine) is not None
    engine.dispose()
