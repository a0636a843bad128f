"""Audit mode (``ckv.eval.hf_models``) on a tiny random Qwen3 and a tiny random DeepSeek-V4 (CSA layers) built
from configs (nothing downloaded), with a word-level tokenizer saved as a PreTrainedTokenizerFast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import yaml

from ckv.config import ConfigError
from ckv.eval import LookupSpec, ProbeSpec, RunOptions, StatsOptions, evaluate, load_hf_model, task_from_dict
from ckv.eval.hf_models import HFLastLogits, device_map_for
from ckv.eval.runner import build_task

from .helpers import png_ok

TASKS = Path(__file__).resolve().parents[2] / "conf" / "eval" / "task"
FAST = StatsOptions(n_bootstrap=50, n_permutations=50)
EXTRA_WORDS = ["pad", ":", "def", "return", "filler", "8", "32", "x"]


def _task_config(name: str) -> dict:
    return yaml.safe_load((TASKS / f"{name}.yaml").read_text())


def word_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A word-level tokenizer over the shipped animal/name lists and a few extra words."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = _task_config("lookup_words")["vocab"]
    vocab = {w: i for i, w in enumerate(["[UNK]", *words["keys"], *words["values"], *EXTRA_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def tiny_qwen3(vocab_size: int, max_len: int = 512, n_layers: int = 1):  # -> transformers.Qwen3ForCausalLM
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    return transformers.Qwen3ForCausalLM(cfg)


def tiny_deepseek_v4(vocab_size: int, max_len: int = 4096, index_topk: int = 64):  # -> DeepseekV4ForCausalLM
    """2 CSA layers, hidden 128, 4 heads, 1 KV head, head_dim 64 (8 RoPE dims), sliding window 4, index_topk 64
    (every entry of a prompt up to 259 tokens selected; fewer binds), a small MoE, hc_mult 1 (a config that trains
    on CPU: conf/hf/deepseek_v4_demo.yaml)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM")
    cfg = transformers.DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        q_lora_rank=64,
        o_lora_rank=64,
        o_groups=2,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        sliding_window=4,
        index_topk=index_topk,
        index_n_heads=2,
        index_head_dim=32,
        hc_mult=1,
        layer_types=["compressed_sparse_attention"] * 2,
        mlp_layer_types=["moe", "moe"],
        max_position_embeddings=max_len,
        partial_rotary_factor=8 / 64,
        num_nextn_predict_layers=0,
        initializer_range=0.05,
    )
    return transformers.DeepseekV4ForCausalLM(cfg)


def save_tiny(build, out: Path, max_len: Optional[int] = None) -> Path:
    """A tiny random transformers model from ``build`` (seed 0) with the word tokenizer, saved in ``out``."""
    import torch

    fast = word_tokenizer()
    torch.manual_seed(0)
    build(len(fast), **({} if max_len is None else {"max_len": max_len})).save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_qwen3, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny DeepseekV4ForCausalLM with the word tokenizer (the text tasks' pipeline; the one trained on
    ckv's synthetic lookup is tests/apps/test_demo_v4.py's)."""
    return save_tiny(tiny_deepseek_v4, tmp_path_factory.mktemp("deepseek_v4"))


def test_shipped_word_lookup_runs_on_a_tiny_random_qwen3(hf_dir: Path, tmp_path: Path) -> None:
    cfg = _task_config("lookup_words")
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
    spec = task_from_dict(_task_config("probe_fp8"))
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


def test_deepseek_v4_loads_and_runs_lookup_and_probe(v4_dir: Path, tmp_path: Path) -> None:
    model = load_hf_model(v4_dir, device="cpu", stride=4)
    assert model.info["architecture"] == "DeepseekV4ForCausalLM" and model.max_len == 4096
    assert model.info["device_map"] is None  # CPU: one device, no device_map
    cfg = _task_config("lookup_words")
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
