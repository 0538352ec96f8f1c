"""The trackers every process that compares steps sets up the same way (the service's worker thread,
``isoaudit worker``): from :class:`~isoaudit.audit.trackers.settings.TrackerSettings`, a fanout whose
``on_step`` runs beside the alert engine's and whose W&B alert channel joins the engine's channels."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from isoaudit.audit.trackers.fanout import TrackerFanout
from isoaudit.audit.trackers.settings import TrackerSettings

if TYPE_CHECKING:
    from isoaudit.audit.alerts.channels import Channel
    from isoaudit.audit.db import Store
    from isoaudit.audit.worker import StepCallback

log = logging.getLogger(__name__)


def worker_trackers(
    store: Store | None = None, settings: TrackerSettings | None = None
) -> TrackerFanout | None:
    """The fanout the settings (default: ``ISOAUDIT_WANDB_*``, ``ISOAUDIT_MLFLOW_*``) configure, or None
    when they name no tracker. A named tracker whose library is missing raises
    :class:`~isoaudit.audit.trackers.base.TrackerUnavailable` now, naming the extra."""
    settings = settings or TrackerSettings.from_env()
    trackers = settings.worker_trackers()
    if not trackers:
        return None
    return TrackerFanout(trackers, settings, store=store)


def tracker_channels(fanout: TrackerFanout | None) -> list[Channel]:
    """The alert channels ``fanout`` adds to the alert engine's: W&B alerts when it logs to W&B."""
    if fanout is None or "wandb" not in fanout.trackers:
        return []
    from isoaudit.audit.trackers.channel import WandbAlertChannel

    return [WandbAlertChannel(fanout)]


def compose_steps(*callbacks: StepCallback | None) -> StepCallback:
    """One per-step callback for the comparison worker that calls each of ``callbacks`` (None left
    out) in order; one that raises is logged and the others still run."""
    chosen = [c for c in callbacks if c is not None]

    def on_step(run_id: str, step: int, metrics: Mapping[str, Any]) -> None:
        for callback in chosen:
            try:
                callback(run_id, step, metrics)
            except Exception:
                log.exception("step callback %s failed for run %s step %s", callback, run_id, step)

    return on_step
