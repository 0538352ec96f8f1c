"""Alerts: the rule model and its YAML, the state machine, and the engine on SQLite and PostgreSQL
with a real local HTTP receiver as the webhook."""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta

import pytest
from isoaudit.audit.alerts import (
    AlertEngine,
    AlertRule,
    DatabaseChannel,
    LogChannel,
    RulesFileError,
    SilenceSpec,
    WebhookChannel,
    create_silence,
    default_rules,
    evaluate_series,
    install_rules,
    load_rules,
    next_state,
    parse_rules,
    save_rule,
)
from isoaudit.audit.alerts.channels import Delivery
from isoaudit.audit.alerts.history import list_alerts, notifications
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import AlertRow
from isoaudit.audit.records import utcnow
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from tests import factories
from tests.service.receiver import Receiver

WARN = AlertRule(
    name="kl_warn", metric="kl_k3", threshold=1e-3, for_steps=3, keep_firing_for=2, labels={"team": "rl"}
)


def series(*values):
    return [(step, {"kl_k3": value}) for step, value in enumerate(values)]


# ---------------------------------------------------------------------- rule model and YAML


def test_default_rules_are_those_of_the_design():
    warning, critical, mult, tinker = default_rules()
    assert (warning.metric, warning.comparison, warning.threshold, warning.for_steps, warning.severity) == (
        "kl_k3",
        ">",
        1e-3,
        3,
        "warning",
    )
    assert (
        critical.metric,
        critical.comparison,
        critical.threshold,
        critical.for_steps,
        critical.severity,
    ) == (
        "kl_k3",
        ">",
        1e-2,
        0,
        "critical",
    )
    # defaults from the field, each naming its source; aliases resolve to the stored key
    assert (mult.metric, mult.threshold) == (
        "nemo-rl:token_mult_prob_error",
        1.05,
    ) and "NeMo-RL" in mult.description
    assert (tinker.metric, tinker.threshold) == (
        "tinker:kl_sample_train_v1",
        0.01,
    ) and "Tinker" in tinker.description
    assert "metric_alias" not in tinker.labels  # written as its stored key
    assert "Source" in warning.description


@pytest.mark.parametrize(
    ("written", "key"),
    [
        ("verl:rollout_corr/k3_kl", "verl:rollout_corr/k3_kl"),
        ("kl_sample_train_v1", "tinker:kl_sample_train_v1"),
        ("sampling/importance_sampling_ratio/max", "trl:sampling/importance_sampling_ratio/max"),
        ("kl_k3/lag_1", "kl_k3/lag_1"),
    ],
)
def test_a_rule_on_a_framework_name_evaluates_the_stored_key(written, key):
    rule = AlertRule(name="alias", metric=written, threshold=0.5)
    assert rule.metric == key
    assert rule.labels.get("metric_alias", key) == written
    assert evaluate_series(rule, [(0, {key: 0.75})]).breaching
    assert AlertRule.model_validate(rule.model_dump(by_alias=True)) == rule  # stored and read back alike


def test_rules_load_from_yaml(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(
        """
rules:
  - name: drift
    metric: logprob_abs_diff_mean
    comparison: ">="
    threshold: 5e-2
    window: 4
    aggregation: max
    for: 2
    keep_firing_for: 1
    severity: critical
    labels: {team: rl}
"""
    )
    [rule] = load_rules(path)
    assert (rule.threshold, rule.window, rule.aggregation, rule.for_steps, rule.keep_firing_for) == (
        0.05,
        4,
        "max",
        2,
        1,
    )
    assert rule.labels == {"team": "rl"}
    assert parse_rules("[]") == [] and parse_rules("") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules:\n  - {name: a, metric: kl_k4, threshold: 1}", "rule a: metric"),
        ("rules:\n  - {name: a, metric: kl_k3, threshold: 1, for: -2}", "rule a: for"),
        ("rules:\n  - {name: a, metric: kl_k3, threshold: .nan}", "rule a: threshold"),
        ("rules:\n  - {name: a, metric: kl_k3, threshold: 1, comparison: '=>'}", "rule a: comparison"),
        ("rules:\n  - {name: a, metric: kl_k3, threshold: 1, severity: loud}", "rule a: severity"),
        ("rules:\n  - {name: a, metric: kl_k3, threshold: 1, fro: 3}", "rule a: fro"),
        ("rules:\n  - {metric: kl_k3, threshold: 1}", "rule #0: name"),
        (
            "rules:\n  - {name: a, metric: kl_k3, threshold: 1}\n  - {name: a, metric: kl_k1, threshold: 1}",
            "repeated: a",
        ),
        ("rules: {name: a}", "expected a list"),
        ("rules: [", "not valid YAML"),
    ],
)
def test_bad_rules_files_name_the_rule_and_field(text, message):
    with pytest.raises(RulesFileError, match=message):
        parse_rules(text, "rules.yaml")


