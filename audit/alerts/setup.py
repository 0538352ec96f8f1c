"""The alerting every process that compares steps sets up the same way (the service, ``isoaudit
worker``, a session's own comparer): the configured rules, and an engine with the configured channels."""

from __future__ import annotations

from collections.abc import Sequence

from isoaudit.audit.alerts.alertmanager import AlertmanagerChannel
from isoaudit.audit.alerts.channels import Channel, DatabaseChannel, LogChannel, WebhookChannel
from isoaudit.audit.alerts.engine import AlertEngine
from isoaudit.audit.alerts.rules import default_rules, install_rules, load_rules
from isoaudit.audit.db import Store
from isoaudit.audit.settings import Settings


def webhook_urls(value: str | None) -> list[str]:
    """The webhooks of ``ISOAUDIT_ALERT_WEBHOOK_URL`` / ``--webhook`` (or the Alertmanagers of
    ``ISOAUDIT_ALERTMANAGER_URL`` / ``--alertmanager``): one URL, or several separated by commas or
    spaces (each is a destination of its own: one that is slow or down delays no other)."""
    return [url for url in (value or "").replace(",", " ").split() if url]


def _numbered(name: str, i: int) -> str:
    return name if i == 0 else f"{name}-{i + 1}"


def default_alert_engine(
    store: Store, settings: Settings, extra_channels: Sequence[Channel] = ()
) -> AlertEngine:
    """Log and database channels, plus a webhook channel per configured URL (``webhook``,
    ``webhook-2``, ...) and an Alertmanager channel per configured Alertmanager (``alertmanager``,
    ``alertmanager-2``, ...), delivered from the durable outbox once :meth:`AlertEngine.start` runs,
    and ``extra_channels`` (W&B alerts: :func:`isoaudit.audit.trackers.setup.tracker_channels`)."""
    channels: list[Channel] = [LogChannel(), DatabaseChannel()]
    for i, url in enumerate(webhook_urls(settings.webhook_url)):
        channels.append(WebhookChannel(url, name=_numbered("webhook", i)))
    for i, url in enumerate(webhook_urls(settings.alertmanager_url)):
        channels.append(AlertmanagerChannel(url, name=_numbered("alertmanager", i)))
    channels.extend(extra_channels)
    return AlertEngine(
        store,
        channels,
        dashboard_url=settings.dashboard_url,
        step_path=settings.dashboard_step_path,
        deliver_in_background=True,
    )


def install_configured_rules(store: Store, settings: Settings) -> None:
    """Defaults where no rule of their name exists; the YAML file's rules replace those of their name."""
    if settings.default_alert_rules:
        install_rules(store, default_rules(), "default", replace=False)
    if settings.alert_rules_file:
        install_rules(store, load_rules(settings.alert_rules_file), "yaml", replace=True)
