"""The views the CLI, the API and the dashboard's pages read, as plain frozen objects (no ORM rows, no Dash).

Every query here reads small rows: step results, the per-step aggregates of ``audit.summaries``,
sample verdicts without their grids, manifests, alerts. The only arrays ever read are one sample's
two logprob arrays, for that sample's own page (:func:`sample_detail`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from isoaudit.audit.alerts.history import AlertView, list_alerts
from isoaudit.audit.alerts.rules import AlertRule, list_rule_rows, rule_from_row
from isoaudit.audit.alerts.silences import list_silences
from isoaudit.audit.compare import RegionGrid
from isoaudit.audit.contract import HandshakeResult, handshake
from isoaudit.audit.control import ControlRecord
from isoaudit.audit.db.models import (
    OPEN_STATES,
    AlertRow,
    ManifestRow,
    RunRow,
    SampleResultRow,
    SampleRow,
    SilenceRow,
    StepResultRow,
    StepSummaryRow,
)
from isoaudit.audit.db.runs import MAX_PAGE
from isoaudit.audit.db.store import Store
from isoaudit.audit.records import Manifest, utcnow
from sqlalchemy import func, select
from sqlalchemy.orm import Session

SIDES = ("trainer", "rollout")

#: A run whose newest record is older than this is idle: its pages stop polling.
LIVE_WITHIN = timedelta(minutes=2)


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes of what were UTC ones."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=utcnow().tzinfo)


# ---------------------------------------------------------------------- runs overview


@dataclass(frozen=True)
class AppliedMode:
    """The remediation mode one side last reported in a manifest, and when."""

    side: str
    mode: str | None
    at: datetime | None


@dataclass(frozen=True)
class RunOverview:
    run_id: str
    project: str
    name: str
    started_at: datetime
    config: dict[str, Any]
    status: str  # "live" | "idle"
    last_step: int | None
    last_ingest_at: datetime | None
    kl_k3: float | None
    exact_match_fraction: float | None
    sparkline: list[tuple[int, float | None]]
    open_alerts: int
    control: ControlRecord
    applied: dict[str, AppliedMode]


def _latest_ingest(session: Session, run_id: str) -> tuple[int | None, datetime | None]:
    """The run's newest step with samples and when its latest sample arrived (index lookups only)."""
    last = session.scalar(select(func.max(SampleRow.step)).where(SampleRow.run_id == run_id))
    if last is None:
        return None, None
    at = session.scalar(
        select(func.max(SampleRow.created_at)).where(SampleRow.run_id == run_id, SampleRow.step == last)
    )
    return last, aware(at)


def applied_modes(manifests: Sequence[Manifest]) -> dict[str, AppliedMode]:
    """Each side's last reported remediation mode (manifests oldest first, as the store returns them)."""
    found = {side: AppliedMode(side, None, None) for side in SIDES}
    for manifest in manifests:
        found[manifest.side] = AppliedMode(manifest.side, manifest.runtime.remediation, manifest.created_at)
    return found


def run_status(last_ingest_at: datetime | None, now: datetime | None = None) -> str:
    """``live`` while records arrived within :data:`LIVE_WITHIN`, else ``idle``."""
    now = now or utcnow()
    return "live" if last_ingest_at is not None and now - last_ingest_at <= LIVE_WITHIN else "idle"


def _overview(store: Store, run: RunRow, open_alerts: int, spark: int, now: datetime) -> RunOverview:
    with store.sessions() as session:
        last_step, last_ingest = _latest_ingest(session, run.run_id)
        newest_first = session.execute(
            select(StepResultRow.step, StepResultRow.metrics)
            .where(StepResultRow.run_id == run.run_id)
            .order_by(StepResultRow.step.desc())
            .limit(spark)
        ).all()
    recent = newest_first[::-1]
    latest = recent[-1][1] if recent else {}
    return RunOverview(
        run_id=run.run_id,
        project=run.project,
        name=run.name,
        started_at=aware(run.started_at) or now,
        config=dict(run.config),
        status=run_status(last_ingest, now),
        last_step=last_step,
        last_ingest_at=last_ingest,
        kl_k3=latest.get("kl_k3"),
        exact_match_fraction=latest.get("exact_match_fraction"),
        sparkline=[(step, metrics.get("kl_k3")) for step, metrics in recent],
        open_alerts=open_alerts,
        control=store.get_control(run.run_id),
        applied=applied_modes(store.manifests(run.run_id)),
    )


