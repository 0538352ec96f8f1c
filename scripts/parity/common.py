"""What every framework-parity script shares: the input steps as a framework's tensors, a framework's
code at a pinned commit (from a fetched snapshot, never copied into this project), importing one of
its modules without the rest of its stack, and writing a fixture.

A fixture (tests/fixtures/parity/<framework>/<label>.json) is data: the commit and functions that
produced it, the settings they ran with, and per input step the figures the framework's own code
returned, under the names isoaudit shows them. tests/audit/test_framework_parity.py compares
isoaudit's figures to it within 1e-6 relative.

Snapshots: a bare clone per framework under $ISOAUDIT_PARITY_MIRRORS (default /work/.mirror), as
``<owner>+<name>/repo`` (``git clone --bare https://github.com/<owner>/<name> <owner>+<name>/repo``).
The frameworks' functions run on float64 tensors so that the comparison is of definitions, free of
float32 rounding (their code follows the input dtype).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"
INPUTS = FIXTURES / "inputs.json"
MIRRORS = Path(os.environ.get("ISOAUDIT_PARITY_MIRRORS", "/work/.mirror"))


def load_inputs() -> dict[str, list[dict[str, Any]]]:
    """The shared input steps (scripts/parity/inputs.py)."""
    return json.loads(INPUTS.read_text())["steps"]


def garbage() -> tuple[float, float]:
    return tuple(json.loads(INPUTS.read_text())["garbage"])  # type: ignore[return-value]


def padded(samples: list[dict[str, Any]], dtype: Any = None) -> dict[str, Any]:
    """One step as the [batch, T] tensors frameworks take: ``trainer``, ``rollout`` (padding holds
    garbage), ``mask`` (1 on the tokens the loss uses), ``advantages`` ([batch], and [batch, T]
    broadcast as ``token_advantages``), ``lengths`` (response lengths, masked spans included)."""
    import torch

    dtype = dtype or torch.float64
    width = max(len(s["trainer"]) for s in samples)
    g_t, g_r = garbage()
    trainer = torch.full((len(samples), width), g_t, dtype=dtype)
    rollout = torch.full((len(samples), width), g_r, dtype=dtype)
    mask = torch.zeros((len(samples), width), dtype=dtype)
    for i, s in enumerate(samples):
        n = len(s["trainer"])
        trainer[i, :n] = torch.tensor(s["trainer"], dtype=dtype)
        rollout[i, :n] = torch.tensor(s["rollout"], dtype=dtype)
        mask[i, :n] = torch.tensor(s["mask"], dtype=dtype)
    advantages = torch.tensor([s["advantage"] for s in samples], dtype=dtype)
    return {
        "trainer": trainer,
        "rollout": rollout,
        "mask": mask,
        "advantages": advantages,
        "token_advantages": advantages[:, None].expand(-1, width) * mask,
        "lengths": torch.tensor([len(s["trainer"]) for s in samples]),
        "ranks": [s.get("rank", 0) for s in samples],
    }


def mirror(repository: str) -> Path:
    """The bare snapshot of ``owner/name``."""
    path = MIRRORS / repository.replace("/", "+") / "repo"
    if not path.exists():
        raise SystemExit(
            f"no snapshot of {repository} at {path}: clone it bare there (see this module's docstring)"
        )
    return path


def git(repository: str, *args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={mirror(repository)}", *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def resolve_commit(repository: str, ref: str) -> tuple[str, str]:
    """(full sha, ISO date) of ``ref`` (a sha, a tag, HEAD)."""
    sha = git(repository, "rev-parse", f"{ref}^{{commit}}")
    date = git(repository, "show", "-s", "--format=%cI", sha)
    return sha, date


def checkout(repository: str, commit: str) -> Path:
    """The framework's tree at ``commit``, extracted into a temporary folder (kept for the process)."""
    target = Path(tempfile.mkdtemp(prefix=f"parity-{repository.replace('/', '-')}-{commit[:8]}-"))
    archive = subprocess.run(
        ["git", f"--git-dir={mirror(repository)}", "archive", "--format=tar", commit],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


class _Anything(types.ModuleType):
    """A stand-in module for a framework's dependency that the metric function does not use: any
    attribute is another stand-in (callable, subscriptable, usable as a base class or decorator)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{self.__name__}.{name}")


def _stand_in(qualname: str) -> Any:
    class StandIn:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __class_getitem__(cls, item: Any) -> Any:
            return cls

        def __getattr__(self, name: str) -> Any:
            return _stand_in(f"{qualname}.{name}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]  # used as a decorator
            return StandIn()

        def __init_subclass__(cls, **kwargs: Any) -> None:
            pass

    StandIn.__name__ = StandIn.__qualname__ = qualname.rsplit(".", 1)[-1]

    def decorator_or_instance(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return StandIn()

    StandIn.__call__ = staticmethod(decorator_or_instance)  # type: ignore[method-assign]
    return StandIn


def stub_modules(names: Iterable[str], tree: Path | None = None) -> None:
    """Register stand-ins for modules a framework imports but its metric functions never use (ray,
    megatron, vllm, …). Each named module is replaced; its parents are stubbed only when they are
    not real packages (of the framework's ``tree`` or installed here)."""
    if tree is not None:
        _on_path(tree)
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in sys.modules:
                continue
            if i < len(parts) and _findable(prefix):
                continue
            module = _Anything(prefix)
            module.__path__ = []  # a package, so submodules import
            sys.modules[prefix] = module
            parent = sys.modules.get(".".join(parts[: i - 1])) if i > 1 else None
            if parent is not None:
                setattr(parent, parts[i - 1], module)


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _on_path(tree: Path) -> None:
    for root in (tree / "src", tree):
        if root.is_dir() and str(root) not in sys.path:
            sys.path.insert(0, str(root))


def load_module(tree: Path, relative: str, name: str | None = None) -> types.ModuleType:
    """Import one file of the framework's tree as a module (its package root on sys.path, so its
    own relative and absolute imports resolve inside the snapshot)."""
    path = tree / relative
    name = name or relative.removesuffix(".py").replace("/", ".").replace("src.", "", 1)
    _on_path(tree)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def number(value: Any) -> float | None:
    """A figure as JSON: floats, None for NaN/inf (compared as "both undefined")."""
    try:
        value = value.item() if hasattr(value, "item") else value
    except (ValueError, RuntimeError):
        raise SystemExit(f"a figure is not a scalar: {value!r}") from None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def write_fixture(
    framework: str,
    label: str,
    *,
    repository: str,
    commit: str,
    functions: list[str],
    settings: dict[str, Any],
    values: dict[str, dict[str, Any]],
    version: str | None,
    era: str,
    script: str,
    notes: str = "",
) -> Path:
    """Write tests/fixtures/parity/<framework>/<label>.json."""
    sha, date = resolve_commit(repository, commit)
    out = FIXTURES / framework / f"{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "framework": framework,
        "repository": repository,
        "commit": sha,
        "commit_date": date,
        "version": version,
        "era": era,
        "functions": functions,
        "settings": settings,
        "generated_by": script,
        "notes": notes,
        "values": {step: {k: number(v) for k, v in figures.items()} for step, figures in values.items()},
    }
    out.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return out


def release_arguments(
    description: str | None, more: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The command line of a script that writes one release's fixture: ``--commit`` (a sha or tag),
    ``--version`` (the release it is; none: the newest code), ``--label`` (the fixture's name),
    ``--era`` (the isoaudit era that release runs) and ``--settings`` (the framework's, JSON)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--commit", default="HEAD", help="a sha or a tag")
    parser.add_argument("--version", default=None, help="the release the commit is (none: the newest code)")
    parser.add_argument("--label", default=None, help="the fixture's name")
    parser.add_argument("--era", required=True, help="isoaudit's era this release runs")
    parser.add_argument("--settings", default="{}", help="the framework settings, JSON")
    if more is not None:
        more(parser)  # a script's own options
    return parser.parse_args()


def run_each_release(script: str, releases: Iterable[tuple[str, str, str | None]]) -> None:
    """Run ``script --commit REF --label LABEL [--version V]`` once per (label, ref, version), each in
    a process of its own: a framework's modules are imported once per process, one release each."""
    for label, ref, version in releases:
        command = [sys.executable, script, "--commit", ref, "--label", label]
        if version is not None:
            command += ["--version", version]
        subprocess.run(command, check=True)


def run_steps(figures_of: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``figures_of`` (one step's samples to {isoaudit figure name: framework value}) on every step."""
    return {name: figures_of(samples) for name, samples in load_inputs().items()}
