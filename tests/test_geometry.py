"""The geometry module against brute-force readings of its conventions (module docstring, docs/attention.md)."""

import ast
from pathlib import Path

import pytest
import torch

from ckv import geometry as g
from tests.helpers import brute_covers, brute_influence

GEOMETRIES = [(4, 4), (8, 4), (8, 6), (5, 2), (3, 1)]


@pytest.mark.parametrize("window, stride", GEOMETRIES)
@pytest.mark.parametrize("local", [0, 3, 16, "tail"])
def test_influence_mask_matches_definition(window, stride, local):
    T = 27
    m = g.influence_mask(T, window, stride, local)
    expected = torch.tensor([[brute_influence(t, p, window, stride, local) for p in range(T)] for t in range(T)])
    assert torch.equal(m, expected)


@pytest.mark.parametrize("window, stride", GEOMETRIES)
def test_entries_and_windows(window, stride):
    T = 30
    assert g.num_entries(T, stride) == len([j for j in range(T) if (j + 1) * stride - 1 <= T - 1])
    pos, present = g.window_positions(0, g.num_entries(T, stride), window, stride)
    for j in range(pos.shape[0]):
        assert pos[j, -1] == (j + 1) * stride - 1  # every entry ends on a stride boundary
        assert present[j].tolist() == [p >= 0 for p in pos[j].tolist()]
        assert present[j, -1]  # never an entry without a present token


def test_phase_and_rope_positions():
    assert [g.phase(p, 4) for p in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    j = torch.arange(4)
    assert g.entry_rope_position(j, 8, 4, "block_start").tolist() == [0, 4, 8, 12]
    assert g.entry_rope_position(j, 8, 4, "window_end").tolist() == [3, 7, 11, 15]
    assert g.entry_rope_position(j, 8, 4, "window_start").tolist() == [0, 0, 4, 8]


@pytest.mark.parametrize("window, stride", GEOMETRIES)
@pytest.mark.parametrize("local", [0, 1, 5, "tail"])
def test_cache_keeps_exactly_what_future_queries_need(window, stride, local):
    for n in range(0, 25):
        future = range(n, n + 3 * window + 20)
        # positions before n that some future query holds as exact keys
        local_need = {
            p
            for t in future
            for p in range(n)
            if (p >= ((t + 1) // stride) * stride if local == "tail" else t - local + 1 <= p)
        }
        assert g.local_keep(n, local, stride) == len(local_need)
        pending_need = {
            p for p in range(n) for j in range(n // stride, n // stride + 3) if brute_covers(j, p, window, stride)
        }
        assert g.pending_keep(n, window, stride) == len(pending_need)


def _names_a_stride(node: ast.expr) -> bool:
    """``S``, ``stride``, ``<x>.stride``, ``model_stride``, ``r["stride"]``: an expression that reads a stride."""
    if isinstance(node, ast.Name):
        return node.id == "S" or node.id.endswith("stride")
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("stride")
    return isinstance(node, ast.Subscript) and str(getattr(node.slice, "value", "")).endswith("stride")


def _truth_tests(tree: ast.AST) -> set[int]:
    """The ids of the expressions used as truth values: ``if n % stride:`` is a divisibility check, not a phase."""
    tests: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests.add(id(n.test))
        elif isinstance(n, ast.comprehension):
            tests.update(id(t) for t in n.ifs)
        elif isinstance(n, ast.BoolOp):
            tests.update(id(v) for v in n.values)
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            tests.add(id(n.operand))
    return tests


def test_only_the_geometry_computes_the_phase_of_a_position():
    """The phase of a position (``position mod stride``) has one owner, ``geometry.phase``: no other module of
    ``src/ckv`` takes a value mod a stride (a divisibility check, a modulo used as a truth value, is not a phase)."""
    src = Path(g.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        if path == Path(g.__file__):
            continue
        tree = ast.parse(path.read_text())
        tests = _truth_tests(tree)
        found += [
            f"{path.relative_to(src)}:{n.lineno}: {ast.unparse(n)}"
            for n in ast.walk(tree)
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and _names_a_stride(n.right)
            if id(n) not in tests
        ]
    assert not found, f"phase arithmetic outside ckv.geometry (use geometry.phase): {found}"
