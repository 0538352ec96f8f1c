"""samples: per-span weight versions and min-p

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 20:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("min_p", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("weight_spans", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_column("weight_spans")
        batch_op.drop_column("min_p")