def runs_overview(
    store: Store, *, project: str | None = None, spark: int = 50, now: datetime | None = None
) -> list[RunOverview]:
    """Every run, newest first, with what the runs page shows of it."""
    now = now or utcnow()
    query = select(RunRow).order_by(RunRow.started_at.desc(), RunRow.run_id)
    if project is not None:
        query = query.where(RunRow.project == project)
    open_query = (
        select(AlertRow.run_id, func.count()).where(AlertRow.state.in_(OPEN_STATES)).group_by(AlertRow.run_id)
    )
    with store.sessions() as session:
        runs = list(session.scalars(query))
        open_alerts = dict(session.execute(open_query).all())
    return [_overview(store, run, open_alerts.get(run.run_id, 0), spark, now) for run in runs]


def run_overview(store: Store, run_id: str, *, now: datetime | None = None) -> RunOverview | None:
    """One run's overview (None if unknown)."""
    with store.sessions() as session:
        run = session.get(RunRow, run_id)
        if run is None:
            return None
        n_open = session.scalar(
            select(func.count()).where(AlertRow.run_id == run_id, AlertRow.state.in_(OPEN_STATES))
        )
    return _overview(store, run, int(n_open or 0), 50, now or utcnow())


# ---------------------------------------------------------------------- per-step series


@dataclass(frozen=True)
class StepPoint:
    """One compared step: its metrics (``step_results``) and its aggregates (``step_summaries``)."""

    step: int
    n_samples: int
    metrics: dict[str, Any]
    position_bins: dict[str, list[Any]] = field(default_factory=dict)
    first_divergence: dict[str, dict[str, Any]] = field(default_factory=dict)
    diagnoses: dict[str, int] = field(default_factory=dict)
    n_fingerprinted: int = 0
    ingested_at: datetime | None = None


def step_series(
    store: Store, run_id: str, *, after_step: int | None = None, step: int | None = None
) -> list[StepPoint]:
    """The run's compared steps in order (only those after ``after_step``, for a live update, or
    only ``step``)."""
    query = (
        select(StepResultRow.step, StepResultRow.n_samples, StepResultRow.metrics, StepSummaryRow)
        .outerjoin(
            StepSummaryRow,
            (StepSummaryRow.run_id == StepResultRow.run_id) & (StepSummaryRow.step == StepResultRow.step),
        )
        .where(StepResultRow.run_id == run_id)
        .order_by(StepResultRow.step)
    )
    if after_step is not None:
        query = query.where(StepResultRow.step > after_step)
    if step is not None:
        query = query.where(StepResultRow.step == step)
    with store.sessions() as session:
        rows = session.execute(query).all()
    points = []
    for number, n_samples, metrics, summary in rows:
        if summary is None:
            points.append(StepPoint(number, n_samples, dict(metrics)))
            continue
        points.append(
            StepPoint(
                number,
                n_samples,
                dict(metrics),
                dict(summary.position_bins),
                dict(summary.first_divergence),
                dict(summary.diagnoses),
                summary.n_fingerprinted,
                aware(summary.ingested_at),
            )
        )
    return points


def step_point(store: Store, run_id: str, step: int) -> StepPoint | None:
    """One compared step (None if not compared)."""
    found = step_series(store, run_id, step=step)
    return found[0] if found else None


def last_compared_step(store: Store, run_id: str) -> int | None:
    with store.sessions() as session:
        return session.scalar(select(func.max(StepResultRow.step)).where(StepResultRow.run_id == run_id))


# ---------------------------------------------------------------------- a step's samples


@dataclass(frozen=True)
class SampleVerdict:
    """One row of a step's sample table."""

    sample_key: str
    n_tokens: int
    abs_diff_mean: float | None
    abs_diff_max: float | None
    kl_k3: float | None
    exact_match_fraction: float | None
    first_divergence_region: str | None
    first_divergence_position: int | None
    diagnosis: str


