"""step summaries: the dashboard's per-step aggregates

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 19:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "step_summaries",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("n_samples", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.BigInteger(), nullable=False),
        sa.Column("position_bins", sa.JSON(), nullable=False),
        sa.Column("first_divergence", sa.JSON(), nullable=False),
        sa.Column("n_fingerprinted", sa.Integer(), nullable=False),
        sa.Column("diagnoses", sa.JSON(), nullable=False),
        sa.Column("ingested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("computed_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.run_id"],
            name=op.f("fk_step_summaries_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_step_summaries")),
    )


def downgrade() -> None:
    op.drop_table("step_summaries")
