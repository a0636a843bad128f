"""eval.py end to end through Hydra as from a shell: in this process (``run_script``: its Hydra main with ``sys.argv``
set), and in a fresh interpreter for the smoke run's evaluation (the last test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import eval_cli, run_script

from .helpers import make_run, png_ok

ROOT = Path(__file__).resolve().parents[2]
FAST = ["progress=false", "stats.n_bootstrap=50", "stats.n_permutations=50", "device=cpu"]


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *args, *FAST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_run_then_summary(tmp_path: Path, monkeypatch, capsys) -> None:
    sweep = tmp_path / "sweep"
    gate = make_run(sweep, attention=dict(kind="compressed", window=4, stride=4, local_window=4), name="gate,seed=0")
    make_run(sweep, attention=dict(kind="full"), name="full,seed=0")
    args = [f"model.path={gate}", "task.modulus=8", "limit=4", *FAST]  # pasted verbatim: the name holds ',' and '='
    code, out, err = run_script("eval.py", args, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    results = json.loads((gate / "eval" / "lookup" / "results.json").read_text())
    assert results["results"]["n_prompts"] == 32 and '"phase_gap"' in out
    # the summary evaluates the run that has no results yet, with the same task settings
    args = [f"summary='{sweep}'", "task.modulus=8", "task.stride=4", "limit=4", *FAST]  # quoted by hand: kept as is
    code, _, err = run_script("eval.py", args, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    summary = json.loads((sweep / "summary" / "lookup" / "summary.json").read_text())
    assert sorted(r["run"] for r in summary["runs"]) == ["full,seed=0", "gate,seed=0"]
    assert png_ok(sweep / "summary" / "lookup" / "summary_grid.png")


@pytest.mark.slow
def test_bad_input_fails_with_a_clear_message(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=dict(kind="compressed", window=4, stride=4, local_window=4))
    p = _eval(f"model.path={run}", "task.modulus=2")
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("ckv: error: task.modulus=2 is smaller than the stride 4")


def test_configuration_errors_are_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    """Hydra's composition and override errors, a key eval.py does not read and a missing model folder, each as one
    ``ckv: error:`` line (an unknown key is never answered with a ``+key`` hint). eval.py runs in this process
    (``run_script``); tests/eval/test_bad_inputs.py runs a bad setting in a fresh interpreter."""
    missing = tmp_path / "runs" / "demo" / "seed=0"
    tasks = sorted(p.stem for p in (ROOT / "conf" / "eval" / "task").glob("*.yaml"))  # Hydra's choices
    cases = {
        "nosuch=1": "ckv: error: nosuch is not a setting (Key 'nosuch' is not in struct); check its spelling",
        "+limt=4": "ckv: error: unknown eval field(s) ['limt']; valid fields: ['analysis', 'batch_size', 'device', "
        "'dry_run', 'limit', 'mitigation', 'model', 'out_dir', 'plots', 'progress', 'stats', 'summary', 'summary_out', "
        "'summary_rerun', 'task']",  # composed in, then refused: never a full evaluation that ignores it
        "task=nosuch": f"ckv: error: In 'config': Could not find 'task/nosuch'; choose one of {tasks}",
        f"model.path={missing}": f"ckv: error: model.path={str(missing)!r} does not exist",
    }
    for override, line in cases.items():
        code, _, err = run_script("eval.py", [override, *FAST], monkeypatch, capsys)
        assert (code, err.splitlines()) == (2, [line]), override


def test_path_values_are_quoted_for_hydra() -> None:
    quote = eval_cli().quote_path_values
    assert quote(["model.path=/r/a=1,seed=0", "summary=/s", "out_dir=o", "+model.tokenizer=t"]) == [
        "model.path='/r/a=1,seed=0'",
        "summary='/s'",
        "out_dir='o'",
        "+model.tokenizer='t'",
    ]
    kept = [
        "model.path='/r/seed=0'",
        'summary="/s"',
        "summary=[/a,/b]",
        "model.path=null",
        "model.path=",
        "task.name=a=b",
        "limit=4",
        "-m",
    ]
    assert quote(kept) == kept
    assert quote(["model.path=/it's"]) == ['model.path="/it\'s"']


@pytest.mark.slow
def test_audit_mode_cli(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {
        w: i for i, w in enumerate(["[UNK]", "pad", ":", *[f"k{i}" for i in range(20)], *[f"v{i}" for i in range(20)]])
    }
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = transformers.Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "hf")
    p = _eval(
        "model=hf",
        f"model.path={tmp_path / 'hf'}",
        "model.stride=4",
        "task=lookup_ids",
        "task.modulus=8",
        "task.n_records=12",
        "task.n_demos=3",
        "task.vocab.keys=[3,23]",
        "task.vocab.values=[23,43]",
        "task.vocab.pad=1",
        "task.vocab.separator=[2]",
        "limit=2",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert png_ok(tmp_path / "hf" / "eval" / "lookup_ids" / "lookup_ids.png")


@pytest.mark.smoke
def test_default_evaluation_of_a_text_trained_run(cpu_smoke_run) -> None:
    """A new user's path: ``train.py experiment=cpu_smoke`` (CI's smoke run, tests/conftest.py), then ``eval.py
    model.path=`` followed by the run folder exactly as train.py printed it (it holds '=' and ','); the default task
    draws single-token keys and values from the run's own tokenizer and names them."""
    train = cpu_smoke_run
    assert train.returncode == 0, train.stderr[-3000:]
    first = next(line for line in train.stderr.splitlines() if line.startswith("ckv: "))  # after wandb's lines
    printed = first.removeprefix("ckv: ").split(" | ")[0]  # "ckv: <run folder> | ..."
    assert "=" in printed and Path(printed).is_dir()
    p = _eval(f"model.path={printed}", "limit=2")
    assert p.returncode == 0, p.stderr[-3000:]
    out = Path(printed) / "eval" / "lookup"
    r = json.loads((out / "results.json").read_text())["results"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(printed) / "model" / "tokenizer.json"))
    codec = r["codec"]
    assert codec["drawn_from"] == "the model's tokenizer" and len(codec["keys"]) == len(codec["values"]) == 64
    assert all(len(tok.encode(w, add_special_tokens=False).ids) == 1 for w in codec["keys"] + codec["values"])
    assert r["n_prompts"] == 2 * 24 and r["stride"] == 4 and r["headline"]["residue_gap"] is not None
    assert png_ok(out / "lookup.png")