def step_samples(
    store: Store, run_id: str, step: int, *, limit: int = MAX_PAGE, offset: int = 0
) -> list[SampleVerdict]:
    """The compared samples of one step by key (verdicts only: no grid, no arrays), one page:
    ``limit`` (at most :data:`~audit.db.runs.MAX_PAGE`) from ``offset`` on."""
    query = (
        select(
            SampleResultRow.sample_key,
            SampleResultRow.n_tokens,
            SampleResultRow.metrics,
            SampleResultRow.first_divergence_region,
            SampleResultRow.first_divergence_position,
            SampleResultRow.diagnosis,
        )
        .where(SampleResultRow.run_id == run_id, SampleResultRow.step == step)
        .order_by(SampleResultRow.sample_key)
        .limit(min(limit, MAX_PAGE))
        .offset(offset)
    )
    with store.sessions() as session:
        rows = session.execute(query).all()
    return [
        SampleVerdict(
            key,
            n_tokens,
            metrics.get("logprob_abs_diff_mean"),
            metrics.get("logprob_abs_diff_max"),
            metrics.get("kl_k3"),
            metrics.get("exact_match_fraction"),
            region,
            position,
            diagnosis,
        )
        for key, n_tokens, metrics, region, position, diagnosis in rows
    ]


# ---------------------------------------------------------------------- one sample


@dataclass(frozen=True)
class SampleDetail:
    """Everything the sample page shows. ``delta`` = trainer − rollout per completion token."""

    run_id: str
    step: int
    sample_key: str
    prompt_len: int
    completion_ids: np.ndarray
    trainer_logprobs: np.ndarray
    rollout_logprobs: np.ndarray
    delta: np.ndarray
    metrics: dict[str, Any]
    diagnosis: str
    sentence: str
    evidence: dict[str, Any]
    grid: RegionGrid | None
    first_divergence: tuple[str, int] | None


def sample_detail(store: Store, run_id: str, step: int, sample_key: str) -> SampleDetail | None:
    """One compared sample (None until both sides are stored and compared)."""
    with store.sessions() as session:
        result = session.get(SampleResultRow, (run_id, step, sample_key))
    if result is None:
        return None
    trainer, rollout = store.sample_pair(run_id, step, sample_key)
    if trainer is None or rollout is None:
        return None
    with np.errstate(invalid="ignore"):
        delta = trainer.logprobs.astype(np.float64) - rollout.logprobs.astype(np.float64)
    detail = dict(result.diagnosis_detail)
    first = (
        (result.first_divergence_region, int(result.first_divergence_position))
        if result.first_divergence_region is not None and result.first_divergence_position is not None
        else None
    )
    return SampleDetail(
        run_id=run_id,
        step=step,
        sample_key=sample_key,
        prompt_len=trainer.prompt_len,
        completion_ids=trainer.completion_ids.copy(),
        trainer_logprobs=trainer.logprobs,
        rollout_logprobs=rollout.logprobs,
        delta=delta,
        metrics=dict(result.metrics),
        diagnosis=result.diagnosis,
        sentence=str(detail.get("sentence", "")),
        evidence=dict(detail.get("evidence", {})),
        grid=RegionGrid.from_json(result.grid) if result.grid else None,
        first_divergence=first,
    )


# ---------------------------------------------------------------------- manifests and the contract


@dataclass(frozen=True)
class ManifestEntry:
    """One stored manifest: when it was recorded and what it said."""

    id: int
    side: str
    case: str
    process: str
    created_at: datetime
    manifest: Manifest
    changed: list[str]  # fields that differ from the same side's previous manifest


@dataclass(frozen=True)
class FieldComparison:
    """One field of the two sides' latest manifests, side by side."""

    name: str
    trainer: Any
    rollout: Any
    differs: bool


@dataclass(frozen=True)
class ContractView:
    trainer: Manifest | None
    rollout: Manifest | None
    fields: list[FieldComparison]
    handshake: HandshakeResult | None
    history: list[ManifestEntry]


