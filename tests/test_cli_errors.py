"""Commands that open a store say why they cannot, and exit 1, instead of printing a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from isoaudit.cli import app

runner = CliRunner()
COMMANDS = [["runs", "list"], ["compare", "some-run"], ["tokens", "list"], ["alerts", "list"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_a_database_behind_this_isoaudit_is_refused_with_the_fix(blank_database_url: str, command) -> None:
    if blank_database_url.startswith("sqlite"):
        pytest.skip("the embedded SQLite store upgrades itself")
    result = runner.invoke(app, [*command, "--database-url", blank_database_url])
    assert result.exit_code == 1, result.output
    assert "isoaudit db upgrade" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_an_unreachable_server_is_named(command) -> None:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    result = runner.invoke(app, [*command, "--database-url", url])
    assert result.exit_code == 1, result.output
    assert "cannot open" in result.output and "127.0.0.1:1" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
