"""Code outside ``ckv.attention`` reads an attention module only through its declared surface (docs/attention.md,
"The compressed layer's public surface"; issue 41).

A class's declared surface is what its class body (or a base's) declares under a public name: its methods,
properties and class variables, and the instance attributes it annotates (``indexer: Optional[LightningIndexer]``);
``nn.Module``'s own API (``parameters``, ``register_forward_hook``, ...) is every module's. An attribute that a
constructor only assigns (``self.rotary = ...``, ``self.k_compressor = ...``) is private to ``ckv.attention``.

The check follows, in every file of ``src/ckv`` outside ``ckv.attention``, of ``benchmarks/`` and the entry points,
the values whose class it can tell from the source: a block's ``.self_attn`` (an ``AttentionBackend``), what
``compressed_layers``/``build_attention`` return, names and parameters annotated with an attention class, and what
a surface attribute or method returns by its type hints (``layer.compressors()["K"].pooling`` is a ``Pooling``);
loops, comprehensions, subscripts and assignments carry the class on. Every attribute it reads on such a value must
be on the class's surface, and no file tests ``isinstance(x, <attention class>)`` (``compressed_layers`` finds the
layers, their surface the rest).
"""

from __future__ import annotations

import ast
import inspect
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from torch import nn

import ckv.attention
from ckv.attention import AttentionBackend, compressed_layers
from ckv.model import Transformer

from ..helpers import small_config

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "ckv"
SCANNED = sorted(
    [p for p in SRC.rglob("*.py") if not p.is_relative_to(SRC / "attention")]
    + list((REPO / "benchmarks").glob("*.py"))
    + [REPO / "train.py", REPO / "eval.py"]
)
# the classes of ckv.attention's modules by name (what an annotation or isinstance names)
CLASSES: dict[str, type] = {
    name: cls
    for module in ckv.attention.__dict__.values()
    if inspect.ismodule(module) and module.__name__.startswith("ckv.attention.")
    for name, cls in vars(module).items()
    if inspect.isclass(cls) and issubclass(cls, nn.Module) and cls.__module__.startswith("ckv.attention")
}
# functions whose result's class the check knows (their return annotations)
FUNCTIONS = {"compressed_layers": compressed_layers, "build_attention": ckv.attention.build_attention}


def surface(cls: type) -> set[str]:
    """The public names ``cls`` declares: class-level attributes and annotated instance attributes."""
    names = {n for c in cls.__mro__ for n in (*vars(c), *vars(c).get("__annotations__", {}))}
    return {n for n in names if not n.startswith("_")}


MODULE_API = surface(nn.Module)


def hint(cls: type, name: str) -> Any:
    """The type of ``cls().name``: its annotation, a property's return type or the method itself (a call of it
    returns its return type); None when unknown."""
    for c in cls.__mro__:
        value = vars(c).get(name)
        if isinstance(value, property):
            return typing.get_type_hints(value.fget).get("return")
        if inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)):
            return value
        annotation = vars(c).get("__annotations__", {}).get(name)
        if annotation is not None:  # evaluated in its module (``from __future__ import annotations``: a string)
            return eval(annotation, vars(sys.modules[c.__module__])) if isinstance(annotation, str) else annotation
    return None


