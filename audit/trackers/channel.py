"""Alert notices as W&B alerts: a channel of the worker's alert engine.

Each firing or resolved notice becomes ``run.alert(title, text, level)`` in the isoaudit run's own
W&B run (the one :class:`~isoaudit.audit.trackers.fanout.TrackerFanout` logs its figures into),
which W&B forwards to the e-mail or Slack its users set up. Not durable: the engine hands it each
notice from its own delivery thread, and the delivery record says whether W&B took it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from isoaudit.audit.alerts.channels import Delivery, Notice
from isoaudit.audit.trackers.figures import alert_level, alert_title

if TYPE_CHECKING:
    from isoaudit.audit.trackers.fanout import TrackerFanout


def alert_text(notice: Notice) -> str:
    """The body of a notice's W&B alert: condition, value, step, and the dashboard link."""
    value = "no data" if notice.value is None else f"{notice.value:.6g}"
    state = "fired" if notice.event == "firing" else "resolved"
    text = f"{notice.rule} ({notice.severity}) {state} on run {notice.run_id} at step {notice.step}: "
    text += f"{notice.condition}, value {value}. {notice.url}"
    return text + (f"\n{notice.description}" if notice.description else "")


class WandbAlertChannel:
    """Hands each notice to ``fanout``'s W&B run of the notice's isoaudit run, waiting at most
    ``timeout_s`` seconds; never raises."""

    name = "wandb"

    def __init__(self, fanout: TrackerFanout, *, timeout_s: float = 30.0) -> None:
        self.fanout = fanout
        self.timeout_s = timeout_s

    def send(self, notice: Notice) -> Delivery:
        title = alert_title(notice.rule, notice.run_id, notice.event)
        text = alert_text(notice)
        level = alert_level(notice.severity, notice.event)
        payload = {"title": title, "text": text, "level": level}
        try:
            error = self.fanout.alert(notice.run_id, title, text, level, timeout=self.timeout_s)
        except Exception as exc:  # the channel promise: never raise
            error = f"{type(exc).__name__}: {exc}"
        if error is None:
            return Delivery(self.name, "sent", payload=payload)
        return Delivery(self.name, "failed", error=error, payload=payload)
