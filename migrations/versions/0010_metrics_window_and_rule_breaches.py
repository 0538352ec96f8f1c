"""metrics window and rule breaches: an index on step_results.computed_at (the runs compared
recently, what /metrics exports, without a scan of every step) and a row per compared step at which
an alert rule's condition held (what /metrics counts per run and rule)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("step_results", schema=None) as batch_op:
        batch_op.create_index("ix_step_results_computed_at", ["computed_at", "run_id"], unique=False)
    op.create_table(
        "rule_breaches",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rule_id", _ROW_ID, nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_rule_breaches_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["rule_id"],
            ["alert_rules.id"],
            name=op.f("fk_rule_breaches_rule_id_alert_rules"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "rule_id", "step", name=op.f("pk_rule_breaches")),
    )


def downgrade() -> None:
    op.drop_table("rule_breaches")
    with op.batch_alter_table("step_results", schema=None) as batch_op:
        batch_op.drop_index("ix_step_results_computed_at")
