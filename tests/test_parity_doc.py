"""docs/parity.md is what scripts/parity/table.py renders from audit.frameworks and the fixtures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_parity_table_is_current() -> None:
    spec = importlib.util.spec_from_file_location("parity_table", ROOT / "scripts" / "parity" / "table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "parity.md").read_text() == module.render(), (
        "docs/parity.md is out of date: run `python scripts/parity/table.py`"
    )
