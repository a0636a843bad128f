"""The import layers of ckv (docs/architecture.md): every import in ``src/ckv`` and ``kernels/`` — top-level,
inside functions, under ``TYPE_CHECKING`` or through ``importlib.import_module("...")`` — points down or sideways.

    L0  model    ckv (package), ckv.checks, ckv.config, ckv.options.*, ckv.device, ckv.geometry, ckv.norm,
                 ckv.model, ckv.cache, ckv.flops, ckv.loss, ckv.checkpointing, ckv.attention.*
    L0k kernels  ckv_kernels.*: imports nothing from ckv; only ckv.attention.* imports it
    L1  ckv.io.*      L2 ckv.data.*      L3 ckv.train.* | ckv.eval.* (neither imports the other)
    L4  ckv.analysis.*                   L5 ckv.apps.*, ckv.plan

Within L0, ``ckv.options.*`` does not import ``ckv.config``: an option group checks plain values (strides, layer
and head counts, ``Dims``), never the config that holds it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"ckv": REPO / "src" / "ckv", "ckv_kernels": REPO / "kernels" / "ckv_kernels"}
MODEL_LAYER = {
    "ckv",
    "ckv.checks",
    "ckv.config",
    "ckv.device",
    "ckv.geometry",
    "ckv.norm",
    "ckv.model",
    "ckv.cache",
    "ckv.flops",
    "ckv.loss",
    "ckv.checkpointing",
}
APPS = {"ckv.plan"}  # python -m ckv.plan composes Hydra configs like train.py
PACKAGE_LAYERS = {
    "ckv.options": 0,
    "ckv.attention": 0,
    "ckv.io": 1,
    "ckv.data": 2,
    "ckv.train": 3,
    "ckv.eval": 3,
    "ckv.analysis": 4,
    "ckv.apps": 5,
}
KERNELS = "ckv_kernels"


def module_name(path: Path) -> str:
    for top, root in ROOTS.items():
        if path.is_relative_to(root):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def source_files() -> list[Path]:
    return sorted(p for root in ROOTS.values() for p in root.rglob("*.py"))


MODULES = {module_name(p) for p in source_files()}


def layer(module: str) -> Optional[tuple[int, str]]:
    """``(layer, group)`` of a ckv module (the group tells train from eval in L3); ``None`` for other packages."""
    top = module.split(".")[0]
    if top == KERNELS:
        return 0, KERNELS
    if top != "ckv":
        return None
    if module in MODEL_LAYER:
        return 0, "model"
    if module in APPS:
        return PACKAGE_LAYERS["ckv.apps"], "ckv.apps"
    package = ".".join(module.split(".")[:2])
    if package not in PACKAGE_LAYERS:
        raise AssertionError(f"{module} is in no layer of this test's table: add it (and to docs/architecture.md)")
    return PACKAGE_LAYERS[package], package


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, relative ones resolved; ``from pkg import sub`` names the
    submodule when ``pkg.sub`` is one."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in MODULES else target
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if (
                called == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                yield node.lineno, node.args[0].value


def violation(source: str, target: str) -> Optional[str]:
    """Why the edge ``source -> target`` breaks the layers, or ``None``."""
    to = layer(target)
    if to is None or target == source:
        return None
    frm = layer(source)
    assert frm is not None
    if frm[1] == KERNELS:
        return None if to[1] == KERNELS else "ckv_kernels imports nothing from ckv"
    if to[1] == KERNELS:
        return None if source.startswith("ckv.attention") else "only ckv.attention may import ckv_kernels"
    if to[0] > frm[0]:
        return f"L{frm[0]} may not import L{to[0]}"
    if to[0] == frm[0] == 3 and to[1] != frm[1]:
        return "ckv.train and ckv.eval may not import each other"
    if source.startswith("ckv.options") and target == "ckv.config":
        return "option groups check plain values, not the config that holds them"
    return None


def test_the_table_covers_every_module() -> None:
    for module in MODULES:  # layer() raises naming a ckv module the table does not place
        assert layer(module) is not None, module


def test_the_rules() -> None:
    assert violation("ckv.eval.models", "ckv.train.config") is not None
    assert violation("ckv.io.weights", "ckv.data") is not None
    assert violation("ckv_kernels.attention", "ckv.geometry") is not None
    assert violation("ckv.model", "ckv_kernels") is not None
    assert violation("ckv.attention.dispatch", "ckv_kernels") is None
    assert violation("ckv.apps.demo", "ckv.analysis.gates") is None
    assert violation("ckv.train.loop", "ckv.train.engine") is None
    assert violation("ckv.io.hf", "transformers") is None
    assert violation("ckv.options.grid", "ckv.config") is not None
    assert violation("ckv.config", "ckv.options.grid") is None


def test_imports_follow_the_layers() -> None:
    edges: dict[str, None] = {}  # in order, once per line and target
    for path in source_files():
        source = module_name(path)
        for line, target in imports(path):
            why = violation(source, target)
            if why:
                edges[f"{path.relative_to(REPO)}:{line}: {source} -> {target} ({why})"] = None
    assert not edges, "imports against the layer order:\n" + "\n".join(edges)


def test_no_test_module_imports_another() -> None:
    """What test modules share lives in ``tests/helpers.py``, a package's ``helpers.py`` or a conftest fixture
    (docs/architecture.md): no test module imports from a ``test_*`` module."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        package = list(path.relative_to(REPO).parent.parts)  # ["tests", "eval"]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                names = [".".join(base + [node.module or "", a.name]) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = [p for p in name.split(".") if p]
                if parts[0] == "tests" and any(p.startswith("test_") for p in parts):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not found, "test modules importing test modules:\n" + "\n".join(found)
