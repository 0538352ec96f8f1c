"""The ``isoaudit`` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from isoaudit import __version__
from isoaudit.cli import app
from tests import factories

runner = CliRunner()


def test_version_and_help():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "db" in result.output and "runs" in result.output


def test_console_script_is_installed():
    result = subprocess.run(
        [sys.executable, "-m", "isoaudit.cli", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and __version__ in result.stdout


def test_db_upgrade_then_runs_list(database_url: str):
    result = runner.invoke(app, ["db", "upgrade", "--database-url", database_url])
    assert result.exit_code == 0, result.output
    assert "revision" in result.output
    result = runner.invoke(app, ["runs", "list", "--database-url", database_url])
    assert result.exit_code == 0 and "no runs" in result.output

    from isoaudit.audit.db import Store

    store = Store(database_url)
    store.ingest(
        [factories.run("grpo-42", name="qwen3 grpo"), factories.sample("trainer", run_id="grpo-42", step=3)]
    )
    store.dispose()
    result = runner.invoke(app, ["runs", "list", "--database-url", database_url])
    assert result.exit_code == 0 and "grpo-42" in result.output and "qwen3 grpo" in result.output
