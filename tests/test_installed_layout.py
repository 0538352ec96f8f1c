"""isoaudit installs one top-level name, and generic names around it cannot shadow its parts.

A fresh virtual environment gets isoaudit (built as a wheel, and editable) and nothing of its own
beside it: its dependencies come from this test run's environment through a ``.pth`` line. Then a
throwaway distribution that owns the top-level names ``audit``, ``collectors``, ``dashboard``,
``migrations`` and ``kernels`` is installed beside it, a user's own ``collectors/`` and ``audit.py``
stand first on ``sys.path``, and the README's snippet, ``isoaudit demo`` and ``isoaudit dashboard``
still run. Separately: run from the checkout's root (where ``python -c`` puts the folder ``kernels/``
first on ``sys.path``), transformers still gets Hugging Face's ``kernels`` while ``isoaudit.kernels``
is ours."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_readme import readme_snippet

ROOT = Path(__file__).resolve().parent.parent
GENERIC_NAMES = ("audit", "collectors", "dashboard", "migrations", "kernels")


def _pip(python: Path, *args: str) -> None:
    """This environment's pip, installing into ``python``'s environment."""
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    done = subprocess.run([*command, "install", "-q", "--no-deps", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _fresh_environment(folder: Path) -> tuple[Path, Path]:
    """A new venv whose site-packages is empty but for a ``.pth`` naming this environment's
    packages (isoaudit's dependencies; ``.pth`` files there, such as an editable isoaudit's
    finder, are not processed). Returns its python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    packages = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (packages / "zz_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python, packages


def _top_level_names(packages: Path) -> set[str]:
    """What a fresh site-packages holds besides metadata and our dependencies' ``.pth``."""
    return {
        entry.name.removesuffix(".py")
        for entry in packages.iterdir()
        if not entry.name.endswith((".dist-info", ".pth")) and entry.name != "__pycache__"
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
    ]
    done = subprocess.run([*command, str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("isoaudit-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name(wheel: Path, tmp_path: Path) -> None:
    python, packages = _fresh_environment(tmp_path / "venv")
    _pip(python, str(wheel))
    assert _top_level_names(packages) == {"isoaudit"}
    (info,) = packages.glob("isoaudit-*.dist-info")
    installed = {line.split(",")[0].split("/")[0] for line in (info / "RECORD").read_text().splitlines()}
    assert installed - {info.name, "..", "bin"} == {"isoaudit"}, installed
    files = {line.split(",")[0] for line in (info / "RECORD").read_text().splitlines()}
    for expected in (
        "isoaudit/py.typed",
        "isoaudit/kernels/__init__.py",
        "isoaudit/migrations/versions/0001_initial_schema.py",
        "isoaudit/dashboard/assets/bootstrap.min.css",
    ):
        assert expected in files


def test_an_editable_install_maps_one_top_level_name(tmp_path: Path) -> None:
    python, packages = _fresh_environment(tmp_path / "venv")
    _pip(python, "--no-build-isolation", "-e", str(ROOT))
    finder = next(packages.glob("__editable___isoaudit_*_finder.py"))
    code = (
        f"import importlib.util, sys; sys.path.insert(0, {str(packages)!r}); "
        f"spec = importlib.util.spec_from_file_location('finder', {str(finder)!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(sorted({name.split('.')[0] for name in module.MAPPING}))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['isoaudit']"
    code = (
        "import importlib.util, isoaudit.audit, isoaudit.kernels, isoaudit.cli\n"
        f"for name in {GENERIC_NAMES!r}:\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    print(name, spec.origin if spec else None)\n"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():  # none of ours; only Hugging Face's kernels may be there
        name, origin = line.split(" ", 1)
        assert origin == "None" or (name == "kernels" and Path(origin).parent != ROOT / "kernels"), line


def _throwaway_distribution(folder: Path) -> Path:
    """A distribution owning the five generic top-level names, each announcing itself."""
    for name in GENERIC_NAMES:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"OWNER = 'throwaway {name}'\n")
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=77"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "generic-names"
            version = "1.0"

            [tool.setuptools]
            packages = {list(GENERIC_NAMES)!r}
            """
        )
    )
    return folder


READMES_WORLD = """\
import numpy as np
from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model
from isoaudit.kernels.adapters import HFCausalLM
from isoaudit.kernels.engine import RolloutEngine
import audit, collectors

assert (audit.OWNER, collectors.OWNER) == ("user", "user"), (audit, collectors)
directory = make_tiny_model("qwen3", "model", num_layers=2, hidden=64, vocab=512, seed=3, dtype="float32")
policy, _ = load_tiny_model(directory)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 500, n).tolist() for n in (5, 9, 3)]
engine = RolloutEngine(HFCausalLM(policy), max_len=64)
max_new, steps = [4, 6, 2], 2
"""


@pytest.mark.slow
def test_generic_names_beside_isoaudit_shadow_nothing(wheel: Path, tmp_path: Path) -> None:
    python, packages = _fresh_environment(tmp_path / "venv")
    _pip(python, str(wheel))
    _pip(python, "--no-build-isolation", str(_throwaway_distribution(tmp_path / "generic")))
    assert _top_level_names(packages) == {"isoaudit", *GENERIC_NAMES}
    user = tmp_path / "user"
    (user / "collectors").mkdir(parents=True)
    (user / "collectors" / "__init__.py").write_text("OWNER = 'user'\n")
    (user / "audit.py").write_text("OWNER = 'user'\n")
    (user / "readme_job.py").write_text(READMES_WORLD + readme_snippet())
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ISOAUDIT_", "TRITON_INTERPRET"))},
        "PYTHONPATH": str(user),  # the user's own collectors/ and audit.py first
        "ISOAUDIT_DATABASE_URL": f"sqlite:///{user / 'isoaudit.db'}",
    }
    bin_dir = python.parent

    done = subprocess.run(
        [str(python), "readme_job.py"], cwd=user, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "isoaudit run grpo-7: trainer sent" in done.stderr

    done = subprocess.run(
        [str(bin_dir / "isoaudit"), "demo", "--no-serve", "--steps", "4"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    done = subprocess.run(
        [str(bin_dir / "isoaudit"), "dashboard", "--help"], cwd=user, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "--database-url" in done.stdout, done.stdout + done.stderr


def test_the_kernels_folder_cannot_shadow_hugging_faces_kernels() -> None:
    """``python -c`` from the checkout's root: ``import kernels`` (as transformers does) is Hugging
    Face's installed package, ``isoaudit.kernels`` is this checkout's ``kernels/``."""
    pytest.importorskip("kernels", reason="Hugging Face's kernels is not installed")
    code = (
        "import sys, kernels, isoaudit.kernels as ours\n"
        "import transformers.integrations.hub_kernels  # imports kernels when its version suits\n"
        "from kernels import get_kernel  # Hugging Face's API\n"
        "print(kernels.__file__); print(ours.__file__); print(sys.modules['kernels'] is kernels)\n"
        "print(hasattr(kernels, 'get_kernel'), hasattr(ours, 'enable'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours, one_module, apis = done.stdout.split("\n")[:4]
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert "site-packages" in theirs and Path(theirs).parent != ROOT / "kernels"
    assert (one_module, apis) == ("True", "True True")


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """pyproject.toml lists packages by name (the mapping needs it): a folder with an
    ``__init__.py`` that is missing from the list would be left out of the wheel."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from installed_layout import package_folders
    finally:
        sys.path.pop(0)
    listed = {folder.resolve() for folder in package_folders(ROOT).values()}
    found = {
        init.parent.resolve()
        for part in ("isoaudit", *GENERIC_NAMES)
        for init in (ROOT / part).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found - listed == set(), sorted(str(f.relative_to(ROOT)) for f in found - listed)
