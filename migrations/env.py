"""Alembic environment: runs on the connection and metadata that isoaudit's data layer hands in.

The scripts import nothing of isoaudit: the data layer (``isoaudit.audit.db.schema``) applies them
when a store opens or on ``isoaudit db upgrade``, passing ``connection`` and ``target_metadata``
in ``config.attributes``. Write a new revision the same way, from Python::

    from alembic import command
    from isoaudit.audit.db.schema import alembic_config
    command.revision(alembic_config("sqlite:///dev.db"), "what changes", autogenerate=True)
"""

from alembic import context
from sqlalchemy import create_engine, pool

config = context.config
target_metadata = config.attributes.get("target_metadata")
include_name = config.attributes.get("include_name")  # leaves the tables' partitions out


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("sqlalchemy.url: no database to migrate (run `isoaudit db upgrade`)")
    with create_engine(url, poolclass=pool.NullPool).connect() as connection:
        _run(connection)


def _run(connection) -> None:
    # render_as_batch lets later revisions alter tables on SQLite, which lacks most ALTER TABLE forms.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
        include_name=include_name,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
