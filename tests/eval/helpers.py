"""Stand-in models, tiny transformers models and their word tokenizer, and tiny run folders shared by the evaluation
tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
import yaml

from ckv import Transformer
from ckv.data.config import DataConfig
from ckv.io.weights import save_weights
from ckv.train.config import ModelSpec, TrainConfig
from tests.helpers import eval_cli

ROOT = Path(__file__).resolve().parents[2]
SPLIT_LOOKUP = dict(
    record="split", n_keys=16, n_values=16, n_filler=1, n_records=16, n_queries=8, filler=[0, 1], prefix_pad=[0, 7]
)


class ReadingOracle:
    """A model that solves ``key value`` lookups by reading the prompt: it finds the first occurrence of the
    last token (the queried key) and answers the token after it. ``wrong(position_of_key)`` can make it fail
    on purpose (e.g. at one phase). Logits are one-hot-ish over ``vocab_size``."""

    def __init__(self, vocab_size: int, wrong: Optional[Callable[[int], bool]] = None) -> None:
        self.vocab_size, self.wrong = vocab_size, wrong

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(input_ids.shape[0], self.vocab_size)  # (B, V)
        for b, row in enumerate(input_ids.tolist()):
            pos = row.index(row[-1])
            answer = row[pos + 1]
            if self.wrong is not None and self.wrong(pos):
                answer = (answer + 1) % self.vocab_size
            logits[b, answer] = 10.0
        return logits


def make_run(
    root: Path,
    *,
    attention: dict,
    lookup: Optional[dict] = None,
    name: str = "run",
    seed: int = 0,
    preset_overrides: Optional[dict] = None,
) -> Path:
    """A ckv run folder as training writes it: config.yaml and model/ (random weights of a tiny model)."""
    run = root / name
    data = DataConfig(kind="lookup", seq_len=96, lookup=dict(lookup or SPLIT_LOOKUP))
    overrides = {
        **dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=32, max_seq_len=128),
        **(preset_overrides or {}),
    }
    cfg = TrainConfig(
        run_dir=str(run),
        model=ModelSpec(preset="tiny", overrides=overrides),
        attention=attention,
        data=data,
        seed=seed,
        name=name,
    )
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    fmt = data.lookup.format(0)
    model = Transformer(cfg.model.build(attention, fmt.vocab_size))
    save_weights(model, run / "model")
    return run


def png_ok(path: Path) -> bool:
    """A non-empty PNG file."""
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def bernoulli_paired(curve: np.ndarray, n_clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Paired data: each cluster has one sample per group, correct with probability ``curve[group]``.
    Returns ``(correct, groups, clusters)``, each (n_clusters * G,)."""
    rng = np.random.default_rng(seed)
    g = len(curve)
    groups = np.tile(np.arange(g), n_clusters)
    clusters = np.repeat(np.arange(n_clusters), g)
    correct = (rng.random(len(groups)) < np.asarray(curve)[groups]).astype(np.int64)
    return correct, groups, clusters


def run_eval(args: list[str], capsys) -> tuple[int, str, str]:
    """``python eval.py <args>`` in this process: Hydra's compose over conf/eval (the overrides quoted as eval.py
    quotes them), then eval.py's own run with its error handling. Returns ``(exit code, stdout, stderr)``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    cli = eval_cli()
    code = 0
    try:
        with cli.user_errors():
            with initialize_config_dir(config_dir=str(ROOT / "conf" / "eval"), version_base="1.3"):
                cfg = compose("config", overrides=cli.quote_path_values(args))
            cli._run(OmegaConf.to_container(cfg, resolve=True))
    except SystemExit as e:
        code = int(e.code)
    out = capsys.readouterr()
    return code, out.out, out.err


RUN = 300  # ids 300..303: runs of 1..4 "=" (a BPE-like merge)


class RunMergingTokenizer:
    """Characters are tokens (id = code point), except that runs of ``=`` merge greedily into tokens of up to 4."""

    bos_id: Optional[int] = None
    unk_id: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text[i] == "=":
                j = i
                while j < len(text) and text[j] == "=" and j - i < 4:
                    j += 1
                ids.append(RUN + j - i - 1)
                i = j
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join("=" * (i - RUN + 1) if i >= RUN else chr(i) for i in ids)


TOK = RunMergingTokenizer()


TASK_DIR = ROOT / "conf" / "eval" / "task"
EXTRA_WORDS = ["pad", ":", "def", "return", "filler", "8", "32", "x"]


def task_config(name: str) -> dict:
    """The shipped task config ``conf/eval/task/<name>.yaml`` as a dict."""
    return yaml.safe_load((TASK_DIR / f"{name}.yaml").read_text())


def word_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A word-level tokenizer over the shipped animal/name lists and a few extra words."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = task_config("lookup_words")["vocab"]
    vocab = {w: i for i, w in enumerate(["[UNK]", *words["keys"], *words["values"], *EXTRA_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def tiny_qwen3(vocab_size: int, max_len: int = 512, n_layers: int = 1):  # -> transformers.Qwen3ForCausalLM
    """A random Qwen3: width 32, 2 query heads over 1 KV head of 16 dims, tied embeddings."""
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
