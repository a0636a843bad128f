"""The import layers of ckv (docs/architecture.md): every import in ``src/ckv`` and ``kernels/`` — top-level,
inside functions, under ``TYPE_CHECKING`` or through ``importlib.import_module("...")`` — points down or sideways.

    L0  model    ckv (package), ckv.checks, ckv.config, ckv.options.*, ckv.device, ckv.geometry, ckv.norm,
                 ckv.model, ckv.cache, ckv.flops, ckv.attention.*
    L0k kernels  ckv_kernels.*: imports nothing from ckv; only ckv.attention.* imports it
    L1  ckv.io.*      L2 ckv.data.*      L3 ckv.train.* | ckv.eval.* (neither imports the other)
    L4  ckv.analysis.*                   L5 ckv.apps.*

Within L0, ``ckv.options.*`` does not import ``ckv.config``: an option group checks plain values (strides, layer
and head counts, ``Dims``), never the config that holds it.

Private names stay in their file: in ``src/ckv``, ``kernels/ckv_kernels`` and ``benchmarks`` no file imports or
reads another file's ``_name`` (a ``_module`` is private to its package), nor a name that the other module's
``__all__``, where it declares one, does not list.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
}
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


BENCHMARKS = REPO / "benchmarks"
PRIVATE_RULE_ROOTS = (ROOTS["ckv"], ROOTS["ckv_kernels"], BENCHMARKS)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_file(module: str, importer: Path) -> Optional[Path]:
    """The file of a project module (``ckv.*``, ``ckv_kernels.*``, or a script beside a benchmarks script that
    imports it by its bare name); ``None`` for other packages."""
    if importer.is_relative_to(BENCHMARKS) and (BENCHMARKS / f"{module}.py").is_file():
        return BENCHMARKS / f"{module}.py"
    top, _, rest = module.partition(".")
    if top not in ROOTS:
        return None
    base = ROOTS[top].joinpath(*rest.split(".")) if rest else ROOTS[top]
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def declared(path: Path) -> Optional[set[str]]:
    """The names a module's ``__all__`` lists, or ``None`` when it has none."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def private_reaches(path: Path, text: str) -> Iterator[str]:
    """``line: what`` for every reach of the file at ``path`` (source ``text``) into another file's private or
    undeclared names: ``from m import _x``, ``import pkg._mod`` from outside ``pkg``, and ``alias._x`` on a name
    bound to a project module (by an import, ``importlib.import_module`` or a function of this file that loads one
    with ``module_from_spec``)."""
    tree = ast.parse(text, str(path))
    here = module_name(path) if any(path.is_relative_to(r) for r in ROOTS.values()) else f"benchmarks.{path.stem}"
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    loaders = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        and any(isinstance(n, ast.Attribute) and n.attr == "module_from_spec" for n in ast.walk(f))
    }
    bound: dict[str, Optional[Path]] = {}  # local name -> the project module it holds (its file, when known)

    def check_module(line: int, module: str) -> Iterator[str]:
        parts = module.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if is_private(part) and i and not (here == owner or here.startswith(owner + ".")):
                yield f"{line}: imports {module}, private to {owner}"

    def check_name(line: int, name: str, module: str, file: Optional[Path]) -> Iterator[str]:
        if file is None or file == path or module_file(f"{module}.{name}", path):
            return
        surface = declared(file)
        if is_private(name):
            yield f"{line}: reads {module}.{name}, private to {file.relative_to(REPO)}"
        elif surface is not None and name not in surface and not name.startswith("__"):
            yield f"{line}: reads {module}.{name}, which the __all__ of {file.relative_to(REPO)} does not list"

    names: dict[str, str] = {}  # local name -> module name, for messages
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from check_module(node.lineno, alias.name)
                bound_to = alias.name if alias.asname else alias.name.split(".")[0]
                if module_file(bound_to, path):
                    bound[alias.asname or bound_to] = module_file(bound_to, path)
                    names[alias.asname or bound_to] = bound_to
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield from check_module(node.lineno, module)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if module_file(sub, path):
                    yield from check_module(node.lineno, sub)
                    bound[alias.asname or alias.name], names[alias.asname or alias.name] = module_file(sub, path), sub
                else:
                    yield from check_name(node.lineno, alias.name, module, module_file(module, path))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1:
            func, target = node.value.func, node.targets[0]
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            args = node.value.args
            if (
                isinstance(target, ast.Name)
                and called == "import_module"
                and args
                and isinstance(args[0], ast.Constant)
            ):
                if module_file(args[0].value, path):
                    yield from check_module(node.lineno, args[0].value)
                    bound[target.id], names[target.id] = module_file(args[0].value, path), args[0].value
            elif isinstance(target, ast.Name) and called in loaders:
                bound[target.id], names[target.id] = None, f"{target.id} (loaded by {called})"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            alias = node.value.id
            if bound[alias] is None and is_private(node.attr):
                yield f"{node.lineno}: reads {names[alias]}.{node.attr}, private to the module it loads"
            yield from check_name(node.lineno, node.attr, names[alias], bound[alias])


def test_the_private_rule() -> None:
    kernels = ROOTS["ckv_kernels"]
    script = BENCHMARKS / "kernel_resources.py"
    reaches = lambda path, text: list(private_reaches(path, text))  # noqa: E731
    assert reaches(script, "import ckv_kernels.attention as A\nA._check_inputs")
    assert reaches(script, "from ckv_kernels.attention import _check_inputs")
    assert reaches(script, "import importlib\nP = importlib.import_module('ckv_kernels.pool')\nP._x")
    assert reaches(script, "from ckv_kernels._common import INTERPRET")
    assert reaches(script, "from ckv_kernels import Problem")  # not in the package's __all__
    assert reaches(script, "def load():\n    importlib.util.module_from_spec(s)\nbench = load()\nbench._f()")
    assert not reaches(script, "import ckv_kernels\nckv_kernels.INTERPRET\nfrom ckv_kernels import pool")
    assert not reaches(script, "import attention as _bench")
    assert not reaches(kernels / "attention.py", "from ckv_kernels._common import check_float")
    assert not reaches(kernels / "attention.py", "def _f(): ...\n_f()")


def test_no_private_reach_across_files() -> None:
    found = [
        f"{path.relative_to(REPO)}:{reach}"
        for root in PRIVATE_RULE_ROOTS
        for path in sorted(root.rglob("*.py"))
        for reach in private_reaches(path, path.read_text())
    ]
    assert not found, "reaches into another file's private or undeclared names:\n" + "\n".join(found)


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


def test_training_and_evaluation_load_no_corpus_library() -> None:
    """``datasets`` (with pyarrow and pandas: about as long to import as torch) loads only where a corpus is read or
    prepared, not when train.py or eval.py starts: every one-line config error and every short run pays for it."""
    code = "import sys, ckv.train, ckv.eval; print(sorted({'datasets', 'pyarrow', 'pandas'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
