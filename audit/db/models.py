"""SQLAlchemy 2.0 ORM tables: the store's schema, mirrored by the Alembic revisions in ``migrations/``.

Records and comparison results first (arrays are kept as little-endian bytes, one row per (run, step, side, sample) for logprobs and one
per (run, step, side, case, sample, region) for fingerprints, so a step of millions of tokens is a
few thousand rows), then the service's tables: API tokens, each run's desired remediation mode,
alert rules, alerts, silences and what was sent about them. Only the data layer (``audit.db``) uses
these classes; everything above it gets typed rows.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from isoaudit.audit.db.types import UtcDateTime
from isoaudit.audit.records import utcnow
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: SQLite only auto-increments INTEGER primary keys; PostgreSQL gets 64-bit ids.
RowId = BigInteger().with_variant(Integer(), "sqlite")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UtcDateTime()}


def _run_fk() -> Mapped[str]:
    return mapped_column(String(128), ForeignKey("runs.run_id", ondelete="CASCADE"))


class RunRow(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    project: Mapped[str] = mapped_column(String(128), default="default", index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ManifestRow(Base):
    __tablename__ = "manifests"
    __table_args__ = (UniqueConstraint("run_id", "content_hash", name="uq_manifests_run_content"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    side: Mapped[str] = mapped_column(String(16))
    case: Mapped[str] = mapped_column(String(32))
    process: Mapped[str] = mapped_column(String(256), default="")
    content_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    body: Mapped[dict[str, Any]] = mapped_column()


class SampleRow(Base):
    __tablename__ = "samples"
    __table_args__ = (
        UniqueConstraint("run_id", "step", "side", "sample_key", name="uq_samples_identity"),
        Index("ix_samples_run_step_key", "run_id", "step", "sample_key"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(BigInteger)
    side: Mapped[str] = mapped_column(String(16))
    sample_key: Mapped[str] = mapped_column(String(32))
    weight_version: Mapped[str | None] = mapped_column(String(128))
    prompt_len: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int | None] = mapped_column(Integer)
    top_p: Mapped[float | None] = mapped_column(Float)
    semantics: Mapped[str] = mapped_column(String(16))
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    topk: Mapped[int | None] = mapped_column(Integer)
    topk_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    topk_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)
    path: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    min_p: Mapped[float | None] = mapped_column(Float)
    #: SampleLogprobs.advantage (the trainer's; None: not recorded)
    advantage: Mapped[float | None] = mapped_column(Float)
    #: [{"start": completion index, "version": weight version}, ...] (SampleLogprobs.weight_spans)
    weight_spans: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: The sender's rank (torch.distributed or the engine worker's), None for a single-process job.
    rank: Mapped[int | None] = mapped_column(Integer)
    #: MoE routing (SampleLogprobs.routes): {"layers", "top_k", "num_experts", "dtype", "n_positions",
    #: "replayed"}; its arrays are in ``routes_data`` (audit.routing.routes_columns).
    routes: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    routes_data: Mapped[bytes | None] = mapped_column(LargeBinary)
    #: SampleLogprobs.dist_sketch: its width and its [n_completion, width] little-endian float32 values
    dist_sketch_dim: Mapped[int | None] = mapped_column(Integer)
    dist_sketch: Mapped[bytes | None] = mapped_column(LargeBinary)


class FingerprintRow(Base):
    __tablename__ = "fingerprints"
    __table_args__ = (
        UniqueConstraint(
            "run_id",
            "step",
            "sample_key",
            "side",
            "case",
            "region",
            "forward_index",
            name="uq_fingerprints_identity",
        ),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(BigInteger)
    sample_key: Mapped[str] = mapped_column(String(32))
    side: Mapped[str] = mapped_column(String(16))
    case: Mapped[str] = mapped_column(String(32))
    region: Mapped[str] = mapped_column(String(128))
    forward_index: Mapped[int] = mapped_column(Integer)
    n_rows: Mapped[int] = mapped_column(Integer)
    ladder_bits: Mapped[list[Any]] = mapped_column()
    sketch_dim: Mapped[int] = mapped_column(Integer)
    positions: Mapped[bytes] = mapped_column(LargeBinary)
    digest: Mapped[bytes] = mapped_column(LargeBinary)
    ladder: Mapped[bytes] = mapped_column(LargeBinary)
    sketch: Mapped[bytes] = mapped_column(LargeBinary)
    l2: Mapped[bytes] = mapped_column(LargeBinary)
    maxabs: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class PendingComparisonRow(Base):
    """Samples whose records changed since they were last compared: the comparison worker's queue."""

    __tablename__ = "pending_comparisons"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    sample_key: Mapped[str] = mapped_column(String(32), primary_key=True)
    queued_at: Mapped[datetime] = mapped_column(default=utcnow)