# ---------------------------------------------------------------------- state machine


def states(rule: AlertRule, values) -> list[str]:
    """The state after each step, evaluating the growing series as the engine does."""
    state, out = "inactive", []
    for end in range(1, len(values) + 1):
        state = next_state(rule, state, evaluate_series(rule, series(*values[:end])))
        out.append(state)
    return out


def test_pending_then_firing_after_for_steps_then_resolved_after_keep_firing_for():
    hi, lo = 2e-3, 1e-4
    assert states(WARN, [lo, hi, hi, hi, hi, lo, lo, lo, lo]) == [
        "inactive",
        "pending",
        "pending",
        "firing",
        "firing",
        "firing",
        "firing",
        "resolved",
        "resolved",
    ]


def test_a_breach_within_keep_firing_for_keeps_it_firing():
    hi, lo = 2e-3, 1e-4
    assert states(WARN, [hi, hi, hi, lo, lo, hi, lo, lo, lo]) == [
        "pending",
        "pending",
        "firing",
        "firing",
        "firing",
        "firing",
        "firing",
        "firing",
        "resolved",
    ]


def test_pending_that_clears_goes_back_to_inactive():
    assert states(WARN, [2e-3, 2e-3, 0.0, 2e-3]) == ["pending", "pending", "inactive", "pending"]


def test_for_zero_fires_at_once_and_keep_zero_resolves_at_once():
    rule = AlertRule(name="c", metric="kl_k3", threshold=1e-2)
    assert states(rule, [0.0, 0.02, 0.0, 0.02]) == ["inactive", "firing", "resolved", "firing"]


def test_window_aggregation_and_missing_data():
    rule = AlertRule(name="m", metric="kl_k3", threshold=1e-3, window=3, aggregation="mean")
    evaluation = evaluate_series(rule, series(0.0, 0.0, 4e-3))
    assert math.isclose(evaluation.value, 4e-3 / 3) and evaluation.breaching
    assert not evaluate_series(rule, series(0.0, 0.0, 2e-3)).breaching
    assert evaluate_series(rule.model_copy(update={"aggregation": "max"}), series(5e-3, 0.0, 0.0)).breaching
    # NaN or absent values are "no data": they never breach and are left out of a window.
    assert not evaluate_series(rule, series(None, float("nan"))).breaching
    assert evaluate_series(rule, series(None, float("nan"))).value is None
    assert math.isclose(evaluate_series(rule, series(None, 3e-3, float("nan"))).value, 3e-3)
    below = AlertRule(name="corr", metric="rollout_actor_probs_pearson_corr", comparison="<", threshold=0.99)
    assert evaluate_series(below, [(0, {"rollout_actor_probs_pearson_corr": 0.9})]).breaching


# ---------------------------------------------------------------------- the engine on the store


class Clock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now


def run_steps(store: Store, engine: AlertEngine, values, start: int = 0, run_id: str = "run-1") -> list[list]:
    """Save each step's results as the worker does, then call the engine as its callback."""
    out = []
    for step, kl in enumerate(values, start):
        metrics = {"kl_k3": kl, "kl_k1": kl / 2}
        store.save_comparison(
            [], [{"run_id": run_id, "step": step, "n_samples": 1, "metrics": metrics, "diagnoses": {}}], []
        )
        out.append(engine.evaluate(run_id, step, metrics))
    return out


