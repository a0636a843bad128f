"""Consolidated weights (``ckv.io.weights``): a weights file with NaN payloads is refused, naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckv import ModelConfig, Transformer
from ckv.io.weights import WEIGHTS_FILE, NonFiniteWeightsError, is_weights_dir, load_weights, save_weights
from ckv.train.export import export_checkpoint

from .helpers import poison

TINY = dict(
    vocab_size=64,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    max_seq_len=32,
    attention={"kind": "full"},
)


def test_round_trip_and_nan_payload_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    model = Transformer(ModelConfig(**TINY))
    d = save_weights(model, tmp_path / "w")
    assert is_weights_dir(d) and not is_weights_dir(tmp_path)
    loaded = load_weights(d)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))

    poison(d / WEIGHTS_FILE, "layers.0.mlp.down_proj.weight")
    with pytest.raises(
        NonFiniteWeightsError,
        match=r"model.safetensors: tensor 'layers.0.mlp.down_proj.weight' "
        r"holds 2048 NaN/inf value\(s\) of 2048",
    ):
        load_weights(d)


def test_export_refuses_non_finite_checkpoint_weights(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000001"
    save_weights(Transformer(ModelConfig(**TINY)), ckpt / "weights")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "tokens": 0, "world_size": 1}))
    poison(ckpt / "weights" / WEIGHTS_FILE, "embed_tokens.weight")
    with pytest.raises(NonFiniteWeightsError, match="embed_tokens.weight"):
        export_checkpoint(run)
    assert not (run / "model").exists()
