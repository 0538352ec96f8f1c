"""isoaudit's notices in a real Alertmanager (Debian's ``prometheus-alertmanager``, API v2): a rule
fires on a run compared by the real worker and the alert is active in Alertmanager with isoaudit's
labels and annotations; the run recovers and it resolves (Alertmanager's own webhook receiver gets
the resolution); while firing longer than an alert lives without a post, the outbox's re-posts keep
it active (and without them it ends); an Alertmanager that is down, then up, gets the alert from the
outbox after retries, or from the re-post once the notice's retries ran out. The payload is checked
against Alertmanager's OpenAPI definition of ``postableAlerts``."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from isoaudit.audit.alerts import AlertEngine, AlertRule, DatabaseChannel, Notice, save_rule, slack_payload
from isoaudit.audit.alerts.alertmanager import AlertmanagerChannel, alerts_url, postable_alert
from isoaudit.audit.alerts.history import delivery_attempts, list_alerts, notifications
from isoaudit.audit.alerts.setup import default_alert_engine
from isoaudit.audit.alerts.silences import SilenceSpec, create_silence
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import NoticeOutboxRow
from isoaudit.audit.records import Batch
from isoaudit.audit.settings import Settings
from isoaudit.audit.worker import ComparisonWorker
from sqlalchemy import func, select

from tests import factories
from tests.dashboard.records import DIVERGING, step_records
from tests.monitoring.binaries import Alertmanager, alertmanager
from tests.service.processes import serve, wait_for
from tests.service.receiver import Receiver

#: Alertmanager's ``postableAlerts`` (api/v2/openapi.yaml, definitions ``postableAlerts``,
#: ``postableAlert``, ``alert`` and ``labelSet``), as JSON Schema.
POSTABLE_ALERTS = {
    "type": "array",
    "items": {
        "allOf": [
            {
                "type": "object",
                "properties": {
                    "startsAt": {"type": "string", "format": "date-time"},
                    "endsAt": {"type": "string", "format": "date-time"},
                    "annotations": {"$ref": "#/definitions/labelSet"},
                },
            },
            {
                "type": "object",
                "properties": {
                    "labels": {"$ref": "#/definitions/labelSet"},
                    "generatorURL": {"type": "string", "format": "uri"},
                },
                "required": ["labels"],
            },
        ]
    },
    "definitions": {"labelSet": {"type": "object", "additionalProperties": {"type": "string"}}},
}
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

RULE = AlertRule(
    name="kl_spike",
    metric="kl_k3",
    threshold=1e-5,
    severity="critical",
    # A rule's own labels: one clashing with isoaudit's (it gives way), one of its own.
    labels={"team": "rl", "run": "not-the-run"},
    description="kl_k3 over 1e-5: the trainer and the engine disagree",
)
DASHBOARD = "http://dashboard.example:8050"


def notice(event: str = "firing", **fields: Any) -> Notice:
    values: dict[str, Any] = {
        "event": event,
        "alert_id": 7,
        "rule": "kl_spike",
        "run_id": "run-1",
        "project": "alpha",
        "step": 3,
        "value": 2.5e-5,
        "condition": "kl_k3 > 1e-05",
        "severity": "critical",
        "labels": {
            "alertname": "kl_spike",
            "severity": "critical",
            "metric": "kl_k3",
            "run": "x",
            "team": "rl",
        },
        "url": f"{DASHBOARD}/runs/run-1?step=3",
        "description": "kl over the line",
        "fired_at": datetime(2024, 5, 1, 12, 0, tzinfo=UTC),
        "first_divergence_region": "layers.0.mlp",
        "first_divergence_position": 4,
    }
    return Notice(**{**values, **fields})


def parse(moment: str) -> datetime:
    assert RFC3339.match(moment), moment
    return datetime.fromisoformat(moment.replace("Z", "+00:00"))


def test_the_payload_is_an_alertmanager_postable_alert():
    now = datetime(2024, 5, 1, 12, 5, tzinfo=UTC)
    channel = AlertmanagerChannel("http://am:9093/", repost_s=60)
    firing = channel.payload(notice(), now)
    resolved_at = datetime(2024, 5, 1, 12, 9, tzinfo=UTC)
    resolved = channel.payload(notice("resolved", resolved_at=resolved_at), now)
    for payload in (firing, resolved):
        body = channel.body(payload)
        jsonschema.validate(body, POSTABLE_ALERTS)
        [alert] = body
        assert all(isinstance(v, str) for v in [*alert["labels"].values(), *alert["annotations"].values()])
        assert all(LABEL_NAME.match(name) for name in [*alert["labels"], *alert["annotations"]])
        assert alert["labels"] == {
            "alertname": "kl_spike",
            "run": "run-1",  # isoaudit's identity labels win over a rule's own
            "project": "alpha",
            "severity": "critical",
            "metric": "kl_k3",
            "team": "rl",
        }
        assert alert["generatorURL"] == f"{DASHBOARD}/runs/run-1?step=3"
        annotations = alert["annotations"]
        assert annotations["dashboard_url"] == alert["generatorURL"]
        assert annotations["first_divergence"] == "layers.0.mlp at position 4"
        assert annotations["description"] == "kl over the line" and annotations["value"] == "2.5e-05"
        assert parse(alert["startsAt"]) == datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    [on] = channel.body(firing)
    [off] = channel.body(resolved)
    assert on["annotations"]["summary"].startswith("[FIRING] kl_spike (critical) on run run-1 at step 3")
    assert off["annotations"]["summary"].startswith("[RESOLVED]")
    assert parse(on["endsAt"]) == now + timedelta(seconds=4 * 60)  # four re-post intervals ahead
    assert parse(off["endsAt"]) == resolved_at  # the moment it resolved: Alertmanager resolves it
    # No first divergence located: no annotation; an alert resolved before it fired still ends after it.
    bare = postable_alert(
        notice("resolved", first_divergence_region=None, resolved_at=datetime(2024, 1, 1, tzinfo=UTC)),
        now,
        60,
    )
    assert "first_divergence" not in bare["annotations"] and bare["endsAt"] == bare["startsAt"]


def test_a_notice_keeps_its_times_and_first_divergence_through_the_outbox_row_and_the_webhook():
    fired = notice("resolved", resolved_at=datetime(2024, 5, 1, 12, 9, tzinfo=UTC))
    record = fired.to_record()
    assert json.loads(json.dumps(record)) == record  # what a JSON column keeps
    assert Notice.from_record(record) == fired
    older = {
        k: v for k, v in record.items() if k not in ("fired_at", "resolved_at", "first_divergence_region")
    }
    assert Notice.from_record(older).fired_at is None  # a row queued by an older version still reads
    message = slack_payload(fired)
    fields = {f["title"]: f["value"] for f in message["attachments"][0]["fields"]}
    assert fields["First divergence"] == "layers.0.mlp at position 4"
    assert message["isoaudit"]["first_divergence"] == "layers.0.mlp at position 4"
    assert message["isoaudit"]["fired_at"] == "2024-05-01T12:00:00+00:00"


def test_urls_and_settings_make_one_channel_per_alertmanager(store: Store, monkeypatch: pytest.MonkeyPatch):
    assert (
        alerts_url("http://am:9093")
        == alerts_url("http://am:9093/api/v2/alerts/")
        == ("http://am:9093/api/v2/alerts")
    )
    with pytest.raises(ValueError, match="ends_after_s"):
        AlertmanagerChannel("http://am:9093", repost_s=10, ends_after_s=10)
    monkeypatch.setenv("ISOAUDIT_ALERTMANAGER_URL", "http://a:9093, http://b:9093/")
    engine = default_alert_engine(store, Settings.from_env())
    managers = [c for c in engine.channels if isinstance(c, AlertmanagerChannel)]
    assert [(c.name, c.url) for c in managers] == [
        ("alertmanager", "http://a:9093/api/v2/alerts"),
        ("alertmanager-2", "http://b:9093/api/v2/alerts"),
    ]
    assert engine.outbox is not None and {c.name for c in engine.outbox.channels} == {
        "alertmanager",
        "alertmanager-2",
    }
    assert len({c.destination for c in managers}) == 2


# ---------------------------------------------------------------------- with the real Alertmanager


def manager_config(hook: Receiver) -> dict[str, Any]:
    """Routes every alert to ``hook`` (firing and resolved, grouped within a second); alerts posted
    without an ``endsAt`` would end after 3 s (isoaudit always sets one)."""
    return {
        "global": {"resolve_timeout": "3s"},
        "route": {
            "receiver": "hook",
            "group_by": ["alertname", "run"],
            "group_wait": "0s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [{"name": "hook", "webhook_configs": [{"url": hook.url, "send_resolved": True}]}],
    }


def hook_statuses(hook: Receiver, alertname: str = "kl_spike") -> list[str]:
    """The status of each notification Alertmanager sent its webhook receiver about ``alertname``."""
    return [
        alert["status"]
        for message in hook.messages
        for alert in message.get("alerts", [])
        if alert["labels"].get("alertname") == alertname
    ]


def outbox_rows(store: Store) -> int:
    with store.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(NoticeOutboxRow)) or 0)


@contextmanager
def engine_for(store: Store, channel: AlertmanagerChannel) -> Iterator[AlertEngine]:
    engine = AlertEngine(
        store, [DatabaseChannel(), channel], deliver_in_background=True, dashboard_url=DASHBOARD
    )
    assert engine.outbox is not None  # one durable channel: the outbox exists
    engine.outbox.poll_s = 0.05
    engine.start()
    try:
        yield engine
    finally:
        engine.close()


def compare_step(store: Store, engine: AlertEngine, step: int, *, mismatch: bool) -> None:
    """Ingest one step of ``run-1`` (project ``alpha``) and compare it with the real worker, whose
    per-step callback evaluates the rules."""
    store.ingest(step_records("run-1", step, mismatch=mismatch), project="alpha")
    assert ComparisonWorker(store, on_step=engine.evaluate).run_once() > 0


def held_report(store: Store, manager: Alertmanager, ends: list[datetime]) -> str:
    """What a failed hold shows: the outbox row that re-posts, every alert Alertmanager holds (any
    state) and the endsAt values seen, against the clock."""
    with store.sessions() as session:
        rows = [
            (row.status, row.event, row.next_attempt_at, row.claimed_until, row.attempts_log[-2:])
            for row in session.scalars(select(NoticeOutboxRow))
        ]
    return (
        f"now {datetime.now(UTC).isoformat()}; endsAt seen {[e.isoformat() for e in ends[-5:]]}; "
        f"outbox {rows}; alertmanager {manager.alerts()}"
    )


def active(manager: Alertmanager) -> list[dict[str, Any]]:
    return [a for a in manager.alerts(alertname="kl_spike") if a["status"]["state"] == "active"]


def test_a_firing_alert_is_active_in_alertmanager_stays_so_by_reposts_and_resolves(
    store: Store, tmp_path: Path
):
    store.ingest([factories.run()], project="alpha")
    save_rule(store, RULE, "api")
    with Receiver() as hook, alertmanager(tmp_path / "am", manager_config(hook), cluster=False) as manager:
        channel = AlertmanagerChannel(manager.url, repost_s=0.5, ends_after_s=2.0, backoff_s=0.05)
        with engine_for(store, channel) as engine:
            compare_step(store, engine, 0, mismatch=True)
            fired_s = wait_for(lambda: active(manager), 20, "the alert to be active in Alertmanager")
            now_active = active(manager)
            assert len(now_active) == 1, held_report(store, manager, [])
            [alert] = now_active
            labels, annotations = alert["labels"], alert["annotations"]
            assert labels == {
                "alertname": "kl_spike",
                "run": "run-1",
                "project": "alpha",
                "severity": "critical",
                "metric": "kl_k3",
                "team": "rl",
            }
            assert annotations["first_divergence"].startswith(f"{DIVERGING} at position ")
            assert annotations["dashboard_url"] == alert["generatorURL"] == engine.step_url("run-1", 0)
            assert annotations["description"] == RULE.description
            assert annotations["summary"].startswith("[FIRING] kl_spike (critical) on run run-1 at step 0")
            [isoaudit_alert] = list_alerts(store, run_id="run-1")
            starts = parse(alert["startsAt"])
            assert isoaudit_alert.fired_at is not None
            assert abs(starts - isoaudit_alert.fired_at) < timedelta(milliseconds=1)

            # Firing three times as long as one post keeps it: re-posts push endsAt on, one row at most.
            ends, rows = [parse(alert["endsAt"])], set()
            held = time.monotonic()
            while time.monotonic() - held < 3 * channel.ends_after_s:
                now_active = active(manager)
                assert len(now_active) == 1, held_report(store, manager, ends)  # never gone, never two
                [alert] = now_active
                ends.append(parse(alert["endsAt"]))
                rows.add(outbox_rows(store))
                time.sleep(0.2)
            assert parse(alert["startsAt"]) == starts  # the same alert, not a new one
            assert ends[-1] > ends[0] + timedelta(seconds=3 * channel.ends_after_s - 1)
            assert rows == {1} and engine.outbox is not None and engine.outbox.reposts() == 1
            mine = [n for n in notifications(store, isoaudit_alert.id) if n.channel == "alertmanager"]
            assert [(n.event, n.status) for n in mine] == [("firing", "sent")]  # re-posts record nothing
            assert hook_statuses(hook) == ["firing"]  # one alert, announced once downstream

            compare_step(store, engine, 1, mismatch=False)  # the run recovers
            resolved_s = wait_for(
                lambda: not manager.alerts(alertname="kl_spike"), 10, "the alert to resolve"
            )
            assert resolved_s < channel.ends_after_s  # resolved by the notice, not by running out
            wait_for(lambda: "resolved" in hook_statuses(hook), 10, "Alertmanager's resolved notification")
            time.sleep(1.0)  # a late re-post, were one coming, would raise the alert again now
            assert not manager.alerts(alertname="kl_spike") and hook_statuses(hook) == ["firing", "resolved"]
        assert outbox_rows(store) == 0
    resolved = [n for n in notifications(store, isoaudit_alert.id) if n.channel == "alertmanager"][-1]
    assert (resolved.event, resolved.status) == ("resolved", "sent")
    [posted] = resolved.payload["alerts"]
    assert parse(posted["endsAt"]) >= starts and posted["labels"]["alertname"] == "kl_spike"
    print(
        f"\nalertmanager: active {fired_s:.2f} s after the step was compared; held active "
        f"{3 * channel.ends_after_s:.0f} s by re-posts every {channel.repost_s} s (endsAt "
        f"{channel.ends_after_s} s ahead, moved on {(ends[-1] - ends[0]).total_seconds():.1f} s), one "
        f"outbox row; resolved {resolved_s:.2f} s after the recovering step was compared"
    )


class TimedChannel(AlertmanagerChannel):
    """The channel, noting when each of its posts returned (``time.monotonic``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.posted: list[float] = []

    def attempt(self, payload: dict[str, Any]) -> tuple[str, bool]:
        outcome = super().attempt(payload)
        self.posted.append(time.monotonic())
        return outcome


def test_without_its_reposts_alertmanager_ends_a_firing_alert(store: Store, tmp_path: Path):
    """The control: the alert still fires in isoaudit, but no one posts it again (the worker is
    stopped): Alertmanager ends it ``ends_after_s`` after the last post. Timed from that post, not
    from the stop: stopping waits for a post in flight, which a loaded database can hold up."""
    store.ingest([factories.run()], project="alpha")
    save_rule(store, RULE, "api")
    with Receiver() as hook, alertmanager(tmp_path / "am", manager_config(hook), cluster=False) as manager:
        channel = TimedChannel(manager.url, repost_s=0.5, ends_after_s=2.0, backoff_s=0.05)
        with engine_for(store, channel) as engine:
            compare_step(store, engine, 0, mismatch=True)
            wait_for(lambda: active(manager), 20, "the alert to be active in Alertmanager")
        last_post = channel.posted[-1]
        wait_for(lambda: not manager.alerts(alertname="kl_spike"), 10, "the alert to end")
        gone = time.monotonic() - last_post
        # endsAt counts from the clock read just before the post: the post's own time at most earlier
        assert channel.ends_after_s - 0.5 < gone <= channel.ends_after_s + 1.0
        print(f"\nalertmanager: without re-posts the alert ended {gone:.2f} s after the last post")
        wait_for(lambda: "resolved" in hook_statuses(hook), 10, "Alertmanager's resolved notification")
    [alert] = list_alerts(store, run_id="run-1")
    assert alert.state == "firing"  # isoaudit's alert fires on; its standing re-post waits for a worker
    assert outbox_rows(store) == 1


@pytest.mark.parametrize("attempts", [50, 2], ids=["within-its-retries", "after-giving-up"])
def test_an_alertmanager_down_then_up_gets_the_alert(store: Store, tmp_path: Path, attempts: int):
    """Down at the firing: retried with backoff until it is up (``within-its-retries``), or, once the
    notice's attempts ran out (recorded failed), posted by the alert's re-post (``after-giving-up``)."""
    store.ingest([factories.run()], project="alpha")
    save_rule(store, RULE, "api")
    port = free_port()
    channel = AlertmanagerChannel(
        f"http://127.0.0.1:{port}", repost_s=1.0, attempts=attempts, backoff_s=0.1, backoff_max_s=0.2
    )
    with engine_for(store, channel) as engine:
        compare_step(store, engine, 0, mismatch=True)
        [alert] = list_alerts(store, run_id="run-1")

        def tried() -> list[Any]:
            return [n for n in notifications(store, alert.id) if n.channel == "alertmanager"]

        if attempts == 2:
            wait_for(lambda: tried(), 10, "the notice to give up")
            [failed] = tried()
            assert (failed.status, failed.attempts) == ("failed", 2)
            assert engine.outbox is not None and engine.outbox.reposts() == 1  # posted again, later
        else:
            time.sleep(1.0)  # several attempts refused meanwhile
        with (
            Receiver() as hook,
            alertmanager(tmp_path / "am", manager_config(hook), port=port, cluster=False) as manager,
        ):
            wait_for(lambda: active(manager), 20, "the alert to reach Alertmanager once it is up")
            [posted] = active(manager)
            assert posted["labels"]["run"] == "run-1" and posted["annotations"]["first_divergence"]
    outcomes = tried()
    if attempts == 2:
        assert [n.status for n in outcomes] == ["failed"]  # the re-post records nothing of its own
    else:
        [sent] = outcomes
        tries = [t["outcome"] for t in delivery_attempts(sent)]
        assert sent.status == "sent" and sent.attempts == len(tries) >= 3
        assert all(t.startswith("ConnectError") for t in tries[:-1]) and tries[-1] == "sent"


def test_a_refused_post_is_not_retried_nor_reposted_and_a_silenced_resolution_drops_the_repost(store: Store):
    """4xx other than 429: recorded failed after one attempt, never posted again. A resolution a
    silence mutes is not announced; the alert's re-post sees it no longer fires and goes."""
    store.ingest([factories.run()], project="alpha")
    save_rule(store, RULE, "api")
    with Receiver(statuses=[400]) as refusing, Receiver() as taking:
        channels = [
            AlertmanagerChannel(refusing.url, repost_s=0.2, backoff_s=0.01),
            AlertmanagerChannel(taking.url, repost_s=0.2, backoff_s=0.01, name="alertmanager-2"),
        ]
        engine = AlertEngine(store, [DatabaseChannel(), *channels], deliver_in_background=True)
        outbox = engine.outbox
        assert outbox is not None
        compare_step(store, engine, 0, mismatch=True)

        def drain(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                for channel in channels:
                    outbox.deliver_next(channel)
                time.sleep(0.02)

        drain(1.0)  # the firing notice, then about four re-posts to the one that takes them
        assert refusing.attempts == 1 and outbox.reposts(channels[0].destination) == 0
        assert len(taking.messages) >= 3 and outbox.reposts(channels[1].destination) == 1
        create_silence(store, SilenceSpec(rule="kl_spike", duration_s=60), project="alpha")
        compare_step(store, engine, 1, mismatch=False)  # resolves, muted
        posts = len(taking.messages)
        drain(1.0)
        assert len(taking.messages) == posts  # its re-post, due, was dropped, not sent
        assert outbox_rows(store) == 0 and outbox.pending() == 0
        engine.close()
    [alert] = list_alerts(store, run_id="run-1")
    assert alert.state == "resolved" and not alert.resolved_notified
    statuses = {n.channel: n.status for n in notifications(store, alert.id) if n.event == "firing"}
    assert statuses == {"database": "stored", "alertmanager": "failed", "alertmanager-2": "sent"}
    assert all(m[0]["labels"]["alertname"] == "kl_spike" for m in taking.messages)


@pytest.mark.slow
def test_isoaudit_serve_with_alertmanager_fires_and_resolves_there(tmp_path: Path):
    """The deployment's path: `isoaudit serve --alertmanager URL` (its worker a child process),
    records through the API, the KL rule from a rules file."""
    url = f"sqlite:///{tmp_path / 'am.db'}"
    store = Store(url)
    token = create_token(store, "alpha")
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - {name: kl_spike, metric: kl_k3, comparison: '>', threshold: 1.0e-5, severity: critical}\n"
    )
    port = free_port()
    env = {"ISOAUDIT_ALERT_RULES": str(rules), "ISOAUDIT_WORKER_INTERVAL_S": "0.05"}
    with Receiver() as hook, alertmanager(tmp_path / "am", manager_config(hook), cluster=False) as manager:
        api = serve(url, port, worker=True, env=env, args=("--alertmanager", manager.url))
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
            ) as http:
                for step, mismatch in ((0, True), (1, False)):
                    records = [factories.run(), *step_records("run-1", step, mismatch=mismatch)]
                    response = http.post("/v1/ingest", content=Batch(records=records).model_dump_json())
                    assert response.status_code == 200, response.text
                    if mismatch:
                        wait_for(lambda: active(manager), 60, "the alert to be active in Alertmanager")
                        [alert] = active(manager)
                        assert {
                            k: alert["labels"][k] for k in ("alertname", "run", "project", "severity")
                        } == {
                            "alertname": "kl_spike",
                            "run": "run-1",
                            "project": "alpha",
                            "severity": "critical",
                        }
                        assert alert["annotations"]["first_divergence"].startswith(DIVERGING)
            wait_for(lambda: not manager.alerts(alertname="kl_spike"), 60, "the alert to resolve")
            wait_for(lambda: "resolved" in hook_statuses(hook), 10, "Alertmanager's resolved notification")
        finally:
            api.terminate()
            api.wait(30)
    [alert] = list_alerts(store, run_id="run-1")
    sent = [(n.event, n.status) for n in notifications(store, alert.id) if n.channel == "alertmanager"]
    assert sent == [("firing", "sent"), ("resolved", "sent")]
    store.dispose()
