"""Layer schedules (``model.layers``) through training: composed from conf/model/tiny_schedule.yaml, planned layer by
layer, trained, resumed exactly and exported with their schedule; a bad schedule is one line before anything is
written. The same for cross-layer KV sharing (a segment's ``kv``, conf/model/tiny_csa2.yaml)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckv.attention import layer_backends
from ckv.io.weights import load_weights
from ckv.train import read_metrics, train
from ckv.train.plan import activation_bytes_per_token, model_config, plan
from tests.helpers import assert_documented, run_script

from .helpers import train_config

SCHEDULE = [{"count": 1, "attention": {"kind": "sliding", "sliding_window": 3}}, {"count": 1}]
# a source (the run's compressed attention) and a layer that reads its entries beside its own 3-token window
SHARED = [{"count": 1, "kv": "source"}, {"count": 1, "kv": "shared", "attention": SCHEDULE[0]["attention"]}]


def test_the_schedule_option_composes_and_builds_each_layer():
    cfg = train_config(["experiment=cpu_smoke", "model=tiny_schedule"])
    model = cfg.model.build(cfg.attention, data_vocab_size=cfg.data.text.vocab_size)
    kinds = [model.layer_attention(i).kind for i in range(model.n_layers)]
    assert kinds == ["sliding"] + ["compressed"] * (model.n_layers - 1)  # the run's attention=w4s4 fills the rest
    assert model.layer_attention(0).sliding_window == 16 and model.layer_attention(1) == model.attention


def test_the_csa2_option_composes_and_builds_its_sharing_groups():
    cfg = train_config(["experiment=cpu_smoke", "model=tiny_csa2"])
    model = cfg.model.build(cfg.attention, data_vocab_size=cfg.data.text.vocab_size)
    assert model.layer_kinds == (
        "2x sliding + 1x compressed kv=source + 2x sliding kv=shared + 1x compressed kv=source + 2x sliding kv=shared"
    )
    assert [model.source_layer(i) for i in range(model.n_layers)] == [None, None, None, 2, 2, None, 5, 5]
    assert [model.layer_attention(i).stride for i in (2, 5)] == [2, 1]


def test_the_plan_sums_the_layers():
    cfg = train_config(["experiment=cpu_smoke", "model=tiny_schedule"])
    p = plan(cfg, gpus=1, gpu_mem_gib=80, gpu="H100", vocab_size=1024)
    model = model_config(cfg, 1024)
    assert p["model"]["attention"] == "1x sliding + 3x compressed"
    per_layer = [
        4 * model.d_model + backend.activation_elements_per_token(layer) + 4 * model.mlp_dim
        for backend, layer in layer_backends(model)
    ]
    assert len(set(per_layer)) == 2  # the sliding layer saves less than the compressed ones
    assert activation_bytes_per_token(model, 2, False) == 2 * sum(per_layer)
    assert activation_bytes_per_token(model, 2, True) == 2 * (model.n_layers * model.d_model + 2 * max(per_layer))


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "model.n_layers=3",
            "ckv: error: model.layers counts [1, 3] add up to 4 layers, not model.n_layers=3: make the segment counts "
            "add up to n_layers (or set model.layers=null for a uniform stack)",
        ),
        ("+model.layers.0.attention.windw=4", "ckv: error: attention.windw is not a field of attention.kind='sliding'"),
        ("model.layers.0.attention.sliding_window=0", "ckv: error: attention.sliding_window=0 must be"),
        (
            "model.layers.0.attention.sliding_window=64",
            "ckv: error: data.seq_len=64 is not longer than model.layers[0].attention.sliding_window=64: every query "
            "sees the whole sequence, so the layer trains as full attention; use data.seq_len > 64 or a smaller "
            "model.layers[0].attention.sliding_window",
        ),
        (
            "+model.layers.1.attention={kind:compressed,window:128,stride:4,local_window:4}",
            "ckv: error: data.seq_len=64 is shorter than model.layers[1].attention.window=128: no window of a "
            "sequence completes, so compression never takes part; use data.seq_len >= 128 or a smaller "
            "model.layers[1].attention.window",
        ),
        (  # the segment that takes the run's attention names it as the uniform stack does
            "attention.window=128",
            "ckv: error: data.seq_len=64 is shorter than attention.window=128: no window of a sequence completes, so "
            "compression never takes part; use data.seq_len >= 128 or a smaller attention.window",
        ),
    ],
)
def test_a_bad_schedule_is_one_line_and_writes_nothing(tmp_path, override, line, monkeypatch, capsys):
    cache = tmp_path / "cache"
    args = ["experiment=cpu_smoke", "model=tiny_schedule", override, f"out_dir={tmp_path}"]
    args += [f"trainer.data_cache_dir={cache}", "wandb.enabled=false"]
    code, _, err = run_script("train.py", args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(line), err
    assert list(tmp_path.iterdir()) == []
    if not override.startswith(("+model.layers.0", "model.layers.0.attention.sliding_window=0", "attention.")):
        assert_documented(lines[0])  # the rows of docs/errors.md ("Layer schedules")


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["model.layers.1.kv=own"],
            "ckv: error: model.layers[2].kv='shared': layer 3 reads the KV of the nearest layer before it with "
            "kv='source', and no layer before it has one: put a kv: source segment before it (or set kv: own)",
        ),
        (
            ["+model.layers.2.attention.kv_heads=2"],
            "ckv: error: model.layers[2].kv='shared': layer 3 reads the KV of layer 2 but disagrees with it on "
            "attention.kv_heads (2 vs the source's 1): a sharing group's layers must agree on KV heads and RoPE (the "
            "head size is the model's, model.head_dim)",
        ),
        (
            ["~model.layers.2.attention", "+model.layers.2.attention={kind:full}"],
            "ckv: error: model.layers[2].kv='shared': a consumer attends its source's KV beside its own sliding "
            "window, so its attention.kind must be one that does (['sliding']), not 'full'",
        ),
        (
            ["~model.layers.1.attention", "+model.layers.1.attention={kind:sliding,sliding_window:16}"],
            "ckv: error: model.layers[1].kv='source': attention.kind='sliding' keeps only its last sliding_window "
            "tokens, so it has no KV to publish to other layers: make the source a full layer (ratio 1) or a "
            "compressed one (ratio = its stride)",
        ),
        (
            ["model.n_layers=7"],
            "ckv: error: model.layers counts [2, 1, 2, 1, 2] add up to 8 layers, not model.n_layers=7: make the "
            "segment counts add up to n_layers (or set model.layers=null for a uniform stack)",
        ),
    ],
    ids=["no_source", "group_disagrees", "consumer_kind", "source_kind", "layer_count"],
)
def test_bad_kv_sharing_is_one_line_and_writes_nothing(tmp_path, overrides, line, monkeypatch, capsys):
    args = ["experiment=cpu_smoke", "model=tiny_csa2", *overrides, f"out_dir={tmp_path}"]
    args += [f"trainer.data_cache_dir={tmp_path / 'cache'}", "wandb.enabled=false"]
    code, _, err = run_script("train.py", args, monkeypatch, capsys)
    assert code == 1 and err.strip().splitlines() == [line], err
    assert list(tmp_path.iterdir()) == []
    if overrides != ["model.n_layers=7"]:
        assert_documented(line)  # the rows of docs/errors.md ("Layer schedules")


@pytest.mark.parametrize("layers", [SCHEDULE, SHARED], ids=["schedule", "shared_kv"])
def test_a_scheduled_run_resumes_exactly_and_exports_its_schedule(make_config, layers):
    """6 steps straight vs. 3 (``trainer.stop_at_step``) and a resume to 6: the same losses and final weights; the
    exported model is the schedule's and loads as it (with its sharing group)."""
    model = {"preset": "tiny", "n_layers": 2, "layers": layers}
    attention = {"kind": "compressed", "window": 4, "stride": 4, "local_window": 2}
    straight = make_config("straight", model=model, attention=attention, trainer={"max_steps": 6})
    train(straight)
    split = make_config("split", model=model, attention=attention, trainer={"max_steps": 6, "stop_at_step": 3})
    train(split)
    train(dataclasses.replace(split, trainer=dataclasses.replace(split.trainer, stop_at_step=None)))
    a, b = read_metrics(straight.run_dir), read_metrics(split.run_dir)
    assert [(r["step"], r["loss"]) for r in a if "loss" in r] == [(r["step"], r["loss"]) for r in b if "loss" in r]
    wa = load_file(str(Path(straight.run_dir) / "model" / "model.safetensors"))
    wb = load_file(str(Path(split.run_dir) / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    exported = load_weights(Path(split.run_dir) / "model")
    kinds = [type(block.self_attn).__name__ for block in exported.layers]
    if layers is SCHEDULE:
        assert kinds == ["SlidingAttention", "CompressedAttention"]
        assert exported.config.layer_attention(0).sliding_window == 3
    else:
        assert kinds == ["CompressedAttention", "SlidingAttention"] and exported.config.source_layer(1) == 0
