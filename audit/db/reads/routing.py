"""MoE routing: each compared step's agreement per layer, and one sample's experts per token."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from isoaudit.audit.db.models import (
    StepResultRow,
    StepSummaryRow,
)
from isoaudit.audit.db.store import Store
from sqlalchemy import select


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