class SampleResultRow(Base):
    """The comparator's verdict on one sample present on both sides."""

    __tablename__ = "sample_results"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    sample_key: Mapped[str] = mapped_column(String(32), primary_key=True)
    n_tokens: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column()
    diagnosis: Mapped[str] = mapped_column(String(32))
    diagnosis_detail: Mapped[dict[str, Any]] = mapped_column()
    first_divergence_region: Mapped[str | None] = mapped_column(String(128))
    first_divergence_position: Mapped[int | None] = mapped_column(Integer)
    grid: Mapped[dict[str, Any]] = mapped_column(default=dict)
    computed_at: Mapped[datetime] = mapped_column(default=utcnow)


class StepResultRow(Base):
    """Token-weighted metrics of one step over its compared samples, for timelines and alerts."""

    __tablename__ = "step_results"
    #: Runs compared recently (``/metrics`` exports those) come out of one index range scan.
    __table_args__ = (Index("ix_step_results_computed_at", "computed_at", "run_id"),)

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n_samples: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column()
    diagnoses: Mapped[dict[str, Any]] = mapped_column(default=dict)
    computed_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: How many times the step was compared (1 unless records of it arrived after it was compared).
    revision: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    #: The comparison worker that compared it last (``host:pid:nonce``).
    compared_by: Mapped[str | None] = mapped_column(String(128))


