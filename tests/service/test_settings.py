"""Settings from the environment, and the dashboard links alert notices carry."""

from __future__ import annotations

import pytest
from isoaudit.audit.alerts import AlertEngine
from isoaudit.audit.settings import Settings
from pydantic import ValidationError


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("ISOAUDIT_REQUIRE_TOKEN_FOR_READS", "false")
    monkeypatch.setenv("ISOAUDIT_MAX_BODY_BYTES", "1024")
    monkeypatch.setenv("ISOAUDIT_ALERT_WEBHOOK_URL", "http://hooks.example/x")
    monkeypatch.setenv("ISOAUDIT_DASHBOARD_STEP_PATH", "/run/{run_id}/step/{step}")
    settings = Settings.from_env(run_worker=False, webhook_url=None)
    assert settings.require_token_for_reads is False and settings.max_body_bytes == 1024
    assert settings.webhook_url == "http://hooks.example/x"  # None overrides nothing
    assert settings.run_worker is False
    monkeypatch.setenv("ISOAUDIT_MAX_BODY_BYTES", "-5")
    with pytest.raises(ValidationError, match="max_body_bytes"):
        Settings.from_env()
    monkeypatch.setenv("ISOAUDIT_MAX_BODY_BYTES", "5")
    monkeypatch.setenv("ISOAUDIT_RUN_WORKER", "perhaps")
    with pytest.raises(ValueError, match="ISOAUDIT_RUN_WORKER: not a boolean"):
        Settings.from_env()


def test_step_links():
    engine = AlertEngine(store=None, channels=[], dashboard_url="https://dash.example/isoaudit/")  # type: ignore[arg-type]
    assert engine.step_url("grpo/7 b", 12) == "https://dash.example/isoaudit/runs/grpo%2F7%20b?step=12"
    custom = AlertEngine(None, [], dashboard_url="http://d", step_path="/run/{run_id}/step/{step}")  # type: ignore[arg-type]
    assert custom.step_url("r", 3) == "http://d/run/r/step/3"