def element(tp: Any) -> Any:
    """The class a value of type ``tp`` is (``Optional`` stripped); ``("seq", t)`` for a sequence or dict of
    ``t``; None when it is none of the attention classes."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        kept = [element(a) for a in args if a is not type(None)]
        return kept[0] if len(kept) == 1 else None
    if origin in (list, tuple, typing.Sequence, dict) and args:
        inner = element(args[-1])
        return None if inner is None else ("seq", inner)
    return tp if inspect.isclass(tp) and tp in CLASSES.values() else None


def returns(function: Any) -> Any:
    target = function.__func__ if isinstance(function, (classmethod, staticmethod)) else function
    return element(typing.get_type_hints(target).get("return"))


def annotated(node: Optional[ast.expr]) -> Any:
    """The attention class an annotation names (``Optional[X]``, ``list[X]`` and ``"X"`` included), or None."""
    if node is None:
        return None
    text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)
    names = {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}
    found = [CLASSES[n] for n in names if n in CLASSES]
    if len(found) != 1:
        return None
    return ("seq", found[0]) if any(w in text for w in ("list[", "Sequence[", "tuple[")) else found[0]


def reaches(path: Path, text: str) -> Iterator[str]:
    """``line: what`` for every read of an undeclared attribute of an attention module in ``text``, and every
    ``isinstance`` test against an attention class."""
    tree = ast.parse(text, str(path))
    bound: dict[str, Any] = {}  # name -> its class (or ("seq", class)), by assignment, loop or annotation

    def kind(node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            if node.attr == "self_attn":
                return AttentionBackend
            owner = kind(node.value)
            if inspect.isclass(owner) and node.attr in surface(owner) - MODULE_API:
                found = hint(owner, node.attr)
                return found if inspect.isfunction(found) or isinstance(found, classmethod) else element(found)
            return None
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FUNCTIONS:
                return returns(FUNCTIONS[func.id])
            if isinstance(func, ast.Attribute) and func.attr in ("values", "items") and not node.args:
                inner = kind(func.value)
                return inner if func.attr == "values" else (None if inner is None else ("items", inner[1]))
            called = kind(func)
            return returns(called) if called is not None and not inspect.isclass(called) else None
        if isinstance(node, ast.Subscript):
            inner = kind(node.value)
            return inner[1] if isinstance(inner, tuple) and inner[0] == "seq" else None
        return None

    def bind(target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            if value is not None:
                bound[target.id] = value
        elif isinstance(target, ast.Tuple) and isinstance(value, tuple) and value[0] == "items":
            bind(target.elts[-1], value[1])

    def iterated(node: ast.expr) -> Any:
        inner = kind(node)
        if isinstance(inner, tuple):
            return inner if inner[0] == "items" else inner[1]
        return None

    nodes = list(ast.walk(tree))
    for _ in range(3):  # bindings feed each other in any order of the source: settle them
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                    if annotated(getattr(arg, "annotation", None)) is not None:
                        bound[arg.arg] = annotated(arg.annotation)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                bind(node.target, annotated(node.annotation) or (node.value and kind(node.value)))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target, kind(node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                bind(node.target, iterated(node.iter))
    for node in nodes:
        if isinstance(node, ast.Attribute) and node.attr != "self_attn":
            owner = kind(node.value)
            if inspect.isclass(owner) and node.attr not in surface(owner) | MODULE_API:
                yield f"{node.lineno}: reads {owner.__name__}.{node.attr}, which its class does not declare"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) == 2 else set()
            for name in sorted(named & set(CLASSES)):
                yield f"{node.lineno}: isinstance against {name}, a class of ckv.attention"


def found_in(source: str) -> list[str]:
    return list(reaches(SRC / "analysis" / "example.py", source))


def test_the_rule() -> None:
    model = "from ckv.attention import compressed_layers\n"
    assert found_in("def f(model):\n    return model.layers[0].self_attn.q_proj.weight\n")
    assert not found_in("def f(model):\n    return model.layers[0].self_attn.rotary.inv_freq\n")
    assert found_in(model + "for layer in compressed_layers(m):\n    layer.k_compressor\n")
    assert found_in(model + "x = [l.indexer.q_proj for l in compressed_layers(m) if l.indexer is not None]\n")
    assert found_in(model + "c = compressed_layers(m)[0].compressors()['K']\nc.gate_weight\n")
    assert found_in(model + "for _, c in compressed_layers(m)[0].compressors().items():\n    c.window\n")
    assert found_in("def f(layer: 'CompressedAttention'):\n    return layer.local_window\n")
    assert found_in("from ckv.attention import Pooling\nmods = [m for m in x if isinstance(m, Pooling)]\n")
    assert not found_in(model + "for layer in compressed_layers(m):\n    layer.attend.register_forward_hook(h)\n")
    assert not found_in(model + "c = compressed_layers(m)[0].compressors()['K']\nc.pooling.register_forward_hook(h)\n")
    assert not found_in("def f(layer: CompressedAttention):\n    return layer.indexer.topk, layer.stride\n")
    assert not found_in("def f(cfg):\n    return cfg.attention.local_window, cfg.rotary\n")  # not a module


def test_declared_attributes_exist() -> None:
    """Every declared attribute is there on a built model (a declaration names a real attribute)."""
    selection = dict(topk=2, heads=2, head_dim=16)
    attention = dict(kind="compressed", window=8, stride=4, local_window=3, selection=selection)
    model = Transformer(small_config(attention))
    layer = compressed_layers(model)[0]
    built = [model.layers[0].self_attn, layer, layer.compressors()["K"], layer.indexer, layer.rotary]
    for obj in built:
        missing = {name for name in surface(type(obj)) - MODULE_API if not hasattr(obj, name)}
        assert not missing, f"{type(obj).__name__} declares {sorted(missing)}, which a built model does not have"


def test_nothing_reads_an_undeclared_attribute() -> None:
    found = [f"{path.relative_to(REPO)}:{reach}" for path in SCANNED for reach in reaches(path, path.read_text())]
    assert not found, "reads outside ckv.attention of what its classes do not declare:\n" + "\n".join(found)
