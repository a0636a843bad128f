"""Auditing a local transformers model in one command: README's commands on a tiny Qwen3 saved with its own
tokenizer need no vocabulary settings; the vocabulary ckv picks is printed, saved and repeatable; a model without
a tokenizer gets one line naming the settings it needs (eval.py run in this process: tests/eval/helpers.run_eval)."""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from .helpers import ROOT, png_ok, run_eval, save_tiny, tiny_qwen3

FAST = ["device=cpu", "progress=false", "stats.n_bootstrap=50", "stats.n_permutations=50", "limit=1"]
QUICK = {"needle": ["task.context_tokens=2048"]}  # the tiny model's context is 4096 tokens, not 128K


def documented_commands(docs: tuple[str, ...] = ("README.md", "docs/evaluation.md")) -> list[list[str]]:
    """The overrides of every ``python eval.py model=hf ...`` command line of ``docs``' code blocks (continuation
    lines joined, comments dropped, a ``<placeholder>`` as one word)."""
    commands = []
    for doc in docs:
        text = re.sub(r"\\\n\s*", " ", (ROOT / doc).read_text())
        for line in text.splitlines():
            if line.startswith("python eval.py model=hf"):
                command = line.split("python eval.py", 1)[1].split("#", 1)[0].strip()
                commands.append(shlex.split(re.sub(r"<[^>]*>", "PLACEHOLDER", command)))
    return commands


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_qwen3, tmp_path_factory.mktemp("qwen3"), max_len=4096)


def _local(args: list[str], model: Path, out: Path) -> list[str]:
    """A documented command for the tiny model on this CPU: its folder, CPU-sized needle, a quick look."""
    args = [f"model.path={model}" if a.startswith("model.path=") else a for a in args]
    task = next((a.split("=", 1)[1] for a in args if a.startswith("task=")), "lookup")
    return [*args, *QUICK.get(task, []), *FAST, f"out_dir={out / task}"]


def test_the_documented_commands_parse(capsys: pytest.CaptureFixture) -> None:
    """Every documented audit command composes and passes every check that needs no model (a dry run on a folder
    that does not exist fails only on the folder)."""
    commands = documented_commands()
    assert len(commands) >= 5 and any("task=needle" in c for c in commands)
    for args in commands:
        code, _, err = run_eval([*args, "model.path=/nonexistent/model", "dry_run=true"], capsys)
        assert (code, err.strip()) == (
            2,
            "ckv: error: model.path='/nonexistent/model' is not a transformers model folder (no config.json)",
        ), args


def test_readme_commands_give_phase_tables_with_no_vocabulary_settings(
    qwen3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    readme = documented_commands(("README.md",))
    assert not any(a.startswith("task.vocab") for c in readme for a in c)  # no vocabulary settings
    tasks = {next((a.split("=")[1] for a in c if a.startswith("task=")), "lookup") for c in readme}
    assert {"lookup", "needle", "probe_synthetic"} <= tasks
    caplog.set_level(logging.INFO, logger="ckv")
    for args in readme:
        if "dry_run=true" in args or "device=cuda" in args:
            continue
        code, out, err = run_eval(_local(args, qwen3_dir, tmp_path), capsys)
        assert code == 0, (args, err)
        task = next((a.split("=")[1] for a in args if a.startswith("task=")), "lookup")
        r = json.loads((tmp_path / task / "results.json").read_text())["results"]
        if task == "probe_synthetic":
            assert [p["phase"] for p in r["phases"]] == [0] and "flips of the full-vocabulary top-1" in out
        else:
            assert [g["group"] for g in r["phase"]["groups"]] == [0, 1, 2, 3] and "phase gap" in out
            assert "accuracy per phase (mod 4, %)" in out and png_ok(tmp_path / task / f"{task}.png")
        assert r["codec"]["drawn_from"] == "the model's tokenizer" and r["codec"]["picked"]["pad"] == "':' (id 146)"
    picked = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("picked from")]
    assert picked and all("keys 64: 'cat', 'horse', 'pig', ..." in line for line in picked if "keys" in line)


def test_the_picked_vocabulary_repeats_the_run(qwen3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first = _local(["model=hf", "model.path=x", "model.stride=4", "task=lookup"], qwen3_dir, tmp_path / "a")
    assert run_eval(first, capsys)[0] == 0
    results = json.loads((tmp_path / "a" / "lookup" / "results.json").read_text())["results"]
    repeat = results["codec"]["repeat"]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(repeat)}
    assert parsed["task.vocab.source"] == "words" and parsed["task.vocab.bos"] is None
    assert parsed["task.vocab.keys"] == results["codec"]["keys"] and len(parsed["task.vocab.values"]) == 64
    second = _local(["model=hf", "model.path=x", "model.stride=4", "task=lookup", *repeat], qwen3_dir, tmp_path / "b")
    assert run_eval(second, capsys)[0] == 0
    csv = [(tmp_path / d / "lookup" / "results.csv").read_text() for d in ("a", "b")]
    assert csv[0] == csv[1]
    assert "picked" not in json.loads((tmp_path / "b" / "lookup" / "results.json").read_text())["results"]["codec"]


def test_a_model_without_a_tokenizer_is_told_which_settings_it_needs(
    qwen3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(qwen3_dir / f, bare / f)
    code, _, err = run_eval(["model=hf", f"model.path={bare}", "model.stride=4", "task=needle", *FAST], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "neither a lookup layout nor a tokenizer" in err and "task.vocab.source=ids" in err
    assert "task.vocab.pad=<id>" in err and "'task.vocab.separator=[<id>]'" in err
