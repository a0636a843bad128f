"""tests/ mirrors the library (docs/architecture.md): a tests folder for each package of ``src/ckv``, and a
``tests/options/test_<group>.py`` for each option group of ``src/ckv/options/`` (docs/extending.md's checklist
puts a group's own tests there), so a new package or group cannot land without its tests' home."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "ckv"


@pytest.mark.parametrize("package", sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()))
def test_each_package_has_its_tests_folder(package):
    assert (REPO / "tests" / package / "__init__.py").is_file(), f"src/ckv/{package}/ has no tests/{package}/"


@pytest.mark.parametrize("group", sorted(p.stem for p in (SRC / "options").glob("*.py") if p.stem != "__init__"))
def test_each_option_group_has_its_tests_file(group):
    assert (REPO / "tests" / "options" / f"test_{group}.py").is_file(), (
        f"src/ckv/options/{group}.py has no tests/options/test_{group}.py"
    )
