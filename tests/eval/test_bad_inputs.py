"""Every field of every task spec (each registered kind, from every shipped config), of the vocabulary, and of the
run and model options, given values of wrong types and out-of-range values. Each case is either refused by one
``ConfigError`` line that names the field, or accepted (a value of another type only when the spec stores it as its
declared type, e.g. ``[8, 32]`` as the candidates ``("8", "32")``) and then the task builds or refuses with one
``ConfigError`` line; nothing else may be raised. The cases come from the dataclasses' fields and type hints, so a
new field is covered, and a field whose type the generator cannot read fails the test. A few cases run through
``eval.py`` as subprocesses: exit code 2, one ``ckv: error:`` line, no traceback, no model needed."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import pytest
import yaml

from ckv.config import ConfigError
from ckv.data.config import DataConfig
from ckv.eval import TASKS, ModelFacts, ModelSource, RunOptions, StatsOptions, VocabSpec, build_task, task_from_dict
from ckv.eval.vocab import HFTokenizer

from .helpers import ROOT, SPLIT_LOOKUP, TOK, word_tokenizer

POOL: list[Any] = ["x", "", 1.5, True, None, -1, 0, 3, 10**6, [], [1], [3, 1], [1, 10**6], ["a", "b"], {"a": 1}]
TASK_CONFIGS = ROOT / "conf" / "eval" / "task"
# what makes a shipped config build on the stand-in models below (ids of the word-level vocabulary, a CPU context)
CHANGES = {
    "lookup_ids": {"vocab": {"keys": [1, 65], "values": [73, 137], "pad": 146, "separator": [146]}},
    "needle": {"context_tokens": 2048},
}
BASES = sorted(p.stem for p in TASK_CONFIGS.glob("*.yaml"))


def _config(base: str) -> dict:
    cfg = yaml.safe_load((TASK_CONFIGS / f"{base}.yaml").read_text())
    for key, value in CHANGES.get(base, {}).items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    return cfg


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the declared type ``hint`` (a nested dataclass: given as a mapping)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (str, list, dict):
        return isinstance(value, hint)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
        return all(matches(v, args[0]) for v in value) if args else True
    if dataclasses.is_dataclass(hint):
        return isinstance(value, (dict, hint))
    raise AssertionError(f"the bad-input generator cannot read the type {hint!r}: teach matches() about it")


@pytest.fixture(scope="module")
def models(cache_dir: str) -> dict[str, ModelFacts]:
    """Stand-ins (no weights): a word-level tokenizer, a character tokenizer that merges runs of "=" (for text
    probes), a BPE of the shipped Bible (for text probes that ask words) and a ckv run's lookup layout."""
    from ckv.data import build_batches
    from ckv.data.tokenizer import TokenizersTokenizer

    bible = build_batches(
        DataConfig.from_dict({"kind": "text", "text": {"vocab_size": 1024}}), batch_size=1, seed=0, cache_dir=cache_dir
    )
    words = HFTokenizer(word_tokenizer())
    data = DataConfig(kind="lookup", seq_len=96, lookup=dict(SPLIT_LOOKUP))
    common = dict(max_len=4096, stride=4)
    return {
        "words": ModelFacts(name="words", vocab_size=len(words.tok), tokenizer=words, kind="hf", **common),
        "chars": ModelFacts(name="chars", vocab_size=400, tokenizer=TOK, kind="hf", **common),
        "bible": ModelFacts(
            name="bible", vocab_size=bible.vocab_size, tokenizer=TokenizersTokenizer(bible.source.tok), **common
        ),
        "layout": ModelFacts(
            name="layout",
            vocab_size=data.lookup.format(0).vocab_size,
            lookup=data.lookup,
            lookup_format=data.lookup.format(0),
            **common,
        ),
    }


def _model(cfg: dict, models: dict) -> ModelFacts:
    """The stand-in a shipped config builds on: a text probe on characters, or on the Bible's BPE when its
    candidates are words (a leading space, which every candidate would share as its first character)."""
    if cfg.get("source") == "text":
        return models["bible" if any(c.startswith(" ") for c in cfg.get("candidates", [])) else "chars"]
    return models["layout" if cfg.get("vocab", {}).get("source") == "format" else "words"]