class RuleBreachRow(Base):
    """A compared step at which an alert rule's condition held (the rule's window value past its
    threshold), written by the alert engine when it evaluates the step; ``/metrics`` counts these
    rows per run and rule, so a breach between two scrapes still shows, on every replica alike."""

    __tablename__ = "rule_breaches"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    rule_id: Mapped[int] = mapped_column(
        RowId, ForeignKey("alert_rules.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)


class ComparisonClaimRow(Base):
    """A step a comparison worker is comparing now, leased until ``leased_until``: another worker
    skips it until the lease runs out, so a killed worker's step is retaken, and the claim's owner
    alone may save the step's results (``audit.db.results.Results.save_outcomes``)."""

    __tablename__ = "comparison_claims"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    worker: Mapped[str] = mapped_column(String(128))
    claimed_at: Mapped[datetime] = mapped_column(default=utcnow)
    leased_until: Mapped[datetime] = mapped_column()


class StepSummaryRow(Base):
    """What the dashboard draws of one compared step, computed once by the comparison worker
    (``audit.summaries``) so no page ever reads token arrays: |Δ logprob| per response-position bin
    (fixed edges, so steps line up), where first divergences fall, and the diagnosis counts."""

    __tablename__ = "step_summaries"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n_samples: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(BigInteger)
    #: {"count": [...], "mean": [...], "max": [...], "max_key": [...]} per bin of ``audit.summaries.POSITION_BIN_EDGES``.
    position_bins: Mapped[dict[str, Any]] = mapped_column()
    #: {region label: {"count": n, "example": sample_key}} over samples whose first divergence is there.
    first_divergence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    n_fingerprinted: Mapped[int] = mapped_column(Integer, default=0)
    #: {diagnosis kind: number of samples}.
    diagnoses: Mapped[dict[str, Any]] = mapped_column(default=dict)
    #: When the step's latest sample record was stored (maps manifest changes onto steps).
    ingested_at: Mapped[datetime | None] = mapped_column()
    #: MoE routing agreement per layer (audit.routing.step_routing), None for a dense model.
    routing: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    computed_at: Mapped[datetime] = mapped_column(default=utcnow)


class StepStatsRow(Base):
    """The RL loop's own figures of one step (:class:`audit.records.StepStats`), by name."""

    __tablename__ = "step_stats"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: {figure name: value}: reward_mean, reward_std, entropy, clip_fraction, generation_s, training_s, extras.
    figures: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RetentionPolicyRow(Base):
    """How long one project keeps what grows with tokens (``audit.db.retention``): sample arrays for
    ``raw_days`` days after they were stored, every fingerprint for the newest ``fingerprint_steps``
    steps of a run (older compared steps keep their diverged samples' and one clean control's).
    None: kept for ever. ``applied_at``: when a worker last applied it (workers take turns)."""

    __tablename__ = "retention_policies"

    project: Mapped[str] = mapped_column(String(128), primary_key=True)
    raw_days: Mapped[int | None] = mapped_column(Integer)
    fingerprint_steps: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    applied_at: Mapped[datetime | None] = mapped_column()


#: States of an alert that is still open (at most one per rule and run).
OPEN_STATES = ("pending", "firing")


class ApiTokenRow(Base):
    """A bearer token of one project. Only a SHA-256 of the secret is kept; ``token_id`` (public, part
    of the token) finds the row so the secret is then compared in constant time."""

    __tablename__ = "api_tokens"

    token_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()


class RunControlRow(Base):
    """The remediation mode a run's collectors should apply, versioned for optimistic updates."""

    __tablename__ = "run_controls"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    mode: Mapped[str] = mapped_column(String(16), default="native")
    version: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(256), default="")


class AlertRuleRow(Base):
    """One alert rule (DESIGN.md, "Alerts"). ``project`` NULL means it applies to every project's runs."""

    __tablename__ = "alert_rules"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    project: Mapped[str | None] = mapped_column(String(128), index=True)
    metric: Mapped[str] = mapped_column(String(128))
    comparison: Mapped[str] = mapped_column(String(2))
    threshold: Mapped[float] = mapped_column(Float)
    window_steps: Mapped[int] = mapped_column(Integer, default=1)
    aggregation: Mapped[str] = mapped_column(String(8), default="last")
    for_steps: Mapped[int] = mapped_column(Integer, default=0)
    keep_firing_for: Mapped[int] = mapped_column(Integer, default=0)
    severity: Mapped[str] = mapped_column(String(16), default="warning")
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    description: Mapped[str] = mapped_column(Text, default="")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    source: Mapped[str] = mapped_column(String(16), default="api")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AlertRow(Base):
    """One episode of a rule on a run: pending, then firing, then resolved (or back to inactive when it
    cleared before firing). The partial unique index keeps one open alert per (rule, run)."""

    __tablename__ = "alerts"
    __table_args__ = (
        Index(
            "uq_alerts_open_rule_run",
            "rule_id",
            "run_id",
            unique=True,
            sqlite_where=text("state IN ('pending', 'firing')"),
            postgresql_where=text("state IN ('pending', 'firing')"),
        ),
        Index("ix_alerts_run_state", "run_id", "state"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    rule_id: Mapped[int] = mapped_column(RowId, ForeignKey("alert_rules.id", ondelete="CASCADE"))
    run_id: Mapped[str] = mapped_column(String(128), ForeignKey("runs.run_id", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(String(16))
    severity: Mapped[str] = mapped_column(String(16))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    value: Mapped[float | None] = mapped_column(Float)
    started_step: Mapped[int] = mapped_column(BigInteger)
    fired_step: Mapped[int | None] = mapped_column(BigInteger)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    fired_at: Mapped[datetime | None] = mapped_column()
    resolved_at: Mapped[datetime | None] = mapped_column()
    firing_notified: Mapped[bool] = mapped_column(Boolean, default=False)
    resolved_notified: Mapped[bool] = mapped_column(Boolean, default=False)


class SilenceRow(Base):
    """Suppresses notifications (not state changes) of matching alerts until ``ends_at``. A NULL
    matcher matches anything; ``labels`` must all be present on the alert with equal values."""

    __tablename__ = "silences"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    project: Mapped[str | None] = mapped_column(String(128), index=True)
    rule_name: Mapped[str | None] = mapped_column(String(128))
    run_id: Mapped[str | None] = mapped_column(String(128))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    starts_at: Mapped[datetime] = mapped_column(default=utcnow)
    ends_at: Mapped[datetime] = mapped_column()
    created_by: Mapped[str] = mapped_column(String(256), default="")
    comment: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class NotificationRow(Base):
    """What each channel did with one alert transition: sent, failed (with the error) or silenced."""

    __tablename__ = "alert_notifications"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(RowId, ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(16))
    channel: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class NoticeOutboxRow(Base):
    """A notice waiting for (or done with) one destination: written in the transaction that claims
    the announcement, delivered by the worker's thread for that destination, so a notice survives a
    restart and one slow destination holds up no other. ``destination``: a digest of the URL (the
    URL itself is a secret and stays in the configuration); ``attempts_log``: each attempt made;
    ``status``: ``pending`` (a notice to deliver) or ``repost`` (a firing alert's standing re-post to a
    channel that posts firing alerts again, ``audit.alerts.outbox``)."""

    __tablename__ = "alert_outbox"
    __table_args__ = (Index("ix_alert_outbox_destination_status", "destination", "status", "id"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(RowId, ForeignKey("alerts.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(16))
    channel: Mapped[str] = mapped_column(String(64))
    destination: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    notice: Mapped[dict[str, Any]] = mapped_column(default=dict)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    attempts_log: Mapped[list[Any]] = mapped_column(default=list)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    claimed_by: Mapped[str | None] = mapped_column(String(128))
    claimed_until: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
