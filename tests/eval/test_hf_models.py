"""Audit mode (``ckv.eval.hf_models``) on a tiny random Qwen3 and a tiny random DeepSeek-V4 (CSA layers) built
from configs (nothing downloaded), with a word-level tokenizer saved as a PreTrainedTokenizerFast."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ckv.config import ConfigError
from ckv.eval import LookupSpec, ProbeSpec, RunOptions, StatsOptions, evaluate, load_hf_model, task_from_dict
from ckv.eval.hf_models import HFLastLogits, device_map_for
from ckv.eval.runner import build_task

from .helpers import png_ok, save_tiny, task_config, tiny_deepseek_v4, tiny_qwen3

FAST = StatsOptions(n_bootstrap=50, n_permutations=50)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_qwen3, tmp_path_factory.mktemp("qwen3"))


def test_shipped_word_lookup_runs_on_a_tiny_random_qwen3(hf_dir: Path, tmp_path: Path) -> None:
    cfg = task_config("lookup_words")
    cfg["vocab"].update(pad="pad", separator=":")  # the word-level tokenizer has no newline token
    model = load_hf_model(hf_dir, device="cpu", stride=4)
    results, out = evaluate(
        model, task_from_dict(cfg), RunOptions(limit=2, progress=False, stats=FAST, out_dir=str(tmp_path / "audit"))
    )
    r = results["results"]
    assert r["n_prompts"] == 2 * 24 and r["stride"] == 4 and r["spec"]["n_records"] == 64
    assert results["model"]["kind"] == "hf" and results["model"]["architecture"] == "Qwen3ForCausalLM"
    assert 0.0 <= r["headline"]["mean"] <= 1.0
    assert json.loads((out / "results.json").read_text())["results"]["modulus"] == 24
    assert png_ok(out / "lookup_words.png")


def test_corrupt_weights_file_is_one_config_error(hf_dir: Path, tmp_path: Path) -> None:
    """A truncated model.safetensors in a transformers folder is a ConfigError naming the folder (eval.py: one
    line), as ckv's own weights are."""
    import shutil

    broken = Path(shutil.copytree(hf_dir, tmp_path / "broken"))
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match=f"cannot load the weights of {broken}"):
        load_hf_model(broken, device="cpu")


def test_word_that_is_not_one_token_is_an_error(hf_dir: Path) -> None:
    model = load_hf_model(hf_dir, device="cpu")
    spec = LookupSpec(
        n_records=4,
        modulus=4,
        vocab=dict(
            source="words",
            keys=["cat", "sea lion", "zebra", "dog"],
            values=["Alice", "Bob", "Carol", "David"],
            pad="pad",
        ),
    )
    with pytest.raises(
        ConfigError, match=r"2 of 4 words are not single tokens.*' sea lion' -> 2 tokens.*' zebra' -> the unknown token"
    ):
        build_task(spec, model)


def test_text_probe_runs_and_groups_by_phase(hf_dir: Path, tmp_path: Path) -> None:
    model = load_hf_model(hf_dir, device="cpu")
    spec = ProbeSpec(
        name="probe_tiny",
        template="def x : {filler} return",
        unit=" filler",
        candidates=("8", "32"),
        lengths=(4, 15),
        stride=4,
    )
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
    spec = task_from_dict(task_config("probe_fp8"))
    assert isinstance(spec, ProbeSpec) and spec.lengths == (24, 39) and spec.stride == 4
    assert spec.unit == "=" and spec.candidates == ("8", "32")
    # a word-level tokenizer makes any run of "=" one token: no filler of 24 tokens exists, and that is an error
    with pytest.raises(ConfigError, match=r"task.unit='=': no repeat of it tokenises to exactly \[24, 25"):
        build_task(spec, load_hf_model(hf_dir, device="cpu"))


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_deepseek_v4], ids=["qwen3", "deepseek_v4"])
def test_chunked_prefill_equals_one_full_forward(build) -> None:
    """Chunked prefill through the model's cache gives the full forward's last-position logits (fp32, CPU)."""
    import torch

    torch.manual_seed(0)
    model = (build(97, max_len=512, n_layers=2) if build is tiny_qwen3 else build(97, max_len=512)).eval()
    ids = torch.randint(0, 97, (2, 67))  # (B, T): T is no multiple of the chunks or V4's compression rate
    with torch.inference_mode():
        full = HFLastLogits(model)(ids)  # (B, V)
        for chunk in (1, 5, 32, 67, 512):
            torch.testing.assert_close(HFLastLogits(model, chunk)(ids), full, atol=1e-5, rtol=0)


def test_deepseek_v4_loads_and_runs_lookup_and_probe(tiny_v4: Callable[[int], Path], tmp_path: Path) -> None:
    model = load_hf_model(tiny_v4(64), device="cpu", stride=4)
    assert model.info["architecture"] == "DeepseekV4ForCausalLM" and model.max_len == 4096
    assert model.info["device_map"] is None  # CPU: one device, no device_map
    cfg = task_config("lookup_words")
    cfg["vocab"].update(pad="pad", separator=":")
    results, out = evaluate(
        model, task_from_dict(cfg), RunOptions(limit=1, progress=False, stats=FAST, out_dir=str(tmp_path / "lookup"))
    )
    assert results["results"]["n_prompts"] == 24 and 0.0 <= results["results"]["headline"]["mean"] <= 1.0
    probe = ProbeSpec(
        name="probe_v4",
        template="def x : {filler} return",
        unit=" filler",
        candidates=("8", "32"),
        lengths=(4, 7),
        stride=4,
    )
    results, out = evaluate(model, probe, RunOptions(progress=False, out_dir=str(tmp_path / "probe")))
    assert [row["phase"] for row in results["results"]["lengths"]] == [0, 1, 2, 3]


def test_one_device_without_several_gpus() -> None:
    import torch

    assert device_map_for(torch.device("cpu")) is None
    if torch.cuda.device_count() < 2:
        assert device_map_for(torch.device("cuda")) is None
