"""docs/architecture.md's "Where do I change X" table, kept true by its examples: each row cites a patch of
docs/examples/ that makes a minimal one of its additions. The fast tests check that every patch still applies to
this tree and touches exactly the files its row lists (the row's paths are templates: ``<kind>``, ``<name>``, ...
stand for one name each, the same wherever they recur) and as many as its count says; the slow test applies each
patch to a copy of the tree and runs the row's "checked by" commands there (the patch's own tests among them)."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
SECTION = "## Where do I change X"
COLUMNS = ["X", "files to touch", "count", "example", "checked by"]


@dataclass(frozen=True)
class Row:
    """One row of the table: the path templates of the files to touch, their count, the example patch and the
    commands that check it."""

    what: str
    templates: tuple[str, ...]
    count: int
    patch: Path
    commands: tuple[str, ...]


def _outside_parentheses(text: str) -> str:
    """``text`` without its parenthesised notes (nested ones included)."""
    kept, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            kept.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(kept)


def table() -> list[Row]:
    """The rows of the section's table, as written."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    rows = []
    for line in lines[2:]:  # after the header and its rule
        what, files, count, example, checked = (cell.strip() for cell in line.strip("|").split("|"))
        link = re.fullmatch(r"\[[^\]]+\]\(([^)]+)\)", example)
        assert link, f"the example of {what!r} is not a link: {example}"
        rows.append(
            Row(
                what,
                tuple(re.findall(r"`([^`]+)`", _outside_parentheses(files))),
                int(count),
                (DOC.parent / link.group(1)).resolve(),
                tuple(re.findall(r"`([^`]+)`", checked)),
            )
        )
    return rows


ROWS = table()


def touched(patch: Path) -> list[str]:
    """The files ``patch`` changes or adds, as ``git apply --numstat`` lists them."""
    out = subprocess.run(
        ["git", "apply", "--numstat", str(patch)], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return sorted(line.split("\t")[2] for line in out.splitlines())


def _pattern(template: str) -> str:
    """A regex of ``template``: each ``<placeholder>`` one path component's name, captured under its name (a
    placeholder that recurs must repeat it)."""
    pattern, seen = "", set()
    for part in re.split(r"(<\w+>)", template):
        name = part[1:-1] if re.fullmatch(r"<\w+>", part) else None
        pattern += re.escape(part) if name is None else f"(?P={name})" if name in seen else f"(?P<{name}>[^/]+)"
        seen |= {name} - {None}
    return pattern


def binding(templates: tuple[str, ...], files: list[str]) -> dict[str, str] | None:
    """A one-to-one pairing of ``templates`` with ``files`` under which each placeholder names one thing (e.g.
    ``{"kind": "echo", "name": "echo"}``); None when there is none."""
    if len(templates) != len(files):
        return None
    for order in itertools.permutations(files):
        names: dict[str, str] = {}
        for template, file in zip(templates, order):
            m = re.fullmatch(_pattern(template), file)
            if m is None or any(names.setdefault(k, v) != v for k, v in m.groupdict().items()):
                break
        else:
            return names
    return None


def test_every_example_patch_is_one_row_of_the_table() -> None:
    patches = sorted(p.resolve() for p in (REPO / "docs" / "examples").glob("*.patch"))
    assert sorted(row.patch for row in ROWS) == patches


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.patch.stem)
def test_the_example_applies_to_this_tree(row: Row) -> None:
    check = subprocess.run(["git", "apply", "--check", str(row.patch)], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, f"{row.patch.name} no longer applies (redo it on this tree): {check.stderr}"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.patch.stem)
def test_the_example_touches_the_rows_files_and_no_other(row: Row) -> None:
    files = touched(row.patch)
    assert row.count == len(row.templates), f"{row.what}: count {row.count}, {len(row.templates)} files listed"
    assert binding(row.templates, files) is not None, f"{row.patch.name} touches {files}, the table {row.templates}"


def _tree_copy(dest: Path) -> None:
    """The checkout's files as they are now (tracked and new, not ignored) copied under ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.patch.stem)
def test_the_example_works_with_only_its_files_touched(row: Row, tmp_path: Path) -> None:
    """The patch applied to a copy of the tree, the row's commands pass there; the patch's own tests are among
    what they run."""
    tree = tmp_path / "tree"
    _tree_copy(tree)
    subprocess.run(["git", "apply", str(row.patch)], cwd=tree, check=True)
    own_tests = [f for f in touched(row.patch) if re.fullmatch(r"tests/.*test_\w+\.py", f)]
    words = [shlex.split(command) for command in row.commands]
    assert all(any(test in command for command in words) for test in own_tests), (own_tests, row.commands)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # a session of its own, not a worker
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), str(tree)])
    for command in words:
        assert command[0] == "python", command
        proc = subprocess.run(
            [sys.executable, *command[1:]], cwd=tree, env=env, capture_output=True, text=True, timeout=1800
        )
        assert proc.returncode == 0, f"{shlex.join(command)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
