"""The alerting code, the tokens and ``/metrics`` reach the database only through the data layer
(``audit.db``): none of their modules imports SQLAlchemy or an ORM table module, what the data layer
hands back are typed frozen rows (never ORM objects), and the alert and silence rows are defined
once: the API's schemas are those rows' fields (an alert's less its run's project)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from isoaudit.audit.alerts import AlertEngine, AlertRule, DatabaseChannel, create_silence, save_rule
from isoaudit.audit.alerts.history import list_alerts, notifications
from isoaudit.audit.alerts.rules import list_rule_rows
from isoaudit.audit.alerts.silences import SilenceSpec, list_silences
from isoaudit.audit.api.app import create_app
from isoaudit.audit.auth import create_token, list_tokens
from isoaudit.audit.db import Store
from isoaudit.audit.db.alerts import Alert, Silence

from tests import factories

ROOT = Path(__file__).resolve().parents[2]

#: The modules that must hold no SQL of their own.
ABOVE_THE_DATA_LAYER = sorted(
    [
        *(ROOT / "audit" / "alerts").glob("*.py"),
        ROOT / "audit" / "auth.py",
        ROOT / "audit" / "api" / "prometheus.py",
        ROOT / "audit" / "api" / "routers" / "alerts.py",
    ]
)

#: What only the data layer may import: SQLAlchemy, and the modules of ORM tables.
DATA_LAYER_ONLY = (
    "sqlalchemy",
    "isoaudit.audit.db.models",
)


def database_imports(source: str, filename: str) -> list[str]:
    """``filename:line imports name`` for each import in ``source`` of something only the data layer may use."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if any(name == banned or name.startswith(banned + ".") for banned in DATA_LAYER_ONLY):
                found.append(f"{filename}:{node.lineno} imports {name}")
                break
    return found


def test_alerts_auth_and_metrics_import_no_sqlalchemy_nor_orm_tables():
    assert len(ABOVE_THE_DATA_LAYER) >= 10  # the alerts package is really read
    offenders = [
        hit
        for path in ABOVE_THE_DATA_LAYER
        for hit in database_imports(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not offenders, "SQL outside the data layer:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("import sqlalchemy", "sqlalchemy"),
        ("from sqlalchemy.orm import Session", "sqlalchemy.orm"),
        ("from sqlalchemy import select", "sqlalchemy"),
        ("import sqlalchemy.exc as exc", "sqlalchemy.exc"),
        ("from isoaudit.audit.db.models import AlertRow", "isoaudit.audit.db.models"),
        ("from isoaudit.audit.db import models", "isoaudit.audit.db.models"),
    ],
)
def test_the_boundary_check_names_the_file_of_a_database_import(source: str, named: str):
    planted = f"import logging\nfrom isoaudit.audit.db.alerts import Alert\n{source}\n"
    assert database_imports(planted, "audit/alerts/planted.py") == [
        f"audit/alerts/planted.py:3 imports {named}"
    ]


def test_the_data_layer_hands_back_typed_frozen_rows(store: Store):
    store.ingest([factories.run()], project="alpha")
    create_token(store, "alpha")
    save_rule(store, AlertRule(name="kl_now", metric="kl_k3", threshold=1e-3), "api")
    create_silence(store, SilenceSpec(rule="other", duration_s=60), project="alpha")
    metrics = {"kl_k3": 2e-3}
    store.save_comparison([], [{"run_id": "run-1", "step": 0, "n_samples": 1, "metrics": metrics}], [])
    AlertEngine(store, [DatabaseChannel()]).evaluate("run-1", 0, metrics)
    [alert] = list_alerts(store)
    rows = [
        alert,
        *notifications(store, alert.id),
        *list_rule_rows(store),
        *list_silences(store),
        *list_tokens(store),
    ]
    assert len(rows) == 5
    for row in rows:
        assert dataclasses.is_dataclass(row) and not hasattr(row, "_sa_instance_state"), type(row)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(row, dataclasses.fields(row)[0].name, None)
    assert alert.started_at.tzinfo is not None  # every timestamp comes back in UTC, SQLite's too


def test_the_api_schemas_of_alerts_and_silences_are_their_rows():
    """One alert row, one silence row: the API answers with them (an alert less its run's project)."""
    schemas = create_app(Store("sqlite://")).openapi()["components"]["schemas"]
    shown = [field.name for field in dataclasses.fields(Alert) if field.name != "project"]
    assert list(schemas["Alert"]["properties"]) == shown
    assert list(schemas["Silence"]["properties"]) == [field.name for field in dataclasses.fields(Silence)]
    copies = [name for name in schemas if name.startswith(("Alert", "Silence"))]
    assert sorted(copies) == ["Alert", "AlertRule", "Silence", "SilenceSpec"], copies