def open_state(store: Store, rule: str = "kl_warn", run_id: str = "run-1") -> str:
    alerts = [a for a in list_alerts(store, run_id=run_id) if a.rule == rule]
    return alerts[0].state if alerts else "inactive"


@pytest.fixture
def alert_store(store: Store) -> Store:
    store.ingest([factories.run()], project="alpha")
    save_rule(store, WARN, "api")
    return store


def test_a_run_whose_kl_rises_and_falls_sends_one_firing_and_one_resolved(alert_store: Store, caplog):
    hi, lo = 2e-3, 1e-5
    with Receiver() as receiver:
        channels = [LogChannel(), DatabaseChannel(), WebhookChannel(receiver.url, backoff_s=0.01)]
        engine = AlertEngine(alert_store, channels, dashboard_url="http://dash.example:8050/")
        seen = []
        with caplog.at_level(logging.INFO, logger="isoaudit.alerts"):
            for step, kl in enumerate([lo, hi, hi, hi, hi, lo, lo, lo, lo, lo]):
                run_steps(alert_store, engine, [kl], start=step)
                seen.append(open_state(alert_store))
        assert seen == [
            "inactive",
            "pending",
            "pending",
            "firing",
            "firing",
            "firing",
            "firing",
            "resolved",
            "resolved",
            "resolved",
        ]
        assert receiver.events() == [("firing", 3), ("resolved", 7)]

        firing = receiver.messages[0]
        assert firing["text"].startswith("[FIRING] kl_warn (warning) on run run-1 at step 3")
        [attachment] = firing["attachments"]
        assert attachment["title_link"] == "http://dash.example:8050/runs/run-1?step=3"
        assert {"title": "team", "value": "rl", "short": True} in attachment["fields"]
        assert firing["isoaudit"]["value"] == pytest.approx(hi)
        assert receiver.messages[1]["text"].startswith("[RESOLVED] kl_warn")

    [alert] = list_alerts(alert_store, run_id="run-1")
    assert (alert.state, alert.started_step, alert.fired_step, alert.resolved_step) == ("resolved", 1, 3, 7)
    assert alert.firing_notified and alert.resolved_notified
    rows = notifications(alert_store, alert.id)
    assert [(n.event, n.channel, n.status) for n in rows] == [
        ("firing", "log", "sent"),
        ("firing", "database", "stored"),
        ("firing", "webhook", "sent"),
        ("resolved", "log", "sent"),
        ("resolved", "database", "stored"),
        ("resolved", "webhook", "sent"),
    ]
    logged = [r.getMessage() for r in caplog.records if r.name == "isoaudit.alerts"]
    assert (
        sum("[FIRING] kl_warn" in m for m in logged) == 1
        and sum("[RESOLVED] kl_warn" in m for m in logged) == 1
    )


def test_evaluating_a_step_again_changes_and_sends_nothing(alert_store: Store):
    with Receiver() as receiver:
        engine = AlertEngine(alert_store, [WebhookChannel(receiver.url, backoff_s=0.01)])
        run_steps(alert_store, engine, [2e-3, 2e-3, 2e-3])
        for _ in range(3):  # a re-comparison, a retry, a second worker
            assert engine.evaluate("run-1", 2, {"kl_k3": 2e-3}) == []
            assert engine.evaluate("run-1", 1, {"kl_k3": 2e-3}) == []  # an older step than the latest
        assert receiver.events() == [("firing", 2)]
    with alert_store.sessions() as session:
        assert session.scalar(select(func.count()).select_from(AlertRow)) == 1


def test_a_second_open_alert_for_the_same_rule_and_run_is_refused(alert_store: Store):
    engine = AlertEngine(alert_store, [])
    run_steps(alert_store, engine, [2e-3])
    [alert] = list_alerts(alert_store)
    with pytest.raises(IntegrityError), alert_store.sessions.begin() as session:
        session.add(
            AlertRow(
                rule_id=1,
                run_id="run-1",
                state="firing",
                severity="x",
                labels={},
                started_step=0,
                last_step=0,
            )
        )
        session.flush()
    with alert_store.sessions.begin() as session:  # a closed one beside it is fine
        session.add(
            AlertRow(
                rule_id=1,
                run_id="run-1",
                state="resolved",
                severity="x",
                labels={},
                started_step=0,
                last_step=0,
            )
        )
    assert alert.state == "pending"


