"""samples: the full-vocabulary distribution sketch per completion token (audit.distribution)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 22:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("dist_sketch_dim", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("dist_sketch", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_column("dist_sketch")
        batch_op.drop_column("dist_sketch_dim")
