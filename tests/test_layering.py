"""DESIGN.md's "may import" table holds: the import-linter contracts in pyproject.toml pass, the
checker really reads our packages (a contract we know to be false is reported broken), and the
service's comparison path runs without loading torch."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
    "lint-imports"
)
needs_linter = pytest.mark.skipif(
    LINT_IMPORTS is None, reason="lint-imports (import-linter) is not installed"
)
PARTS = ("audit", "collectors", "kernels", "dashboard", "migrations")


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    """``make lint``'s way: scripts/installed_layout.py runs lint-imports over the installed layout."""
    command = [sys.executable, str(ROOT / "scripts" / "installed_layout.py"), "imports", *args, "--no-cache"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@needs_linter
def test_the_import_contracts_hold():
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert " broken" in result.stdout and "0 broken" in result.stdout
    assert "ignore_imports" not in _contract_entries_naming("isoaudit.cli")


def _contract_entries_naming(module: str) -> str:
    """The pyproject lines of import-linter's section that mention ``module``."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text[text.index("[tool.importlinter]") : text.index("[tool.ruff]")]
    return "\n".join(line for line in section.splitlines() if module in line and "forbidden" not in line)


#: Where SQLAlchemy and Alembic may be imported: the data layer and the migration scripts.
DATABASE_DOORS = (Path("audit/db"), Path("migrations"))


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def sqlalchemy_importers(root: Path) -> list[str]:
    """``path:line imports module`` for every source file under ``root``'s parts and root package,
    outside :data:`DATABASE_DOORS`, that imports SQLAlchemy or Alembic."""
    offenders = []
    for folder in (*PARTS, "isoaudit"):
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if any(relative.is_relative_to(door) for door in DATABASE_DOORS):
                continue
            for line, module in _imported_modules(path):
                if module.split(".")[0] in ("sqlalchemy", "alembic"):
                    offenders.append(f"{relative}:{line} imports {module}")
    return offenders


def test_only_the_data_layer_imports_sqlalchemy():
    """One door into the database: every module reads and writes through ``audit.db``; nothing else
    imports SQLAlchemy or Alembic (their errors come out of the data layer as ``StoreError``s)."""
    offenders = sqlalchemy_importers(ROOT)
    assert not offenders, "only audit/db and migrations may import SQLAlchemy:\n" + "\n".join(offenders)


def test_the_database_door_check_finds_an_offender(tmp_path: Path):
    """Not vacuous: a module outside the data layer that imports SQLAlchemy is named, and one inside is not."""
    for part in PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "isoaudit").mkdir()
    (tmp_path / "audit" / "db").mkdir()
    (tmp_path / "audit" / "db" / "engine.py").write_text("import sqlalchemy\n")
    (tmp_path / "dashboard" / "data.py").write_text("import os\n\nfrom sqlalchemy.orm import Session\n")
    assert sqlalchemy_importers(tmp_path) == ["dashboard/data.py:3 imports sqlalchemy.orm"]


def test_no_part_imports_the_composition_root():
    """The root package (the public API and the CLI) sits above every part: no module of a part
    imports ``isoaudit`` itself or ``isoaudit.cli`` (import-linter's containers cannot see the root
    package's own module, so this reads the sources)."""
    offenders = []
    for part in PARTS:
        for path in (ROOT / part).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = (
                        [f"{node.module}.{alias.name}" for alias in node.names]
                        if node.module == "isoaudit"
                        else [node.module]
                    )
                else:
                    continue
                for name in names:
                    if name in ("isoaudit", "isoaudit.cli") or name.startswith("isoaudit.cli."):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
                    elif name.startswith("isoaudit.") and name.split(".")[1] not in PARTS:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not offenders, "\n".join(offenders)


@needs_linter
def test_the_checker_reports_a_contract_that_is_false(tmp_path: Path):
    """Not vacuous: the API does import the data layer, so forbidding it must be reported."""
    config = tmp_path / "false.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["isoaudit"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "known false"\ntype = "forbidden"\n'
        'source_modules = ["isoaudit.audit.api"]\nforbidden_modules = ["isoaudit.audit.db"]\n'
    )
    result = lint_imports(str(config))
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr


def test_the_service_compares_without_loading_torch():
    """What the static contract says, observed: importing the API, worker, comparator, metrics and
    diagnosis leaves torch unloaded (the service image need not ship it)."""
    code = (
        "import sys\n"
        "import isoaudit.audit.api.app, isoaudit.audit.worker, isoaudit.audit.compare, isoaudit.audit.metrics, isoaudit.audit.diagnosis\n"
        "loaded = sorted(m for m in ('torch', 'triton', 'vllm', 'transformers') if m in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"loaded: {result.stdout.strip()}"