def test_a_silence_suppresses_notices_until_it_expires(alert_store: Store):
    clock = Clock()
    with Receiver() as receiver:
        engine = AlertEngine(alert_store, [WebhookChannel(receiver.url, backoff_s=0.01)], now=clock)
        silence = create_silence(
            alert_store, SilenceSpec(labels={"team": "rl"}, duration_s=600), project="alpha", now=clock.now
        )
        run_steps(alert_store, engine, [2e-3, 2e-3, 2e-3, 2e-3])  # fires at step 2, silenced
        assert open_state(alert_store) == "firing"
        assert receiver.messages == []
        [alert] = list_alerts(alert_store)
        assert [(n.event, n.status) for n in notifications(alert_store, alert.id)] == [("firing", "silenced")]

        clock.now += timedelta(seconds=601)  # the silence has expired: the still-firing alert is announced
        run_steps(alert_store, engine, [2e-3], start=4)
        run_steps(alert_store, engine, [2e-3], start=5)
        assert receiver.events() == [("firing", 4)]
        run_steps(alert_store, engine, [0.0, 0.0, 0.0], start=6)
        assert receiver.events() == [("firing", 4), ("resolved", 8)]
    assert silence.ends_at is not None


def test_a_silence_that_covers_the_whole_episode_sends_nothing(alert_store: Store):
    with Receiver() as receiver:
        engine = AlertEngine(alert_store, [WebhookChannel(receiver.url, backoff_s=0.01)])
        create_silence(alert_store, SilenceSpec(rule="kl_warn", run_id="run-1", duration_s=600), project=None)
        create_silence(
            alert_store, SilenceSpec(rule="other", duration_s=600), project=None
        )  # matches nothing
        run_steps(alert_store, engine, [2e-3, 2e-3, 2e-3, 0.0, 0.0, 0.0])
        assert open_state(alert_store) == "resolved"
        assert receiver.messages == []
    [alert] = list_alerts(alert_store)
    assert not alert.firing_notified and not alert.resolved_notified
    assert [(n.event, n.status) for n in notifications(alert_store, alert.id)] == [
        ("firing", "silenced"),
        ("resolved", "silenced"),
    ]


def test_silences_of_another_project_or_run_do_not_apply(alert_store: Store):
    with Receiver() as receiver:
        engine = AlertEngine(alert_store, [WebhookChannel(receiver.url, backoff_s=0.01)])
        create_silence(alert_store, SilenceSpec(duration_s=600), project="beta")
        create_silence(alert_store, SilenceSpec(run_id="run-2", duration_s=600), project="alpha")
        create_silence(alert_store, SilenceSpec(labels={"team": "infra"}, duration_s=600), project="alpha")
        run_steps(alert_store, engine, [2e-3, 2e-3, 2e-3])
        assert receiver.events() == [("firing", 2)]


def test_webhook_retries_with_backoff_then_records_the_failure(alert_store: Store):
    with Receiver(statuses=[500, 503]) as flaky:
        engine = AlertEngine(alert_store, [WebhookChannel(flaky.url, attempts=4, backoff_s=0.01)])
        run_steps(alert_store, engine, [2e-3, 2e-3, 2e-3])
        assert flaky.events() == [("firing", 2)] and flaky.attempts == 3
    [alert] = list_alerts(alert_store)
    [sent] = notifications(alert_store, alert.id)
    assert (sent.status, sent.attempts) == ("sent", 3)

    with Receiver(statuses=[500] * 10) as broken:
        engine = AlertEngine(
            alert_store, [WebhookChannel(broken.url, attempts=3, backoff_s=0.01), DatabaseChannel()]
        )
        run_steps(alert_store, engine, [0.0, 0.0, 0.0], start=3)  # resolves; the webhook is down
        assert broken.attempts == 3 and broken.messages == []
    rows = notifications(alert_store, alert.id)
    failed = next(n for n in rows if n.event == "resolved" and n.channel == "webhook")
    assert (failed.status, failed.attempts) == ("failed", 3)
    assert "HTTP 500" in failed.error
    assert any(n.event == "resolved" and n.channel == "database" for n in rows)  # the other channel still ran