#: Manifest fields that name a record, not a numerical fact.
_IDENTITY_FIELDS = {"kind", "schema_version", "run_id", "side", "case", "process", "created_at"}


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys: ``{"runtime": {"dtype": "bf16"}}`` -> ``{"runtime.dtype": "bf16"}``."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key in sorted(value, key=str):
            out.update(flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def manifest_fields(manifest: Manifest | None) -> dict[str, Any]:
    """A manifest's numerical facts as dotted keys (identity fields left out)."""
    if manifest is None:
        return {}
    body = manifest.model_dump(mode="json", exclude=_IDENTITY_FIELDS)
    return flatten(body)


def compare_manifests(trainer: Manifest | None, rollout: Manifest | None) -> list[FieldComparison]:
    """Every field either side carries, differing ones flagged."""
    a, b = manifest_fields(trainer), manifest_fields(rollout)
    missing = object()
    rows = []
    for name in sorted(a.keys() | b.keys()):
        ta, rb = a.get(name, missing), b.get(name, missing)
        rows.append(
            FieldComparison(
                name, None if ta is missing else ta, None if rb is missing else rb, differs=ta != rb
            )
        )
    return rows


def manifest_history(store: Store, run_id: str) -> list[ManifestEntry]:
    """Every manifest of the run, oldest first, each with what changed since the previous one of the
    same side, case and process."""
    query = (
        select(ManifestRow)
        .where(ManifestRow.run_id == run_id)
        .order_by(ManifestRow.created_at, ManifestRow.id)
    )
    with store.sessions() as session:
        rows = list(session.scalars(query))
    previous: dict[tuple[str, str, str], dict[str, Any]] = {}
    entries = []
    for row in rows:
        manifest = Manifest.model_validate(row.body)
        now = manifest_fields(manifest)
        before = previous.get((row.side, row.case, row.process))
        changed = (
            []
            if before is None
            else sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
        )
        previous[(row.side, row.case, row.process)] = now
        entries.append(
            ManifestEntry(
                row.id, row.side, row.case, row.process, aware(row.created_at) or utcnow(), manifest, changed
            )
        )
    return entries


def contract_view(store: Store, run_id: str) -> ContractView:
    """Both sides' latest manifests compared, the handshake verdict and the manifest history."""
    history = manifest_history(store, run_id)
    latest: dict[str, Manifest] = {}
    for entry in history:
        latest[entry.side] = entry.manifest
    trainer, rollout = latest.get("trainer"), latest.get("rollout")
    verdict = handshake(trainer, rollout) if trainer is not None and rollout is not None else None
    return ContractView(trainer, rollout, compare_manifests(trainer, rollout), verdict, history)


@dataclass(frozen=True)
class ModeChange:
    """A side reporting a new remediation mode, placed on the first step recorded after it."""

    side: str
    mode: str | None
    at: datetime
    step: int | None


def mode_changes(
    store: Store, run_id: str, history: Sequence[ManifestEntry] | None = None
) -> list[ModeChange]:
    """Where each side's reported remediation mode changed (its first manifest counts only if it
    is not ``native``), placed on the first step whose records arrived after the manifest (None
    while no such step is compared yet). Reads two columns of the step summaries, no arrays."""
    history = manifest_history(store, run_id) if history is None else history
    with store.sessions() as session:
        stamps = [
            (aware(at), step)
            for step, at in session.execute(
                select(StepSummaryRow.step, StepSummaryRow.ingested_at)
                .where(StepSummaryRow.run_id == run_id, StepSummaryRow.ingested_at.is_not(None))
                .order_by(StepSummaryRow.step)
            )
        ]
    changes = []
    current: dict[str, str | None] = {}
    for entry in history:
        mode = entry.manifest.runtime.remediation
        before = current.get(entry.side, "native")
        current[entry.side] = mode
        if mode == before:
            continue
        step = next((s for at, s in stamps if at is not None and at >= entry.created_at), None)
        changes.append(ModeChange(entry.side, mode, entry.created_at, step))
    return changes


# ---------------------------------------------------------------------- alerts


@dataclass(frozen=True)
class SilenceView:
    """One silence: what it matches (None: anything) and when it holds."""

    id: int
    project: str | None
    rule: str | None
    run_id: str | None
    labels: dict[str, Any]
    starts_at: datetime
    ends_at: datetime
    created_by: str
    comment: str

    def active(self, now: datetime) -> bool:
        return self.starts_at <= now < self.ends_at

    @classmethod
    def of(cls, row: SilenceRow) -> SilenceView:
        return cls(
            row.id,
            row.project,
            row.rule_name,
            row.run_id,
            dict(row.labels),
            aware(row.starts_at) or row.starts_at,
            aware(row.ends_at) or row.ends_at,
            row.created_by,
            row.comment,
        )


@dataclass(frozen=True)
class AlertsView:
    open: list[AlertView]
    resolved: list[AlertView]
    rules: list[AlertRule]
    silences: list[SilenceView]


def alerts_view(store: Store, *, run_id: str | None = None, limit: int = 500) -> AlertsView:
    """Open and resolved alerts (newest first), the rules and the silences."""
    alerts = list_alerts(store, run_id=run_id, limit=limit)
    project = store.run_project(run_id) if run_id is not None else None
    rules = [rule_from_row(row) for row in list_rule_rows(store, project)]
    return AlertsView(
        open=[a for a in alerts if a.state in OPEN_STATES],
        resolved=[a for a in alerts if a.state not in OPEN_STATES],
        rules=rules,
        silences=[SilenceView.of(row) for row in list_silences(store, project)],
    )


def run_rules(store: Store, run_id: str) -> list[AlertRule]:
    """The enabled rules that apply to a run (its project's and the global ones)."""
    project = store.run_project(run_id)
    return [rule_from_row(row) for row in list_rule_rows(store, project) if row.enabled]


# ---------------------------------------------------------------------- ranks


#: A rank this many steps behind the newest step its side sent has stopped sending (one step behind
#: is a rank still finishing the step).
STOPPED_AFTER_STEPS = 2


@dataclass(frozen=True)
class RankActivity:
    """What one rank of one side sent: samples, steps, the newest step and when it last sent, how far
    behind the side's newest step it is, and the processes its manifests name (``host:pid/rank``).
    ``rank`` is None for samples sent without one (a single-process job)."""

    side: str
    rank: int | None
    samples: int
    steps: int
    first_step: int
    last_step: int
    last_seen: datetime | None
    steps_behind: int
    processes: list[str]

    @property
    def stopped(self) -> bool:
        return self.steps_behind >= STOPPED_AFTER_STEPS


def _process_rank(process: str) -> int | None:
    """The rank at the end of a manifest's ``process`` (``host:pid/rank``), or None."""
    _, sep, tail = process.rpartition("/")
    return int(tail) if sep and tail.isdigit() else None


def rank_activity(store: Store, run_id: str) -> list[RankActivity]:
    """Per (side, rank), sorted: the counters the run page and ``GET /v1/runs/{id}/ranks`` show
    (one grouped query over the run's sample rows, and the run's manifests' process names)."""
    query = (
        select(
            SampleRow.side,
            SampleRow.rank,
            func.count(),
            func.count(func.distinct(SampleRow.step)),
            func.min(SampleRow.step),
            func.max(SampleRow.step),
            func.max(SampleRow.created_at),
        )
        .where(SampleRow.run_id == run_id)
        .group_by(SampleRow.side, SampleRow.rank)
    )
    processes = select(ManifestRow.side, ManifestRow.process).where(ManifestRow.run_id == run_id).distinct()
    with store.sessions() as session:
        rows = session.execute(query).all()
        named: dict[tuple[str, int | None], set[str]] = {}
        for side, process in session.execute(processes):
            named.setdefault((side, _process_rank(process or "")), set()).add(process)
    newest = {side: max(row[5] for row in rows if row[0] == side) for side in {row[0] for row in rows}}
    out = [
        RankActivity(
            side=side,
            rank=rank,
            samples=int(n),
            steps=int(n_steps),
            first_step=int(first),
            last_step=int(last),
            last_seen=aware(seen),
            steps_behind=int(newest[side] - last),
            processes=sorted(named.get((side, rank), set())),
        )
        for side, rank, n, n_steps, first, last, seen in rows
    ]
    return sorted(out, key=lambda r: (r.side, -1 if r.rank is None else r.rank))


def rank_series(store: Store, run_id: str, from_step: int = 0) -> list[tuple[int, str, int | None, int]]:
    """(step, side, rank, samples) from ``from_step`` on, in step order: what each rank sent per step."""
    query = (
        select(SampleRow.step, SampleRow.side, SampleRow.rank, func.count())
        .where(SampleRow.run_id == run_id, SampleRow.step >= from_step)
        .group_by(SampleRow.step, SampleRow.side, SampleRow.rank)
        .order_by(SampleRow.step, SampleRow.side, SampleRow.rank)
    )
    with store.sessions() as session:
        return [(int(step), side, rank, int(n)) for step, side, rank, n in session.execute(query)]


# ---------------------------------------------------------------------- MoE routing


@dataclass(frozen=True)
class RoutingLayer:
    """One MoE layer of one step: tokens routed on both sides, and what agreed."""

    layer: int
    tokens: int
    set_agreement: float | None
    flip_rate: float | None
    jaccard_mean: float | None
    flipped_tokens: int
    first_flips: int  # tokens whose routing first flips in this layer
    example: str | None  # the sample with the most flips here


@dataclass(frozen=True)
class RoutingStep:
    """A compared step's routing: its ``routing_*`` metrics and per-layer agreement."""

    step: int
    metrics: dict[str, Any]
    layers: list[RoutingLayer]
    replayed: int | None
    missing: int
    missing_examples: list[dict[str, Any]]


def _routing_layer(layer: int, c: Mapping[str, Any]) -> RoutingLayer:
    tokens, decisions = int(c["tokens"]), int(c.get("decisions", 0))
    return RoutingLayer(
        layer=layer,
        tokens=tokens,
        set_agreement=c["agree"] / tokens if tokens else None,
        flip_rate=c["flipped_decisions"] / decisions if decisions else None,
        jaccard_mean=c["jaccard_sum"] / tokens if tokens else None,
        flipped_tokens=tokens - int(c["agree"]),
        first_flips=int(c["first_flips"]),
        example=c.get("example"),
    )


def routing_series(store: Store, run_id: str, *, after_step: int | None = None) -> list[RoutingStep]:
    """The run's compared steps that carry MoE routing, in order (after ``after_step``, live)."""
    query = (
        select(StepResultRow.step, StepResultRow.metrics, StepSummaryRow.routing)
        .join(
            StepSummaryRow,
            (StepSummaryRow.run_id == StepResultRow.run_id) & (StepSummaryRow.step == StepResultRow.step),
        )
        .where(StepResultRow.run_id == run_id, StepSummaryRow.routing.is_not(None))
        .order_by(StepResultRow.step)
    )
    if after_step is not None:
        query = query.where(StepResultRow.step > after_step)
    with store.sessions() as session:
        rows = session.execute(query).all()
    out = []
    for step, metrics, routing in rows:
        if not routing:  # a JSON null
            continue
        out.append(
            RoutingStep(
                step=step,
                metrics={k: v for k, v in (metrics or {}).items() if k.startswith("routing_")},
                layers=[
                    _routing_layer(int(k), v)
                    for k, v in sorted(routing["layers"].items(), key=lambda kv: int(kv[0]))
                ],
                replayed=routing.get("replayed"),
                missing=int(routing.get("missing", 0)),
                missing_examples=list(routing.get("missing_examples", [])),
            )
        )
    return out


@dataclass(frozen=True)
class SampleRouting:
    """Both sides' experts per token of one sample (the sample page's routing table): at
    ``positions`` (absolute), for each MoE layer of ``layers``, ``trainer``/``rollout`` [positions,
    layers, k] in slot order; ``first_flip`` per position the first layer whose set differs (-1)."""

    layers: list[int]
    positions: np.ndarray
    trainer: np.ndarray
    rollout: np.ndarray
    agree: np.ndarray
    first_flip: np.ndarray
    replayed: np.ndarray | None
    prompt_len: int


def sample_routing(store: Store, run_id: str, step: int, sample_key: str) -> SampleRouting | None:
    """One sample's routing on both sides (None when either side sent no routes): reads that
    sample's two records only."""
    from isoaudit.audit.routing import compare_sample_routes

    trainer, rollout = store.sample_pair(run_id, step, sample_key)
    if trainer is None or rollout is None:
        return None
    found = compare_sample_routes(trainer, rollout)
    if found is None:
        return None
    replayed = None
    if trainer.routes is not None and trainer.routes.replayed is not None:
        index = np.searchsorted(trainer.routes.positions, found.positions)
        replayed = trainer.routes.replayed[index]
    return SampleRouting(
        layers=found.layers,
        positions=found.positions,
        trainer=found.trainer,
        rollout=found.rollout,
        agree=found.agree,
        first_flip=found.first_flip_layers(),
        replayed=replayed,
        prompt_len=trainer.prompt_len,
    )