def outcome(cfg: dict, model: ModelFacts) -> tuple[str, Optional[str]]:
    """``("parse", message)`` when the spec refuses ``cfg``, ``("build", message)`` when the task refuses to build
    on ``model``, ``("ok", None)`` else; any other exception propagates (the test fails on it)."""
    try:
        spec = task_from_dict(copy.deepcopy(cfg))
    except ConfigError as e:
        return "parse", str(e)
    try:
        build_task(spec, model, limit=1)
    except ConfigError as e:
        return "build", str(e)
    return "ok", None


def _check_refused(label: str, cfg: dict, model: ModelFacts, field: str, value: Any, hint: Any, stored: Any) -> None:
    stage, message = outcome(cfg, model)
    if message is not None:
        assert "\n" not in message and message.strip(), f"{label}: not one line: {message!r}"
    if stage == "parse":
        assert field in message, f"{label}: the error does not name {field}: {message}"
    elif not matches(value, hint):
        assert matches(stored(), hint), f"{label}={value!r} of the wrong type was accepted as {stored()!r}"
    if stage == "build":
        assert "task." in message or "vocab" in message, f"{label}: the error names no setting: {message}"


def test_every_task_kind_has_a_shipped_config() -> None:
    assert {_config(base)["kind"] for base in BASES} == set(TASKS)


@pytest.mark.parametrize("base", BASES)
def test_every_task_field_refuses_wrong_types_and_values_in_one_line(base: str, models: dict) -> None:
    cfg = _config(base)
    kind = TASKS[cfg["kind"]]
    model = _model(cfg, models)
    assert outcome(cfg, model) == ("ok", None), f"the shipped config {base} must build on a stand-in"
    hints = get_type_hints(kind.spec)
    for f in dataclasses.fields(kind.spec):
        for value in POOL:
            case = {**cfg, f.name: value}
            _check_refused(
                f"{base}: task.{f.name}",
                case,
                model,
                f"task.{f.name}",
                value,
                hints[f.name],
                lambda case=case, f=f: getattr(task_from_dict(copy.deepcopy(case)), f.name),
            )


@pytest.mark.parametrize("base", [b for b in BASES if "vocab" in _config(b)])
def test_every_vocabulary_field_refuses_wrong_types_and_values_in_one_line(base: str, models: dict) -> None:
    cfg = _config(base)
    hints = get_type_hints(VocabSpec)
    for f in dataclasses.fields(VocabSpec):
        for value in POOL:
            case = {**cfg, "vocab": {**cfg["vocab"], f.name: value}}
            _check_refused(
                f"{base}: task.vocab.{f.name}",
                case,
                _model(cfg, models),
                f"task.vocab.{f.name}",
                value,
                hints[f.name],
                lambda case=case, f=f: getattr(task_from_dict(copy.deepcopy(case)).vocab, f.name),
            )


def _stats(**kw: Any) -> StatsOptions:
    return RunOptions(stats=kw).stats


@pytest.mark.parametrize(
    "make,cls,prefix",
    [(RunOptions, RunOptions, ""), (ModelSource, ModelSource, "model."), (_stats, StatsOptions, "stats.")],
    ids=["run", "model", "stats"],
)
def test_run_and_model_options_refuse_wrong_types_in_one_line(make: Any, cls: type, prefix: str) -> None:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for value in POOL:
            try:
                stored = getattr(make(**{f.name: value}), f.name)
            except ConfigError as e:
                assert f"{prefix}{f.name}" in str(e) and "\n" not in str(e), (f.name, value, str(e))
                continue
            assert matches(stored, hints[f.name]), f"{prefix}{f.name}={value!r} was accepted as {stored!r}"


@pytest.mark.parametrize(
    "override,line",
    [
        ("task.vocab.separator=1.5", "ckv: error: task.vocab.separator=1.5 is not allowed; give a string, an id"),
        pytest.param(
            "task.prefill_chunk=big",
            "ckv: error: task.prefill_chunk='big' must be an integer >= 1 or 'auto'",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_eval_py_reports_a_bad_task_setting_in_one_line(override: str, line: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "model=hf", "model.path=/nonexistent", "task=needle", override],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr[-2000:]
    assert p.stderr.startswith(line) and "Traceback" not in p.stdout + p.stderr
    assert Path("/nonexistent").exists() is False  # refused before any model is looked for
