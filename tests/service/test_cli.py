"""``isoaudit serve``, ``tokens`` and ``alerts``, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import verify_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.schema import head_revision
from typer.testing import CliRunner

from isoaudit.cli import app
from tests import factories

runner = CliRunner()


def test_tokens_create_list_revoke(database_url: str):
    created = runner.invoke(
        app, ["tokens", "create", "--project", "alpha", "--name", "ci", "--database-url", database_url]
    )
    assert created.exit_code == 0, created.output
    token = created.output.strip()
    assert token.startswith("iso_")
    store = Store(database_url)
    principal = verify_token(store, token)
    assert principal is not None and principal.project == "alpha"

    listed = runner.invoke(app, ["tokens", "list", "--database-url", database_url])
    assert principal.token_id in listed.output and "alpha" in listed.output and token not in listed.output

    assert (
        runner.invoke(app, ["tokens", "revoke", principal.token_id, "--database-url", database_url]).exit_code
        == 0
    )
    assert verify_token(store, token) is None
    assert (
        runner.invoke(app, ["tokens", "revoke", principal.token_id, "--database-url", database_url]).exit_code
        == 1
    )
    bad = runner.invoke(app, ["tokens", "create", "--project", "no spaces", "--database-url", database_url])
    assert bad.exit_code != 0 and "project" in bad.output
    store.dispose()


def test_tokens_revoke_takes_the_token_itself_or_its_id_and_never_prints_the_secret(database_url: str):
    def tokens(*args: str):
        return runner.invoke(app, ["tokens", *args, "--database-url", database_url])

    store = Store(database_url)
    leaked, other, third = (tokens("create", "--project", "alpha").output.strip() for _ in range(3))
    leaked_id, secret = leaked.split("_", 2)[1:]
    # The leaked token itself, as the user has it in hand: revoked, its secret never printed.
    revoked = tokens("revoke", leaked)
    assert revoked.exit_code == 0 and leaked_id in revoked.output and secret not in revoked.output, (
        revoked.output
    )
    assert verify_token(store, leaked) is None and verify_token(store, other) is not None
    again = tokens("revoke", leaked)
    assert again.exit_code == 1 and f"no live token with id {leaked_id}" in again.output
    # A token whose secret is not its id's: nothing revoked, and the secret given is not repeated.
    other_id = other.split("_")[1]
    forged = f"iso_{other_id}_{'x' * 43}"
    refused = tokens("revoke", forged)
    assert refused.exit_code == 2 and "secret is not that of token" in refused.output, refused.output
    assert "x" * 20 not in refused.output and verify_token(store, other) is not None
    # Not a token at all: said so, without repeating it.
    garbage = tokens("revoke", "iso_nothex_" + "s3cret" * 5)
    assert garbage.exit_code == 2 and "expected a token" in garbage.output and "s3cret" not in garbage.output
    # The id, bare or with the prefix `tokens list` shows.
    assert tokens("revoke", f"iso_{other_id}").exit_code == 0 and verify_token(store, other) is None
    assert tokens("revoke", third.split("_")[1]).exit_code == 0 and verify_token(store, third) is None
    store.dispose()


def test_alerts_commands(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {name: drift, metric: kl_k1, threshold: 1.0e-2, for: 2}\n")
    checked = runner.invoke(app, ["alerts", "check", str(rules)])
    assert checked.exit_code == 0 and "drift: kl_k1 > 0.01 for 2 steps" in checked.output
    rules.write_text("rules:\n  - {name: drift, metric: kl_k9, threshold: 1}\n")
    failed = runner.invoke(app, ["alerts", "check", str(rules)])
    assert failed.exit_code == 1 and "rule drift: metric" in failed.output
    rules.write_text("rules:\n  - {name: drift, metric: kl_k1, threshold: 1.0e-2}\n")
    assert runner.invoke(app, ["alerts", "load", str(rules), "--database-url", url]).exit_code == 0
    listed = runner.invoke(app, ["alerts", "rules", "--database-url", url])
    assert "drift" in listed.output and "yaml" in listed.output
    store = Store(url)
    store.ingest([factories.run()])
    from isoaudit.audit.alerts import AlertEngine

    store.save_comparison(
        [], [{"run_id": "run-1", "step": 0, "n_samples": 1, "metrics": {"kl_k1": 1.0}, "diagnoses": {}}], []
    )
    AlertEngine(store, []).evaluate("run-1", 0, None)
    alerts = runner.invoke(app, ["alerts", "list", "--open", "--database-url", url])
    assert "drift" in alerts.output and "firing" in alerts.output
    store.dispose()


def test_serve_runs_the_api(tmp_path):
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "isoaudit.cli",
            "serve",
            "--database-url",
            url,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert health.json()["schema_revision"] == head_revision()
        assert httpx.get(f"http://127.0.0.1:{port}/v1/runs").status_code == 401
        rules = httpx.get(f"http://127.0.0.1:{port}/openapi.json").json()
        assert "/v1/ingest" in rules["paths"]
    finally:
        process.terminate()
        process.wait(30)
