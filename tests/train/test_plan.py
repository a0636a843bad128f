"""ckv.train.plan: composes like train.py and prints numbers that agree with each other and with the model."""

import subprocess
import sys

import pytest
import torch

from ckv import Transformer
from ckv.attention import check_attention
from ckv.attention.indexer import WORKING_BYTES, index_working_bytes, kl_working_bytes
from ckv.config import ConfigError
from ckv.flops import PEAK_BF16_FLOPS, flops_per_token
from ckv.train.loss import logits_bytes
from ckv.train.plan import (
    GIB,
    activation_bytes_per_token,
    compose_train_config,
    format_plan,
    main,
    model_config,
    plan,
)


@pytest.fixture(scope="module")
def paper():
    return compose_train_config(["experiment=paper_base"])


def test_parameters_and_flops_match_the_model(paper):
    p = plan(paper, gpus=8, gpu_mem_gib=80, mfu=0.4, gpu="H100")
    cfg = model_config(paper)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert p["model"]["parameters"] == sum(q.numel() for q in model.parameters())
    assert (cfg.attention.kind, cfg.kv_heads, cfg.vocab_size, p["model"]["seq_len"]) == ("compressed", 1, 151936, 4096)
    assert p["flops_per_token"]["training"] == flops_per_token(cfg, 4096).training


def test_memory_by_stage_is_consistent(paper):
    gpus, mem = 8, 80.0
    p = plan(paper, gpus=gpus, gpu_mem_gib=mem, mfu=0.4, gpu="H100")
    s0, s1, s2, s3 = p["memory_by_stage"]
    n = p["model"]["parameters"]
    assert (s0["weights"], s0["grads"], s0["optimizer"]) == (2 * n, 2 * n, 12 * n)  # bf16 + fp32 Adam (ZeRO paper)
    assert s3["states"] == pytest.approx(s0["states"] / gpus)
    assert s1["optimizer"] == pytest.approx(s0["optimizer"] / gpus) and s1["grads"] == s0["grads"]
    assert s2["grads"] == pytest.approx(s0["grads"] / gpus) and s2["weights"] == s0["weights"]
    usable, T, V, micro = mem * GIB * 0.9, 4096, 151936, p["batch"]["micro_batch_size"]
    for s in (s0, s1, s2, s3):
        plain = s["plain"]
        per_seq = plain["activations"] / micro
        assert plain["logits"] == logits_bytes(micro * T, V, None)
        m, working = plain["max_micro_batch"], p["working_memory"]["per_sequence"]
        assert plain["working"] == micro * working
        assert s["states"] + m * (per_seq + working) + logits_bytes(m * T, V, None) <= usable
        assert s["states"] + (m + 1) * (per_seq + working) + logits_bytes((m + 1) * T, V, None) > usable
        lean = s["checkpointed+chunked"]
        assert lean["activations"] < plain["activations"] / 5 and lean["logits"] < plain["logits"] / 4
        assert lean["max_micro_batch"] > m
    cfg = model_config(paper)
    assert s0["plain"]["activations"] == micro * T * activation_bytes_per_token(cfg, 2, False)


def test_time_to_budget(paper):
    p = plan(paper, gpus=8, gpu_mem_gib=141, mfu=0.4, gpu="NVIDIA H200")
    tokens = 47518 * 512 * 4096
    assert p["budget"]["tokens"] == tokens
    assert p["budget"]["seconds"] == pytest.approx(tokens * p["flops_per_token"]["training"] / (8 * 989e12 * 0.4))
    half = plan(paper, gpus=16, gpu_mem_gib=141, mfu=0.4, gpu="H200")
    assert half["budget"]["seconds"] == pytest.approx(p["budget"]["seconds"] / 2)
    assert "days" in format_plan(p)


def test_bad_inputs(paper):
    with pytest.raises(ConfigError, match="peak"):
        plan(paper, gpu="TPU")
    assert plan(paper, gpu="TPU", peak=1e15)["hardware"]["peak_flops"] == 1e15
    with pytest.raises(ConfigError, match="--mfu"):
        plan(paper, mfu=1.5)
    smoke = compose_train_config(["experiment=cpu_smoke"])  # model.vocab_size=auto: only the tokenizer knows
    with pytest.raises(ConfigError, match="--vocab-size"):
        plan(smoke)
    assert plan(smoke, vocab_size=1024, peak=1e12)["model"]["vocab_size"] == 1024
    assert set(PEAK_BF16_FLOPS) >= {"H100", "H200", "A100"}


