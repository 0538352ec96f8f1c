"""samples and fingerprints partitioned by hash of run on PostgreSQL; retention_policies

The two tables that grow with tokens become ``PARTITION BY HASH (run_id)`` tables of ``PARTITIONS``
partitions, their rows moved over in the migration's transaction (a populated database keeps every
row, its id and the id sequence). Their primary key becomes (id, run_id): PostgreSQL requires a
partitioned table's unique keys to hold the partition key; the identity keys already do, so
ingest's ``ON CONFLICT`` keeps working. SQLite has no partitions: there the revision only adds
``retention_policies``.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 01:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Hash partitions per table: a run's rows all land in one, so a step's read and a run's retention
#: delete touch one partition; 16 keeps each small at hundreds of GB without planning overhead.
PARTITIONS = 16

#: table -> (its unique identity columns, its other indexes as name -> columns)
TABLES: dict[str, tuple[tuple[str, ...], dict[str, tuple[str, ...]]]] = {
    "samples": (
        ("run_id", "step", "side", "sample_key"),
        {"ix_samples_run_step_key": ("run_id", "step", "sample_key")},
    ),
    "fingerprints": (
        ("run_id", "step", "sample_key", "side", "case", "region", "forward_index"),
        {},
    ),
}


#: The array columns of each table.
ARRAYS = {
    "samples": ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "routes_data", "dist_sketch"),
    "fingerprints": ("positions", "digest", "ladder", "sketch", "l2", "maxabs"),
}


def _columns(names: Sequence[str]) -> str:
    return ", ".join(f'"{name}"' for name in names)


def _rebuild(table: str, *, partitioned: bool) -> None:
    """Replace ``table`` by a copy of its columns, partitioned or not, and move its rows over."""
    old = f"{table}_before_0013"
    identity, indexes = TABLES[table]
    uq = "uq_samples_identity" if table == "samples" else "uq_fingerprints_identity"
    execute = op.execute
    execute(f"ALTER TABLE {table} RENAME TO {old}")
    for name in (f"pk_{table}", uq):
        execute(f"ALTER TABLE {old} RENAME CONSTRAINT {name} TO {name}_old")
    execute(f"ALTER TABLE {old} RENAME CONSTRAINT fk_{table}_run_id_runs TO fk_{table}_run_id_runs_old")
    for name in indexes:
        execute(f"ALTER INDEX {name} RENAME TO {name}_old")
    scheme = " PARTITION BY HASH (run_id)" if partitioned else ""
    execute(f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS INCLUDING STORAGE){scheme}")
    if partitioned:
        for i in range(PARTITIONS):
            execute(
                f"CREATE TABLE {table}_p{i:02d} PARTITION OF {table} "
                f"FOR VALUES WITH (MODULUS {PARTITIONS}, REMAINDER {i})"
            )
    execute(f"INSERT INTO {table} SELECT * FROM {old}")
    execute(f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id")
    execute(f"DROP TABLE {old}")
    key = "id, run_id" if partitioned else "id"
    execute(f"ALTER TABLE {table} ADD CONSTRAINT pk_{table} PRIMARY KEY ({key})")
    execute(f"ALTER TABLE {table} ADD CONSTRAINT {uq} UNIQUE ({_columns(identity)})")
    for name, columns in indexes.items():
        execute(f"CREATE INDEX {name} ON {table} ({_columns(columns)})")
    execute(
        f"ALTER TABLE {table} ADD CONSTRAINT fk_{table}_run_id_runs FOREIGN KEY (run_id) "
        "REFERENCES runs (run_id) ON DELETE CASCADE"
    )
    # Token ids, logprobs and fingerprints are random-looking bytes pglz barely shrinks: store them
    # out of line without the compression attempt (partitions follow their parent).
    storage = "EXTERNAL" if partitioned else "EXTENDED"
    execute(
        f"ALTER TABLE {table} {', '.join(f'ALTER COLUMN {c} SET STORAGE {storage}' for c in ARRAYS[table])}"
    )


def upgrade() -> None:
    op.create_table(
        "retention_policies",
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("raw_days", sa.Integer(), nullable=True),
        sa.Column("fingerprint_steps", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("project", name=op.f("pk_retention_policies")),
    )
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            _rebuild(table, partitioned=True)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            _rebuild(table, partitioned=False)
    op.drop_table("retention_policies")
