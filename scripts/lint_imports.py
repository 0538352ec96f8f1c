"""Check the import contracts (pyproject.toml's ``[tool.importlinter]``) over the installed layout.

The parts live in top-level folders (``audit/``, ``collectors/``, ...) that install under one name,
``isoaudit``, through setuptools' ``package-dir`` mapping. import-linter finds a package's modules
by walking its folder, so it is given the layout a wheel has: this script copies the Python files
into ``build/import-tree/isoaudit/...`` by that same mapping and runs ``lint-imports`` there.

    python scripts/lint_imports.py [CONFIG] [lint-imports options]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "import-tree"


def build_tree(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Copy every package's ``.py`` files to where the wheel puts them; returns ``tree``."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools["package-dir"]
    shutil.rmtree(tree, ignore_errors=True)
    for package in setuptools["packages"]:
        top = max((name for name in mapping if package == name or package.startswith(name + ".")), key=len)
        source = (
            root / mapping[top] / Path(*package[len(top) :].strip(".").split(".") if package != top else ())
        )
        target = tree / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for file in source.glob("*.py"):
            shutil.copy2(file, target / file.name)
    return tree


def main(argv: list[str]) -> int:
    config = argv[0] if argv and not argv[0].startswith("-") else str(ROOT / "pyproject.toml")
    options = argv[1:] if argv and not argv[0].startswith("-") else argv
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    tree = build_tree()
    return subprocess.run([lint_imports, str(Path(config).resolve()), *options], cwd=tree).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
