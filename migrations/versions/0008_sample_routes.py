"""samples.routes and samples.routes_data (MoE routing per token); step_summaries.routing

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 23:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("routes", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("routes_data", sa.LargeBinary(), nullable=True))
    with op.batch_alter_table("step_summaries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("routing", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_summaries", schema=None) as batch_op:
        batch_op.drop_column("routing")
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_column("routes_data")
        batch_op.drop_column("routes")