def test_an_unreachable_webhook_never_raises(alert_store: Store):
    with Receiver() as gone:
        url = gone.url
    engine = AlertEngine(alert_store, [WebhookChannel(url, attempts=2, backoff_s=0.01, timeout_s=1)])
    run_steps(alert_store, engine, [2e-2, 2e-2, 2e-2])  # no exception
    [alert] = list_alerts(alert_store)
    [failed] = notifications(alert_store, alert.id)
    assert failed.status == "failed" and "ConnectError" in failed.error


def test_rules_apply_to_their_project_only_and_disabled_rules_not_at_all(alert_store: Store):
    alert_store.ingest([factories.run("run-b")], project="beta")
    save_rule(alert_store, AlertRule(name="beta_only", metric="kl_k3", threshold=0.0, project="beta"))
    save_rule(alert_store, AlertRule(name="off", metric="kl_k3", threshold=0.0, enabled=False))
    engine = AlertEngine(alert_store, [])
    run_steps(alert_store, engine, [1.0])
    run_steps(alert_store, engine, [1.0], run_id="run-b")
    rules_on = {(a.rule, a.run_id) for a in list_alerts(alert_store)}
    assert rules_on == {("kl_warn", "run-1"), ("kl_warn", "run-b"), ("beta_only", "run-b")}


def test_a_rule_added_to_a_run_already_breaching_fires_at_once_from_the_first_breach(alert_store: Store):
    engine = AlertEngine(alert_store, [])
    run_steps(alert_store, engine, [0.0, 0.5, 0.5, 0.5, 0.5])
    save_rule(alert_store, AlertRule(name="late", metric="kl_k3", threshold=0.1, for_steps=3))
    engine.evaluate("run-1", 4, None)
    [late] = [a for a in list_alerts(alert_store) if a.rule == "late"]
    assert (late.state, late.started_step, late.fired_step) == ("firing", 1, 4)


def test_installing_rules_keeps_edits_unless_replacing(store: Store):
    assert install_rules(store, default_rules(), "default", replace=False) == len(default_rules())
    save_rule(store, default_rules()[0].model_copy(update={"threshold": 5e-3}), "api")
    assert install_rules(store, default_rules(), "default", replace=False) == 0
    engine = AlertEngine(store, [])
    store.ingest([factories.run()], project="alpha")
    run_steps(store, engine, [4e-3, 4e-3, 4e-3])
    assert open_state(store, "kl_k3_warning") == "inactive"  # the edited threshold (5e-3) holds
    assert install_rules(store, default_rules(), "yaml", replace=True) == len(default_rules())
    run_steps(store, engine, [4e-3], start=3)
    assert open_state(store, "kl_k3_warning") == "firing"


class SlowChannel:
    """A channel that takes its time, like a webhook retrying a dead receiver."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds, self.sent = seconds, []

    def send(self, notice):
        import time

        time.sleep(self.seconds)
        self.sent.append((notice.event, notice.step))
        return Delivery(self.name, "sent", payload=notice.as_dict())


def test_background_delivery_never_holds_up_evaluation(alert_store: Store):
    import time

    slow = SlowChannel(1.5)
    engine = AlertEngine(alert_store, [slow, DatabaseChannel()], deliver_in_background=True)
    started = time.monotonic()
    run_steps(alert_store, engine, [2e-3, 2e-3, 2e-3, 2e-3, 1e-5, 1e-5, 1e-5, 1e-5])
    assert time.monotonic() - started < 1.5  # the worker's callback returned while the channel slept
    engine.close()  # waits for what is in flight, in order
    assert slow.sent == [("firing", 2), ("resolved", 6)]
    [alert] = list_alerts(alert_store, run_id="run-1")
    assert [(n.event, n.channel, n.status) for n in notifications(alert_store, alert.id)] == [
        ("firing", "slow", "sent"),
        ("firing", "database", "stored"),
        ("resolved", "slow", "sent"),
        ("resolved", "database", "stored"),
    ]