def test_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "ckv.train.plan", *"experiment=paper_base --gpus 8 --gpu-mem 141 --gpu h200".split()],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "parameters" in out and "8 x h200 (141 GiB" in out and out.count("\n") >= 9
    with pytest.raises(SystemExit) as bad:  # main() in this process: the command line above shows the wiring
        main(["experiment=cpu_smoke"])
    assert str(bad.value.code).startswith("ckv.train.plan: error:") and "--vocab-size" in str(bad.value.code)


def test_activation_estimate_is_near_what_autograd_saves():
    """Full attention (SDPA's fused CPU kernel keeps no score matrix, as the GPU kernels): the estimate lies within
    25% of the bytes of the tensors autograd saves in the blocks (unique storages, parameters excluded)."""
    from ckv.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384)
    model, T = Transformer(cfg), 256
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = model.embed_tokens(torch.randint(0, 64, (1, T))).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for block in model.layers:
            x = block(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in saved.items() if ptr not in params) / T
    assert abs(activation_bytes_per_token(cfg, 4, False) / measured - 1) < 0.25


def test_working_memory_counts_the_attention_block_the_index_scores_and_the_kl_logits():
    """DeepSeek-V4's sparse CSA at 16K tokens: the largest of its parts, each what the backend's accounting says
    (the indexer's and its loss's: one query chunk of theirs, bounded by WORKING_BYTES, not the whole sequence's);
    full attention has none; and the part lines are printed."""
    train_cfg = compose_train_config(["attention=deepseek_v4_csa_sparse", "model=tiny", "data.seq_len=16384"])
    p = plan(train_cfg, gpus=1, gpu_mem_gib=80, vocab_size=1024)
    cfg, T = model_config(train_cfg, 1024), 16384
    backend, w = check_attention(cfg), p["working_memory"]
    E, s = T // cfg.attention.stride, cfg.attention.selection
    whole_index, whole_kl = index_working_bytes(1, T, s.heads, E), kl_working_bytes(1, T, cfg.n_heads, s.heads, E)
    assert 0 < w["parts"]["index scores"] <= WORKING_BYTES < whole_index  # a chunk sized for 2 copies holds 1
    assert 0 < w["parts"]["KL logits"] <= WORKING_BYTES < whole_kl
    a = cfg.attention  # autograd keeps the pooled windows (tied K/V: one branch): not working memory
    pooled = 4 * (T // a.stride + 1) * a.window * cfg.d_model
    assert w["parts"]["attention"] == pytest.approx(backend.prefill_bytes(cfg, T, T, torch.device("cuda")) - pooled)
    assert w["per_sequence"] == max(w["parts"].values()) > 0
    assert "working memory per sequence" in format_plan(p) and "KL logits" in format_plan(p)
    full = plan(compose_train_config(["attention=full", "model=tiny"]), gpus=1, gpu_mem_gib=80, vocab_size=1024)
    assert full["working_memory"] == {"per_sequence": 0.0, "parts": {}}


def test_kv_cache_by_part_at_deepseek_v4_dtypes():
    train_cfg = compose_train_config(["attention=deepseek_v4_csa_sparse", "model=tiny"])
    p = plan(train_cfg, gpus=1, gpu_mem_gib=80, vocab_size=1024, kv_precision="deepseek_v4")
    kv = p["kv_cache_per_token"]
    cfg = model_config(train_cfg, 1024)
    assert kv["precision"] == "deepseek_v4" and kv["parts"]["index"]["dtype"].startswith("fp4")
    s = cfg.attention.stride
    assert kv["parts"]["index"]["bytes"] == cfg.n_layers * cfg.attention.selection.head_dim * (0.5 + 1 / 32) / s
    assert "KV cache per token, long sequences, deepseek_v4" in format_plan(p)
    with pytest.raises(ConfigError, match="precision 'int3' is unknown"):
        plan(train_cfg, gpus=1, gpu_mem_gib=80, vocab_size=1024, kv_precision="int3")
