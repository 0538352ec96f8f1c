"""The dashboard's data: ``audit.db.reads`` views as pandas frames, shaped for ``dashboard.figures``.

No Dash here, and no SQL: every read goes through :mod:`audit.db.reads`, so the pages are thin and the
frames can be built (and tested) without a browser.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, get_args

import numpy as np
import pandas as pd
from isoaudit.audit.alerts.rules import AlertRule
from isoaudit.audit.db import reads
from isoaudit.audit.db.alerts import Alert, Silence
from isoaudit.audit.diagnosis import DiagnosisKind
from isoaudit.audit.grid import DIFFERS, EQUAL, NOT_OBSERVED
from isoaudit.audit.records import StepStats
from isoaudit.audit.regions import parse_region_key, region_order
from isoaudit.audit.summaries import bin_label

#: The step metrics the run page draws, in panels; ``log`` panels use a log axis.
TIMELINE_PANELS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("mismatch KL (k3)", ("kl_k3",), True),
    ("kl_k1 (mean −Δ)", ("kl_k1",), False),
    ("|Δ logprob|", ("logprob_abs_diff_mean", "logprob_abs_diff_max"), True),
    ("|Δ prob|", ("rollout_probs_diff_mean", "rollout_probs_diff_max", "rollout_probs_diff_std"), True),
    ("Pearson corr.", ("rollout_actor_probs_pearson_corr",), False),
    ("clip fraction", ("is_clipfrac",), False),
    ("exact-match fraction", ("exact_match_fraction",), False),
)
TIMELINE_METRICS: tuple[str, ...] = tuple(m for _, names, _ in TIMELINE_PANELS for m in names)

#: Diagnosis kinds in the diagnosis' own order, so the stacked bars keep one order across steps.
DIAGNOSIS_ORDER: tuple[str, ...] = get_args(DiagnosisKind)


def _base_region(label: str) -> str:
    return parse_region_key(label)[0]


def region_sort(labels: Iterable[str]) -> list[str]:
    """Region labels (``layers.2.mlp#1``) in forward order."""
    return sorted(labels, key=lambda r: (region_order(_base_region(r)), r))


def attributes_frame(
    items: Iterable[Any], columns: Sequence[str], computed: Mapping[str, Callable[[Any], Any]] | None = None
) -> pd.DataFrame:
    """One row per item (a query's result): each column is the item's attribute of that name, or
    ``computed[column](item)`` where the frame names or derives it differently. No items: no rows,
    the same columns."""
    computed = computed or {}
    rows = [{c: computed[c](item) if c in computed else getattr(item, c) for c in columns} for item in items]
    return pd.DataFrame(rows, columns=list(columns))


# ---------------------------------------------------------------------- runs page


def runs_frame(runs: Sequence[reads.RunOverview]) -> pd.DataFrame:
    """One row per run with what the runs table shows."""
    columns = [
        "run_id", "name", "project", "status", "last_step", "last_ingest_at", "kl_k3",
        "exact_match_fraction", "open_alerts", "desired_mode", "control_version",
        "applied_trainer", "applied_rollout", "spark_steps", "spark_kl_k3",
    ]  # fmt: skip
    return attributes_frame(
        runs,
        columns,
        {
            "desired_mode": lambda r: r.control.mode,
            "control_version": lambda r: r.control.version,
            "applied_trainer": lambda r: r.applied["trainer"].mode,
            "applied_rollout": lambda r: r.applied["rollout"].mode,
            "spark_steps": lambda r: [s for s, _ in r.sparkline],
            "spark_kl_k3": lambda r: [v for _, v in r.sparkline],
        },
    )


# ---------------------------------------------------------------------- run page


def timeline_frame(points: Sequence[reads.StepPoint]) -> pd.DataFrame:
    """Steps as rows (index ``step``), the timeline metrics as float columns (NaN where missing)."""
    data = {m: [_num(p.metrics.get(m)) for p in points] for m in TIMELINE_METRICS}
    return pd.DataFrame(data, index=pd.Index([p.step for p in points], name="step"), dtype=float)


#: The RL loop's own figures (``StepStats``) the run page draws beside the mismatch.
LOOP_FIGURES = ("reward_mean", "reward_std", "entropy", "clip_fraction", "generation_s", "training_s")


def loop_frame(stats: Sequence[StepStats]) -> pd.DataFrame:
    """Steps as rows (index ``step``), the loop's named figures as float columns (NaN where a step
    did not report one)."""
    data = {name: [_num(getattr(s, name)) for s in stats] for name in LOOP_FIGURES}
    return pd.DataFrame(data, index=pd.Index([s.step for s in stats], name="step"), dtype=float)


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else np.nan


def position_frame(
    points: Sequence[reads.StepPoint], stat: str = "mean", n_bins: int | None = None
) -> pd.DataFrame:
    """|Δ logprob| per response-position bin: steps as rows, bin labels as columns (``stat`` is
    ``mean`` or ``max``); ``n_bins`` pads or cuts to a given width (for appending to a figure)."""
    if stat not in ("mean", "max"):
        raise ValueError(f"stat: {stat!r} is not 'mean' or 'max'")
    width = (
        n_bins if n_bins is not None else max((len(p.position_bins.get(stat, [])) for p in points), default=0)
    )
    rows = []
    for p in points:
        values = [_num(v) for v in p.position_bins.get(stat, [])][:width]
        rows.append(values + [np.nan] * (width - len(values)))
    return pd.DataFrame(
        rows,
        index=pd.Index([p.step for p in points], name="step"),
        columns=[bin_label(i) for i in range(width)],
        dtype=float,
    )


def bin_sample(point: reads.StepPoint, bin_index: int) -> str | None:
    """The sample holding bin ``bin_index``'s largest |Δ| at this step (where a heatmap click goes)."""
    keys = point.position_bins.get("max_key", [])
    return keys[bin_index] if 0 <= bin_index < len(keys) else None


def divergence_frame(points: Sequence[reads.StepPoint], regions: Sequence[str] | None = None) -> pd.DataFrame:
    """Samples whose first divergence is in each region: steps as rows, regions (forward order) as
    columns, 0 where none."""
    names = (
        list(regions) if regions is not None else region_sort({r for p in points for r in p.first_divergence})
    )
    rows = [[int(p.first_divergence.get(r, {}).get("count", 0)) for r in names] for p in points]
    return pd.DataFrame(rows, index=pd.Index([p.step for p in points], name="step"), columns=names, dtype=int)


def diagnosis_frame(points: Sequence[reads.StepPoint], kinds: Sequence[str] | None = None) -> pd.DataFrame:
    """Samples per diagnosis kind: steps as rows, kinds (DESIGN.md's order) as columns."""
    seen = {k for p in points for k in p.diagnoses}
    names = (
        list(kinds)
        if kinds is not None
        else [k for k in DIAGNOSIS_ORDER if k in seen] + sorted(seen - set(DIAGNOSIS_ORDER))
    )
    rows = [[int(p.diagnoses.get(k, 0)) for k in names] for p in points]
    return pd.DataFrame(rows, index=pd.Index([p.step for p in points], name="step"), columns=names, dtype=int)


def thresholds_frame(rules: Sequence[AlertRule]) -> pd.DataFrame:
    """One row per enabled rule on a timeline metric: where to draw its threshold."""
    return attributes_frame(
        [r for r in rules if r.enabled and r.metric in TIMELINE_METRICS],
        ["rule", "metric", "comparison", "threshold", "severity"],
        {"rule": lambda r: r.name},
    )


def alert_intervals_frame(
    alerts: Sequence[Alert], rules: Sequence[AlertRule], last_step: int | None
) -> pd.DataFrame:
    """The step ranges during which each alert was firing (still-firing ones end at ``last_step``)."""
    metric_of = {r.name: r.metric for r in rules}

    def end(a: Alert) -> int | None:
        if a.resolved_step is not None:
            return a.resolved_step
        return last_step if last_step is not None else a.last_step

    return attributes_frame(
        [a for a in alerts if a.fired_step is not None],
        ["alert_id", "rule", "metric", "severity", "state", "start", "end"],
        {
            "alert_id": lambda a: a.id,
            "metric": lambda a: metric_of.get(a.rule),
            "start": lambda a: a.fired_step,
            "end": end,
        },
    )


def mode_changes_frame(changes: Sequence[reads.ModeChange]) -> pd.DataFrame:
    return attributes_frame(changes, ["side", "mode", "at", "step"])


def samples_frame(verdicts: Sequence[reads.SampleVerdict]) -> pd.DataFrame:
    """A step's sample table."""
    columns = ["sample_key", "n_tokens", "abs_diff_mean", "abs_diff_max", "kl_k3", "exact_match_fraction",
               "first_divergence", "diagnosis"]  # fmt: skip

    def first_divergence(v: reads.SampleVerdict) -> str:
        return (
            f"{v.first_divergence_region} @ {v.first_divergence_position}"
            if v.first_divergence_region
            else ""
        )

    return attributes_frame(verdicts, columns, {"first_divergence": first_divergence})


# ---------------------------------------------------------------------- sample page


@lru_cache(maxsize=8)
def load_tokenizer(name: str) -> Any | None:
    """A tokenizer the machine can load without the network (None otherwise: show token ids)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:
        return None


def tokenizer_of(config: dict[str, Any]) -> Any | None:
    """The tokenizer a run's config names (``tokenizer``, else ``model``), if it loads here."""
    for key in ("tokenizer", "tokenizer_path", "model", "model_path"):
        name = config.get(key)
        if isinstance(name, str) and name:
            found = load_tokenizer(name)
            if found is not None:
                return found
    return None


def delta_frame(detail: reads.SampleDetail, tokenizer: Any | None = None) -> pd.DataFrame:
    """One row per completion token: position, id, text (decoded when a tokenizer is given, else the
    id), both sides' logprobs and Δ = trainer − rollout."""
    ids = detail.completion_ids.astype(np.int64)
    if tokenizer is not None:
        texts = [tokenizer.decode([int(t)]) for t in ids]
    else:
        texts = [str(int(t)) for t in ids]
    return pd.DataFrame(
        {
            "position": np.arange(ids.size),
            "absolute_position": np.arange(ids.size) + detail.prompt_len,
            "token_id": ids,
            "text": texts,
            "trainer": detail.trainer_logprobs.astype(float),
            "rollout": detail.rollout_logprobs.astype(float),
            "delta": detail.delta,
        }
    )


STATE_NAMES = {NOT_OBSERVED: "not observed", EQUAL: "equal", DIFFERS: "differs"}


def grid_frame(detail: reads.SampleDetail) -> pd.DataFrame:
    """The fingerprint grid in long form: one row per (region, position) with its state, sketch
    relative L2, agreeing ladder bits, and whether it is an origin / the first divergence."""
    columns = ["region", "position", "state", "rel_l2", "agreeing_bits", "origin", "first"]
    grid = detail.grid
    if grid is None or not grid.regions:
        return pd.DataFrame(columns=columns)
    n_regions, n_positions = grid.state.shape
    origins = set(grid.origins)
    first = grid.first_divergence
    regions = np.repeat(np.asarray(grid.regions, dtype=object), n_positions)
    positions = np.tile(grid.positions.astype(np.int64), n_regions)
    frame = pd.DataFrame(
        {
            "region": regions,
            "position": positions,
            "state": [STATE_NAMES[int(s)] for s in grid.state.ravel()],
            "rel_l2": grid.rel_l2.astype(float).ravel(),
            "agreeing_bits": grid.agreeing_bits.astype(int).ravel(),
        }
    )
    cells = list(zip(frame["region"], frame["position"], strict=True))
    frame["origin"] = [c in origins for c in cells]
    frame["first"] = [c == first for c in cells]
    return frame


def evidence_items(evidence: dict[str, Any]) -> list[tuple[str, str]]:
    """The diagnosis evidence as (name, value-as-text) pairs, for a definition list."""
    items = []
    for key, value in evidence.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
        items.append((str(key), text))
    return items


# ---------------------------------------------------------------------- contract page


def contract_frame(view: reads.ContractView) -> pd.DataFrame:
    """The two latest manifests side by side, differing fields first."""
    rows = [
        {"field": f.name, "trainer": _text(f.trainer), "rollout": _text(f.rollout), "differs": f.differs}
        for f in view.fields
    ]
    frame = pd.DataFrame(rows, columns=["field", "trainer", "rollout", "differs"])
    return frame.sort_values(["differs", "field"], ascending=[False, True], kind="stable").reset_index(
        drop=True
    )


def history_frame(history: Sequence[reads.ManifestEntry]) -> pd.DataFrame:
    rows = [
        {
            "recorded": e.created_at,
            "side": e.side,
            "case": e.case,
            "process": e.process,
            "remediation": e.manifest.runtime.remediation,
            "numerical_policy": (e.manifest.contract.numerical_policy or "")[:12],
            "changed": ", ".join(e.changed) or "—",
        }
        for e in reversed(history)
    ]
    return pd.DataFrame(
        rows, columns=["recorded", "side", "case", "process", "remediation", "numerical_policy", "changed"]
    )


def _text(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


# ---------------------------------------------------------------------- alerts page


def alerts_frame(alerts: Sequence[Alert]) -> pd.DataFrame:
    columns = ["id", "rule", "run_id", "state", "severity", "value", "started_step", "fired_step",
               "resolved_step", "last_step", "link_step"]  # fmt: skip
    return attributes_frame(
        alerts, columns, {"link_step": lambda a: a.fired_step if a.fired_step is not None else a.started_step}
    )


def rules_frame(rules: Sequence[AlertRule]) -> pd.DataFrame:
    return attributes_frame(
        rules,
        ["name", "condition", "for", "keep_firing_for", "severity", "project", "enabled"],
        {
            "condition": lambda r: r.condition(),
            "for": lambda r: r.for_steps,
            "project": lambda r: r.project or "(all)",
        },
    )


def silences_frame(silences: Sequence[Silence], now: datetime) -> pd.DataFrame:
    columns = ["id", "rule", "run_id", "labels", "starts_at", "ends_at", "active", "created_by", "comment"]
    return attributes_frame(
        silences,
        columns,
        {
            "rule": lambda s: s.rule or "(any)",
            "run_id": lambda s: s.run_id or "(any)",
            "labels": lambda s: json.dumps(s.labels, sort_keys=True) if s.labels else "",
            "active": lambda s: s.active(now),
        },
    )


# ---------------------------------------------------------------------- ranks

#: The run page's per-rank table, in column order.
RANK_COLUMNS = (
    "side",
    "rank",
    "status",
    "samples",
    "steps",
    "last_step",
    "steps_behind",
    "last_seen",
    "processes",
)


def rank_rows(activity: Sequence[reads.RankActivity]) -> list[dict[str, Any]]:
    """One table row per (side, rank); ``status`` is ``stopped`` for a rank that stopped sending."""
    return [
        {
            "side": a.side,
            "rank": "—" if a.rank is None else a.rank,
            "status": "stopped" if a.stopped else "sending",
            "samples": a.samples,
            "steps": a.steps,
            "last_step": a.last_step,
            "steps_behind": a.steps_behind,
            "last_seen": a.last_seen.strftime("%Y-%m-%d %H:%M:%S") if a.last_seen else "",
            "processes": ", ".join(a.processes),
        }
        for a in activity
    ]


def rank_frame(series: Sequence[tuple[int, str, int | None, int]]) -> pd.DataFrame:
    """Samples each rank sent per step: steps as rows, ``side/rank`` columns (0 where it sent none)."""
    if not series:
        return pd.DataFrame(index=pd.Index([], name="step"))
    frame = pd.DataFrame(series, columns=["step", "side", "rank", "samples"])
    frame["sender"] = [
        f"{side}/{'-' if rank is None else rank}"
        for side, rank in zip(frame["side"], frame["rank"], strict=True)
    ]
    table = frame.pivot_table(index="step", columns="sender", values="samples", aggfunc="sum", fill_value=0)
    steps = range(int(table.index.min()), int(table.index.max()) + 1)
    return table.reindex(steps, fill_value=0).rename_axis("step").astype(int)


# ---------------------------------------------------------------------- MoE routing

#: What the run page's routing heatmap can show per (layer, step).
ROUTING_VALUES = {
    "flipped_tokens": "tokens whose expert set differs",
    "first_flips": "tokens whose routing first flips here",
    "flip_rate": "fraction of router decisions that flip",
}


def routing_frame(points: Sequence[reads.RoutingStep], value: str = "flipped_tokens") -> pd.DataFrame:
    """Step (index) x MoE layer (columns, ``layer i``): ``value`` per cell (:data:`ROUTING_VALUES`),
    NaN where the layer routed no token that step."""
    if value not in ROUTING_VALUES:
        raise ValueError(f"value: expected one of {', '.join(ROUTING_VALUES)}, got {value!r}")
    rows = {
        p.step: {f"layer {layer.layer}": _num(getattr(layer, value)) for layer in p.layers if layer.tokens}
        for p in points
    }
    frame = pd.DataFrame.from_dict(rows, orient="index")
    if frame.empty:
        return frame
    columns = sorted(frame.columns, key=lambda c: int(c.split()[1]))
    return frame[columns].sort_index()


def routing_example(point: reads.RoutingStep, layer: int) -> str | None:
    """The sample of ``point``'s step with the most flips in MoE layer ``layer``."""
    return next((entry.example for entry in point.layers if entry.layer == layer), None)


def sample_routing_frame(routing: reads.SampleRouting) -> pd.DataFrame:
    """One row per (position, MoE layer): both sides' experts (slot order), whether the sets agree,
    and whether this layer is where the token's routing first flips."""
    rows = []
    for j, position in enumerate(routing.positions.tolist()):
        for i, layer in enumerate(routing.layers):
            rows.append(
                {
                    "position": int(position),
                    "layer": int(layer),
                    "trainer": [int(e) for e in routing.trainer[j, i]],
                    "rollout": [int(e) for e in routing.rollout[j, i]],
                    "agree": bool(routing.agree[j, i]),
                    "first_flip": int(routing.first_flip[j]) == int(layer),
                    "replayed": None if routing.replayed is None else bool(routing.replayed[j]),
                }
            )
    return pd.DataFrame(
        rows, columns=["position", "layer", "trainer", "rollout", "agree", "first_flip", "replayed"]
    )


def distribution_frame(found: reads.SampleDistribution) -> pd.DataFrame:
    """One row per completion token: how far the two sides' distributions are apart there (TV and
    KL on the top-k union, the sketch's Hellinger estimate, top-k overlap) and whether they differ
    while the sampled token's logprob is bitwise equal."""
    n = found.tv.size
    return pd.DataFrame(
        {
            "position": np.arange(n),
            "absolute_position": np.arange(n) + found.prompt_len,
            "tv": found.tv.astype(float),
            "kl": found.kl.astype(float),
            "hellinger": found.hellinger.astype(float),
            "overlap": found.overlap.astype(float),
            "rank_agreement": found.rank_agreement.astype(float),
            "differs": found.differs.astype(bool),
            "sampled_equal": found.sampled_equal.astype(bool),
        }
    )
