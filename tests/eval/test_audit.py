"""Audit mode on a tiny random Qwen3 built from a config (nothing downloaded), with a word-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from ckv.config import ConfigError
from ckv.eval import LookupSpec, ProbeSpec, RunOptions, StatsOptions, evaluate, load_hf_model, task_from_dict
from ckv.eval.runner import build_task

from .helpers import png_ok

TASKS = Path(__file__).resolve().parents[2] / "conf" / "eval" / "task"
FAST = StatsOptions(n_bootstrap=50, n_permutations=50)
EXTRA_WORDS = ["pad", ":", "def", "return", "filler", "8", "32", "x"]


def _task_config(name: str) -> dict:
    return yaml.safe_load((TASKS / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = _task_config("lookup_words")["vocab"]
    vocab = {w: i for i, w in enumerate(["[UNK]", *words["keys"], *words["values"], *EXTRA_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("qwen3")
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def test_shipped_word_lookup_runs_on_a_tiny_random_qwen3(hf_dir: Path, tmp_path: Path) -> None:
    cfg = _task_config("lookup_words")
    cfg["vocab"].update(pad="pad", separator=":")  # the word-level tokenizer has no newline token
    model = load_hf_model(hf_dir, device="cpu", stride=4)
    results, out = evaluate(model, task_from_dict(cfg), RunOptions(limit=2, progress=False, stats=FAST,
                                                                   out_dir=str(tmp_path / "audit")))
    r = results["results"]
    assert r["n_prompts"] == 2 * 24 and r["stride"] == 4 and r["spec"]["n_records"] == 64
    assert results["model"]["kind"] == "hf" and results["model"]["architecture"] == "Qwen3ForCausalLM"
    assert 0.0 <= r["headline"]["mean"] <= 1.0
    assert json.loads((out / "results.json").read_text())["results"]["modulus"] == 24
    assert png_ok(out / "lookup_words.png")


def test_word_that_is_not_one_token_is_an_error(hf_dir: Path) -> None:
    model = load_hf_model(hf_dir, device="cpu")
    spec = LookupSpec(n_records=4, modulus=4, vocab=dict(source="words", keys=["cat", "sea lion", "zebra", "dog"],
                                                           values=["Alice", "Bob", "Carol", "David"], pad="pad"))
    with pytest.raises(ConfigError, match=r"2 of 4 words are not single tokens.*' sea lion' -> 2 tokens.*' zebra' -> the unknown token"):
        build_task(spec, model)


def test_text_probe_runs_and_groups_by_phase(hf_dir: Path, tmp_path: Path) -> None:
    model = load_hf_model(hf_dir, device="cpu")
    spec = ProbeSpec(name="probe_tiny", template="def x : {filler} return", unit=" filler", candidates=("8", "32"),
                     lengths=(4, 15), stride=4)
    results, out = evaluate(model, spec, RunOptions(progress=False, out_dir=str(tmp_path / "probe")))
    r = results["results"]
    assert [row["filler_tokens"] for row in r["lengths"]] == list(range(4, 16))
    assert [row["filler_text"] for row in r["lengths"]] == [" filler" * n for n in range(4, 16)]
    assert [row["phase"] for row in r["lengths"]] == [n % 4 for n in range(4, 16)]
    logp = np.array([[row["logp[8]"], row["logp[32]"]] for row in r["lengths"]])
    assert np.all(logp < 0) and len(r["phases"]) == 4
    assert png_ok(out / "probe_tiny.png")
    lines = (out / "results.csv").read_text().splitlines()
    assert len(lines) == 13 and "logp[8]" in lines[0] and "top1_token" in lines[0]


def test_shipped_fp8_probe_config_parses(hf_dir: Path) -> None:
    spec = task_from_dict(_task_config("probe_fp8"))
    assert isinstance(spec, ProbeSpec) and spec.lengths == (24, 39) and spec.stride == 4
    assert spec.unit == "=" and spec.candidates == ("8", "32")
    # a word-level tokenizer makes any run of "=" one token: no filler of 24 tokens exists, and that is an error
    with pytest.raises(ConfigError, match=r"task.unit='=': no repeat of it tokenises to exactly \[24, 25"):
        build_task(spec, load_hf_model(hf_dir, device="cpu"))
