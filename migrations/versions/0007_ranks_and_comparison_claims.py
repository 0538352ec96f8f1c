"""ranks and comparison claims: which rank sent a sample; a leased claim per step being compared, so
several comparison workers share one queue and compare each step once

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 23:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rank", sa.Integer(), nullable=True))
    with op.batch_alter_table("step_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("revision", sa.Integer(), server_default="1", nullable=False))
        batch_op.add_column(sa.Column("compared_by", sa.String(length=128), nullable=True))
    op.create_table(
        "comparison_claims",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("worker", sa.String(length=128), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("leased_until", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_comparison_claims_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_comparison_claims")),
    )


def downgrade() -> None:
    op.drop_table("comparison_claims")
    with op.batch_alter_table("step_results", schema=None) as batch_op:
        batch_op.drop_column("compared_by")
        batch_op.drop_column("revision")
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_column("rank")
