"""The views the CLI, the API and the dashboard's pages read, as plain frozen objects (no ORM rows, no
Dash), one module per page concern: ``runs``, ``steps`` (a run's steps, a step's samples, one sample),
``contract`` (manifests), ``alerts``, ``ranks`` and ``routing``.

Every view reads small rows: step results, the per-step aggregates of ``audit.summaries``, sample
verdicts without their grids, manifests, alerts. The only arrays ever read are one sample's two
logprob arrays, for that sample's own page (:func:`sample_detail`).
"""

from isoaudit.audit.db.reads.alerts import AlertsView, alerts_view, run_rules
from isoaudit.audit.db.reads.common import LIVE_WITHIN, SIDES, aware
from isoaudit.audit.db.reads.contract import (
    ContractView,
    FieldComparison,
    ManifestEntry,
    ModeChange,
    compare_manifests,
    contract_view,
    flatten,
    manifest_fields,
    manifest_history,
    mode_changes,
)
from isoaudit.audit.db.reads.distribution import SampleDistribution, sample_distribution
from isoaudit.audit.db.reads.ranks import STOPPED_AFTER_STEPS, RankActivity, rank_activity, rank_series
from isoaudit.audit.db.reads.routing import (
    RoutingLayer,
    RoutingStep,
    SampleRouting,
    routing_series,
    sample_routing,
)
from isoaudit.audit.db.reads.runs import (
    AppliedMode,
    RunOverview,
    applied_modes,
    run_overview,
    run_status,
    runs_overview,
)
from isoaudit.audit.db.reads.steps import (
    SampleDetail,
    SampleVerdict,
    StepPoint,
    last_compared_step,
    sample_detail,
    step_point,
    step_samples,
    step_series,
)

__all__ = [
    "LIVE_WITHIN",
    "SIDES",
    "STOPPED_AFTER_STEPS",
    "AlertsView",
    "AppliedMode",
    "ContractView",
    "FieldComparison",
    "ManifestEntry",
    "ModeChange",
    "RankActivity",
    "RoutingLayer",
    "RoutingStep",
    "RunOverview",
    "SampleDetail",
    "SampleDistribution",
    "SampleRouting",
    "SampleVerdict",
    "StepPoint",
    "alerts_view",
    "applied_modes",
    "aware",
    "compare_manifests",
    "contract_view",
    "flatten",
    "last_compared_step",
    "manifest_fields",
    "manifest_history",
    "mode_changes",
    "rank_activity",
    "rank_series",
    "routing_series",
    "run_overview",
    "run_rules",
    "run_status",
    "runs_overview",
    "sample_detail",
    "sample_distribution",
    "sample_routing",
    "step_point",
    "step_samples",
    "step_series",
]
