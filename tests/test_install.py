"""What a fresh clone trips on: a top-level folder that shadows another distribution, a lock that drifted from
pyproject.toml, an installed ckv that ships a top-level name other than its own (docs/install.md)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-dev.lock"
OWN = {"ckv", "ckv_kernels"}

# Run from the repository root, where `python eval.py`, `python -m ...` and pytest put the root on sys.path: each
# top-level name must import from where an installed distribution put it, never from the checkout.
RESOLVE = """
import importlib, json, sys
from transformers import DeepseekV4ForCausalLM, Qwen3ForCausalLM
where = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    where[name] = getattr(module, "__file__", None) or list(module.__path__)
print(json.dumps(where))
"""


def root_names() -> set[str]:
    """The import names the repository root offers: its top-level modules and folders."""
    names = {p.stem for p in REPO.glob("*.py")}
    names |= {p.name for p in REPO.iterdir() if p.is_dir() and p.name.isidentifier()}
    return names


def test_no_top_level_folder_shadows_an_installed_distribution() -> None:
    """transformers 5.25 imports the PyPI `kernels` (a dependency of it): from the root it must get that one, not
    ckv's `kernels/` folder (which holds the package `ckv_kernels` one level down and is itself no package)."""
    provided = importlib.metadata.packages_distributions()
    assert "kernels" in provided, "transformers' dependency `kernels` is not installed: make install"
    clashing = sorted(root_names() & set(provided) - OWN)
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, *clashing], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    where = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(where) == set(clashing) and "kernels" in where
    for name, path in where.items():
        paths = path if isinstance(path, list) else [path]
        ours = (REPO / name, REPO / f"{name}.py")  # the checkout's own (the venv may live inside the checkout)
        assert not any(Path(p).resolve().is_relative_to(o) for p in paths for o in ours), f"{name}: {paths}"


def test_no_root_folder_is_a_regular_package_but_tests() -> None:
    """A folder with __init__.py at the root wins over any installed package of that name; only the test suite's
    own `tests` may be one (pytest imports it by that name)."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages <= {"tests"}, packages


def test_installed_ckv_ships_only_its_own_top_level_names() -> None:
    top = importlib.metadata.distribution("ckv").read_text("top_level.txt") or ""
    assert set(top.split()) == OWN
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {pattern.split(".")[0] for pattern in found["include"]} == OWN


def load_lock_drift():
    """.ci/lock_drift.py (make test-latest's report) as a module: its lock reader and name normalisation are the
    ones these tests check with."""
    spec = importlib.util.spec_from_file_location("lock_drift", REPO / ".ci" / "lock_drift.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DRIFT = load_lock_drift()


def locked() -> dict[str, str]:
    return DRIFT.read_lock(LOCK)


def test_the_lock_pins_every_requirement_of_pyproject_within_its_range() -> None:
    """A pyproject.toml edited without `make lock` fails here, not on a user's fresh clone."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = locked()
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        name = DRIFT.canonical(req.name)
        assert name in pins, f"{req.name} is in pyproject.toml but not in {LOCK.name}: run make lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {req}"


def test_this_environment_is_the_lock() -> None:
    """`make install` installs exactly the lock (make test-latest is the place for newer releases)."""
    if (REPO / ".venv-latest").resolve() == Path(sys.prefix).resolve():
        pytest.skip("make test-latest runs the newest releases: its drift report lists what differs from the lock")
    have = DRIFT.installed()
    differ = {n: (v, have.get(n)) for n, v in locked().items() if n not in {"pip", "setuptools"} and have.get(n) != v}
    assert not differ, f"installed versions differ from {LOCK.name} (lock, installed): {differ}; run make install"


def test_vendored_copies_on_sys_path_are_not_installed_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing setuptools appends ``setuptools/_vendor`` (an older packaging, platformdirs, ...) to ``sys.path``; the
    drift check reads the environment's site-packages, so a test that imports setuptools first cannot fail the one
    above."""
    before = DRIFT.installed()
    vendor = Path(importlib.util.find_spec("setuptools").origin).parent / "_vendor"
    assert vendor.is_dir() and any(vendor.glob("packaging-*.dist-info"))
    monkeypatch.setattr(sys, "path", [*sys.path, str(vendor)])  # where setuptools puts it: after site-packages
    assert DRIFT.installed() == before


def test_readme_names_the_locked_versions() -> None:
    """README's one line of tested versions is the lock's, so it cannot go stale after `make lock`."""
    readme = (REPO / "README.md").read_text()
    tested = re.search(r"\(tested: Python [\d.]+, (.*?)\)", readme, flags=re.S)
    assert tested, "README has no '(tested: Python ..., name version, ...)' line"
    pins = locked()
    named = [item.split() for item in " ".join(tested.group(1).split()).split(", ")]
    assert len(named) >= 5
    for name, version in named:
        assert pins.get(name) == version, f"README says {name} {version}, {LOCK.name} has {pins.get(name)}"


def sys_path_edits(path: Path) -> list[int]:
    """The lines of a module's own code (not of a script in a string it runs) that call sys.path.insert/append."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in {"insert", "append"}
        and ast.unparse(node.func.value) == "sys.path"
    ]


def test_no_test_puts_a_folder_of_the_suite_on_sys_path() -> None:
    """tests/kernels is a package: a test that put tests/ on sys.path made every later `import kernels` in that worker
    (transformers' hub kernels) find it. Tests import their helpers as `tests.<folder>.helpers`."""
    offenders = {str(p.relative_to(REPO)): sys_path_edits(p) for p in (REPO / "tests").rglob("*.py")}
    assert not {name: lines for name, lines in offenders.items() if lines}
