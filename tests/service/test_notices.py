"""Alert notices are durable and per destination, with the real parts: `isoaudit serve` (its worker
a child process) with two webhooks, each a real HTTP receiver in this process. One hangs: the
other still gets its notice at once. The service is SIGKILLed while the hanging one's notice is
pending: after a restart that notice is delivered from the outbox, once, and the other receiver
gets nothing twice. The store is reconciled against what was sent."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from isoaudit.audit.alerts import AlertEngine, AlertRule, DatabaseChannel, LogChannel, Outbox, save_rule
from isoaudit.audit.alerts.channels import WebhookChannel
from isoaudit.audit.alerts.history import delivery_attempts, list_alerts, notifications
from isoaudit.audit.alerts.outbox import LEASE_MARGIN_S
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import NoticeOutboxRow
from isoaudit.audit.records import Batch
from sqlalchemy import func, select

from tests import factories
from tests.service.processes import alive, children, serve, wait_for
from tests.service.receiver import Receiver
from tests.service.workload import KL_HIGH_RULES, reconcile, step_records


def outbox_rows(store: Store) -> int:
    with store.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(NoticeOutboxRow)) or 0)


@pytest.mark.slow
def test_a_pending_notice_survives_a_sigkill_and_a_hung_webhook_delays_no_other(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'notices.db'}"
    store = Store(url)
    token = create_token(store, "alpha")
    rules = tmp_path / "rules.yaml"
    rules.write_text(KL_HIGH_RULES)
    port = free_port()
    with Receiver() as slow, Receiver() as quick:
        env = {
            "ISOAUDIT_ALERT_WEBHOOK_URL": f"{slow.url},{quick.url}",  # two destinations
            "ISOAUDIT_ALERT_RULES": str(rules),
            "ISOAUDIT_DEFAULT_ALERT_RULES": "0",
            "ISOAUDIT_WORKER_INTERVAL_S": "0.05",
        }
        slow.hang()  # holds every request without answering: the 5 s timeout runs out
        api = serve(url, port, worker=True, env=env)
        sent = [*step_records(0, 0.2)]
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
            ) as http:
                body = Batch(records=[factories.run(), *sent]).model_dump_json()
                assert http.post("/v1/ingest", content=body).status_code == 200
                started = time.monotonic()
                quick_s = wait_for(lambda: len(quick.messages) == 1, 60, "the quick webhook's notice")
            wait_for(lambda: slow.hung >= 1, 10, "the slow webhook's first attempt")  # held, unanswered
            assert not slow.messages
            assert time.monotonic() - started < WebhookChannel("u").timeout_s + 5  # not behind its timeout
            # The quick destination's row goes once its outcome is recorded, a moment after the
            # receiver has the message; the slow destination's notice stays, pending.
            wait_for(lambda: outbox_rows(store) == 1, 5, "the quick notice's outcome to be recorded")

            [worker] = children(api.pid)
            api.send_signal(signal.SIGKILL)  # mid-attempt: the notice is claimed, not delivered
            api.wait(10)
            wait_for(lambda: not alive(worker), 10, "the worker to die with the API")
            assert outbox_rows(store) == 1 and not slow.messages
            slow.answer()  # the endpoint answers again

            killed = time.monotonic()
            api = serve(url, port, worker=True, env=env)
            delivered = wait_for(lambda: len(slow.messages) == 1, 60, "the pending notice after the restart")
            after_kill = time.monotonic() - killed
            time.sleep(1.0)  # a second copy, were one coming, would arrive now
        finally:
            api.send_signal(signal.SIGTERM)
            api.wait(30)
        assert [(m["isoaudit"]["event"], m["isoaudit"]["step"]) for m in slow.messages] == [("firing", 0)]
        assert len(quick.messages) == 1  # nothing sent twice to the other destination
    assert outbox_rows(store) == 0
    [alert] = list_alerts(store, run_id="run-1")
    rows = {n.channel: n for n in notifications(store, alert.id)}
    assert {c: r.status for c, r in rows.items()} == {
        "log": "sent",
        "database": "stored",
        "webhook": "sent",
        "webhook-2": "sent",
    }
    assert delivery_attempts(rows["webhook-2"])[-1]["outcome"] == "sent"
    assert (
        rows["webhook"].attempts >= 1
    )  # the attempt the kill cut off left no record; retaken after its lease
    counts = reconcile(store, sent)
    assert (counts["lost"], counts["extra"], counts["doubled"]) == (0, 0, 0), counts
    store.dispose()
    print(
        f"\nnotices: the quick webhook got its notice {quick_s:.2f} s after ingest while the other hung; "
        f"the hung one's notice, pending at the SIGKILL, delivered once {after_kill:.1f} s after it "
        f"({delivered:.1f} s after the restart answered; lease margin {LEASE_MARGIN_S} s); {counts}"
    )


def test_the_outbox_sends_in_order_per_destination_and_once_between_two_workers(store: Store):
    """Two workers (outboxes) on one database, two destinations, one of them answering 503 first:
    each destination gets firing then resolved, each once; the retry waits its backoff, recorded."""
    store.ingest([factories.run()], project="alpha")
    save_rule(store, AlertRule(name="kl_now", metric="kl_k3", threshold=1e-3, for_steps=1), "api")
    with Receiver(statuses=[503]) as flaky, Receiver() as steady:
        channels = [
            WebhookChannel(flaky.url, attempts=3, backoff_s=0.05),
            WebhookChannel(steady.url, name="webhook-2", backoff_s=0.05),
        ]
        engine = AlertEngine(store, [LogChannel(), DatabaseChannel(), *channels], deliver_in_background=True)
        for step, kl in enumerate([2e-3, 1e-5]):  # fires, then resolves
            metrics = {"kl_k3": kl}
            row = {"run_id": "run-1", "step": step, "n_samples": 1, "metrics": metrics, "diagnoses": {}}
            store.save_comparison([], [row], [])
            engine.evaluate("run-1", step, metrics)
        assert engine.outbox is not None
        assert [engine.outbox.pending(c.destination) for c in channels] == [2, 2]  # nothing sent yet
        other = Outbox(store, channels, worker="other-worker")
        deadline = time.monotonic() + 20
        while engine.outbox.pending() and time.monotonic() < deadline:
            for box in (engine.outbox, other):
                for channel in channels:
                    box.deliver_next(channel)
            time.sleep(0.01)
        engine.close()
        assert flaky.events() == steady.events() == [("firing", 0), ("resolved", 1)]
    assert outbox_rows(store) == 0
    [alert] = list_alerts(store, run_id="run-1")
    webhook = [n for n in notifications(store, alert.id) if n.channel == "webhook"]
    assert [(n.event, n.status, n.attempts) for n in webhook] == [
        ("firing", "sent", 2),
        ("resolved", "sent", 1),
    ]
    tries = delivery_attempts(webhook[0])
    assert [t["outcome"] for t in tries] == ["HTTP 503: ok", "sent"] and tries[0]["wait_s"] == 0.05
