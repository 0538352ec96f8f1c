"""Run the static checkers over the installed layout: ``imports`` (lint-imports) or ``types`` (mypy).

The parts live in top-level folders (``audit/``, ``collectors/``, ...) that install under one name,
``isoaudit``, through setuptools' ``package-dir`` mapping. import-linter finds a package's modules by
walking its folder and mypy resolves imports by folders too, so both are given the layout a wheel
has: this script copies the Python files into ``build/installed-layout/isoaudit/...`` by the same
mapping, runs the checker there and names files by their place in the repository again.

    python scripts/installed_layout.py imports [CONTRACTS.toml] [lint-imports options]
    python scripts/installed_layout.py types [mypy options]
    python scripts/installed_layout.py cycles     (import cycles between our modules, by grimp)
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "installed-layout"


def package_folders(root: Path = ROOT) -> dict[str, Path]:
    """Each installed package (``isoaudit.audit.alerts``) and the repository folder it comes from."""
    setuptools = pyproject(root)["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools["package-dir"]
    folders = {}
    for package in setuptools["packages"]:
        top = max((name for name in mapping if package == name or package.startswith(name + ".")), key=len)
        rest = package[len(top) :].strip(".")
        folders[package] = root / mapping[top] / Path(*rest.split(".") if rest else ())
    return folders


def pyproject(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())


def build_tree(root: Path = ROOT, tree: Path = TREE) -> dict[Path, Path]:
    """Copy every package's ``.py`` files (and ``py.typed``) to where the wheel puts them; returns
    each copy's repository path."""
    shutil.rmtree(tree, ignore_errors=True)
    origin = {}
    for package, source in package_folders(root).items():
        target = tree / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for file in [*source.glob("*.py"), *source.glob("py.typed")]:
            shutil.copy2(file, target / file.name)
            origin[(target / file.name).relative_to(tree)] = file.relative_to(root)
    return origin


def run(checker: str, options: list[str]) -> int:
    (ROOT / "build").mkdir(exist_ok=True)
    # One run at a time builds and reads the tree (a test and `make lint` may run side by side).
    with open(ROOT / "build" / "installed-layout.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _run_locked(checker, options)


def _run_locked(checker: str, options: list[str]) -> int:
    origin = build_tree()
    here = Path(sys.executable).parent
    if checker == "imports":
        config = str(ROOT / "pyproject.toml")
        if options and options[0].endswith(".toml"):  # another contract file (tests/test_layering.py)
            config, options = str(Path(options[0]).resolve()), options[1:]
        command = [shutil.which("lint-imports", path=str(here)) or "lint-imports", config]
    elif checker == "cycles":
        command = [sys.executable, str(Path(__file__).resolve()), "_cycles"]
    elif checker == "types":
        cache = str(ROOT / "build" / "mypy-cache")  # kept across runs: the tree is rebuilt each time
        command = [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            cache,
        ]
        command.append("isoaudit")
    else:
        raise SystemExit(f"checker: 'imports' or 'types', not {checker!r}")
    result = subprocess.run([*command, *options], cwd=TREE, capture_output=True, text=True)
    output = result.stdout + result.stderr
    for copy, source in sorted(origin.items(), key=lambda item: -len(str(item[0]))):
        output = output.replace(str(copy), str(source))
    print(output, end="")
    return result.returncode


def print_cycles(package: str = "isoaudit") -> int:
    """Print each group of modules that import each other in a circle (strongly connected, run in
    the tree with ``package`` importable); return how many groups there are."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in graph.modules:
                continue
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    print(f"{len(graph.modules)} modules; {len(groups)} import cycles (TYPE_CHECKING imports count)")
    for group in sorted(groups, key=len, reverse=True):
        print(f"  {len(group)}: " + ", ".join(group))
    return len(groups)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if sys.argv[1] == "_cycles":  # inside the tree (see run)
        sys.path.insert(0, str(Path.cwd()))
        print_cycles()
        sys.exit(0)
    sys.exit(run(sys.argv[1], sys.argv[2:]))
