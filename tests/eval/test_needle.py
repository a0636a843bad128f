"""The needle test (``task=needle``): its design, chunked prefill for ckv models, and eval.py on tiny HF models."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ckv.config import ConfigError
from ckv.data.lookup import LookupFormat
from ckv.eval import RunOptions, StatsOptions, evaluate, load_ckv_model, task_from_dict
from ckv.eval.codec import TokenCodec
from ckv.eval.models import CkvLastLogits
from ckv.eval.needle import NeedleSpec, NeedleTask, depth_levels
from ckv.eval.scoring import CkvChunkedLastLogits
from ckv.model import Transformer
from ckv.train.config import ModelSpec
from tests.helpers import run_script

from .helpers import make_run, png_ok, save_tiny, tiny_qwen3, word_tokenizer

FAST = StatsOptions(n_bootstrap=50, n_permutations=50)
KEYS, VALUES, PAD, SEP = tuple(range(10, 30)), tuple(range(100, 120)), 5, 6  # 20**3 = 8000 three-token keys


def _task(**kw) -> NeedleTask:
    spec = NeedleSpec(**{"context_tokens": 2048, "prompts_per_residue": 64, **kw})
    return NeedleTask(spec, TokenCodec(key_ids=KEYS, value_ids=VALUES, pad_id=PAD, separator=[SEP]), max_len=4096)


def _records(prompt: np.ndarray) -> dict[tuple, tuple[int, int]]:
    """Parse a haystack: ``{key tokens: (record start, value token)}``; asserts every record has 4 tokens."""
    out: dict[tuple, tuple[int, int]] = {}
    values = np.flatnonzero(np.isin(prompt[:-4], VALUES))
    for v in values:
        key = tuple(prompt[v - 3 : v].tolist())
        assert all(k in KEYS for k in key), f"record at {v - 3} is not 3 key tokens + 1 value token"
        assert key not in out, f"key {key} occurs twice"  # distinct keys within a prompt
        out[key] = (int(v - 3), int(prompt[v]))
    return out


def test_defaults_are_the_papers_128k_setting() -> None:
    spec = NeedleSpec()
    assert (spec.context_tokens, spec.record_len, spec.modulus, spec.prompts_per_residue) == (131072, 4, 8, 256)
    assert spec.records == 131072 // 8 == 16384  # records fill half the haystack: "about 16,000"


def test_design_residues_moments_records_and_distinct_keys() -> None:
    task = _task()
    t, m = task.table, 8
    assert task.n_records == 2048 // 8 and task.codec.record_len == 4 and len(task.prompts) == 64 * m
    # every residue mod 8 gets prompts_per_residue prompts; every base example one prompt per residue
    assert np.bincount(t["residue"], minlength=m).tolist() == [64] * m
    assert all(sorted(t["residue"][t["base"] == i]) == list(range(m)) for i in range(64))
    moments = task.position_moments()
    means, variances = [r["mean"] for r in moments], [r["var"] for r in moments]
    np.testing.assert_allclose(means, means[0], rtol=0, atol=1e-9)  # 64 = 8**2: both moments exactly equal
    np.testing.assert_allclose(variances, variances[0], rtol=0, atol=1e-6)
    haystack = task.haystack
    assert t["target_position"].min() < 0.1 * haystack and t["target_position"].max() > 0.9 * haystack  # all depths
    for j in (0, 1, 7, 100, 511):
        prompt = task.prompts[j]
        records = _records(prompt)
        assert len(prompt) == 2048 and len(records) == task.n_records
        question = tuple(prompt[-3:].tolist())
        start, value = records[question]  # the question asks exactly one record: the target
        assert start == t["target_position"][j] and start % m == t["residue"][j]
        assert value == t["answer_id"][j] and prompt[-4] == SEP


def test_limit_keeps_the_first_base_examples_and_spreads_depths() -> None:
    full, short = _task(), _task(prompts_per_residue=64)
    short = NeedleTask(short.spec, short.codec.base, max_len=4096, limit=8)
    assert len(short.prompts) == 64
    np.testing.assert_array_equal(short.table["target_position"], full.table["target_position"][:64])
    np.testing.assert_array_equal(short.prompts[5], full.prompts[5])
    levels = depth_levels(256, 8, 100)
    assert len(set(levels[:64].tolist())) == 8 and levels.max() == 99  # the first block already spans the depths


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="context_tokens=2048 exceeds the model's context of 1024"):
        NeedleTask(
            NeedleSpec(context_tokens=2048), TokenCodec(key_ids=KEYS, value_ids=VALUES, pad_id=PAD), max_len=1024
        )
    with pytest.raises(ConfigError, match="leave .* filler tokens"):
        _task(n_records=511)
    with pytest.raises(ConfigError, match="distinct keys"):
        NeedleTask(
            NeedleSpec(context_tokens=2048, record_len=2),
            TokenCodec(key_ids=KEYS, value_ids=VALUES, pad_id=PAD),
            max_len=4096,
        )
    with pytest.raises(ConfigError, match="records of 2 tokens; set task.record_len=2"):
        NeedleTask(NeedleSpec(context_tokens=128), LookupFormat(n_keys=64, n_values=16), max_len=4096)
    with pytest.raises(ConfigError, match="prefill_chunk=0 must be an integer >= 1"):
        NeedleSpec(prefill_chunk=0)


@pytest.mark.parametrize(
    "attention",
    [
        dict(kind="full"),
        dict(kind="compressed", window=8, stride=4, local_window=4),
        dict(kind="compressed", window=4, stride=4, local_window=4),
    ],
    ids=["full", "w8s4", "w4s4"],
)
def test_ckv_chunked_prefill_equals_one_full_forward(attention: dict) -> None:
    torch.manual_seed(0)
    cfg = ModelSpec(
        preset="tiny",
        overrides=dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=32, max_seq_len=256),
    ).build(attention, 50)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 50, (2, 67))  # (B, T): T is no multiple of the chunks or the stride
    with torch.inference_mode():
        full = CkvLastLogits(model)(ids)  # (B, V)
        for chunk in (1, 5, 32, 67, 256):
            torch.testing.assert_close(CkvChunkedLastLogits(model, chunk)(ids), full, atol=1e-5, rtol=0)


def test_needle_on_a_ckv_run_with_a_four_token_layout(tmp_path: Path) -> None:
    lookup = dict(
        record="kkvv", n_keys=64, n_values=16, n_filler=1, n_records=8, n_queries=2, filler=[0, 1], prefix_pad=[0, 7]
    )
    run = make_run(tmp_path, attention=dict(kind="compressed", window=4, stride=4, local_window=4), lookup=lookup)
    model = load_ckv_model(run, device="cpu")
    spec = task_from_dict(dict(kind="needle", context_tokens=128, prompts_per_residue=64, prefill_chunk=32))
    results, out = evaluate(model, spec, RunOptions(limit=2, progress=False, stats=FAST, out_dir=str(tmp_path / "n")))
    r = results["results"]
    assert r["task"] == "needle" and r["n_prompts"] == 16 and r["stride"] == 4 and r["spec"]["n_records"] == 16
    assert r["codec"]["record"] == "kkvv" and [g["n"] for g in r["residue"]["groups"]] == [2] * 8
    assert png_ok(out / "needle.png") and len((out / "results.csv").read_text().splitlines()) == 17


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory, tiny_v4: Callable[[int], Path]) -> dict[str, Path]:
    return {"qwen3": save_tiny(tiny_qwen3, tmp_path_factory.mktemp("qwen3"), max_len=4096), "deepseek_v4": tiny_v4(64)}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v4"])
def test_eval_py_runs_the_needle_on_a_tiny_hf_model(
    hf_models: dict[str, Path], name: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    tok = word_tokenizer()
    ids = tok.convert_tokens_to_ids
    keys, values = [ids("cat"), ids("cat") + 20], [ids("Alice"), ids("Alice") + 20]  # 20 animals, 20 names
    out = tmp_path / "needle"
    args = [
        "model=hf",
        f"model.path={hf_models[name]}",
        "model.stride=4",
        "task=needle",
        "task.context_tokens=2048",
        "task.prefill_chunk=512",
        "task.chunk_check=0",  # the check's full forwards: tests/eval/test_chunking.py
        "task.vocab.source=ids",
        f"task.vocab.keys=[{keys[0]},{keys[1]}]",
        f"task.vocab.values=[{values[0]},{values[1]}]",
        f"task.vocab.pad={ids('pad')}",
        f"task.vocab.separator=[{ids(':')}]",
        "task.vocab.bos=null",
        "limit=1",
        "batch_size=8",
        f"out_dir={out}",
        "progress=false",
        "stats.n_bootstrap=50",
        "stats.n_permutations=50",
        "device=cpu",
    ]
    code, _, err = run_script("eval.py", args, monkeypatch, capsys)  # in this process: no interpreter start
    assert code == 0, err[-3000:]
    results = json.loads((out / "results.json").read_text())
    r = results["results"]
    assert (
        results["model"]["architecture"] == {"qwen3": "Qwen3ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM"}[name]
    )
    assert r["task"] == "needle" and r["n_prompts"] == 8 and r["modulus"] == 8 and r["stride"] == 4
    assert r["design"]["prompt_length"] == [2048, 2048] and r["design"]["record_len"] == 4
    assert r["spec"]["n_records"] == 256 and [g["n"] for g in r["residue"]["groups"]] == [1] * 8
    assert 0.0 <= r["headline"]["mean"] <= 1.0 and "residue_gap" in r["headline"]
