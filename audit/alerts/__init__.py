"""Alerts on the train-rollout mismatch (DESIGN.md, "Alerts"): rules from YAML or the API, a state
machine evaluated after each compared step, silences, and notices to the log, a webhook,
Alertmanager and the database.

    engine = AlertEngine(store, channels=[LogChannel(), DatabaseChannel(), WebhookChannel(url)])
    ComparisonWorker(store, on_step=engine.evaluate).start()
"""

from isoaudit.audit.alerts.alertmanager import AlertmanagerChannel, postable_alert
from isoaudit.audit.alerts.channels import (
    Channel,
    DatabaseChannel,
    Delivery,
    HttpChannel,
    LogChannel,
    Notice,
    WebhookChannel,
    slack_payload,
)
from isoaudit.audit.alerts.engine import AlertEngine, Transition
from isoaudit.audit.alerts.evaluator import Evaluation, evaluate_series, next_state
from isoaudit.audit.alerts.outbox import Outbox
from isoaudit.audit.alerts.rules import (
    DEFAULT_RULES_YAML,
    AlertRule,
    RulesFileError,
    default_rules,
    delete_rule,
    install_rules,
    load_rules,
    parse_rules,
    save_rule,
)
from isoaudit.audit.alerts.silences import SilenceSpec, create_silence, expire_silence, list_silences

__all__ = [
    "DEFAULT_RULES_YAML",
    "AlertEngine",
    "AlertRule",
    "AlertmanagerChannel",
    "Channel",
    "DatabaseChannel",
    "Delivery",
    "Evaluation",
    "HttpChannel",
    "LogChannel",
    "Notice",
    "Outbox",
    "RulesFileError",
    "SilenceSpec",
    "Transition",
    "WebhookChannel",
    "create_silence",
    "default_rules",
    "delete_rule",
    "evaluate_series",
    "expire_silence",
    "install_rules",
    "list_silences",
    "load_rules",
    "next_state",
    "parse_rules",
    "postable_alert",
    "save_rule",
    "slack_payload",
]
