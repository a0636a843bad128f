"""ckv's DeepSeek-V4 options on their own: config checks, the RoPE layouts and per-series maps (test_v4_parity.py
checks them against transformers; the property matrix, test_properties.py, runs both V4 options)."""

from __future__ import annotations

import pytest
import torch

from ckv import AttentionConfig, ConfigError, ModelConfig, Transformer
from ckv.attention.rope import Rotary
from ckv.geometry import offset_series
from tests.helpers import small_config, variant


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(offset_maps="series", window=8, stride=6), "offset_maps"),
        (dict(output_rope="inverse", kv="separate"), "output_rope"),
        (dict(sink=1), "sink"),
    ],
)
def test_bad_v4_options_raise_a_config_error_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        AttentionConfig.from_dict({**variant("deepseek_v4_csa"), **change})


def test_full_attention_refuses_the_v4_flags():
    for flag, fields in ((dict(sink=True), "attention.sink is not a field"), (dict(kv="tied"), "attention.kv is not")):
        with pytest.raises(ConfigError, match=f"{fields} .*of attention.kind='full'"):
            ModelConfig.from_preset("tiny", attention=dict(kind="full", **flag))
    with pytest.raises(
        ConfigError, match="attention.kv, attention.output_rope are not fields of attention.kind='full'"
    ):
        ModelConfig.from_preset("tiny", attention=dict(kind="full", output_rope="inverse", kv="tied"))


def test_offset_series_groups_the_window_by_stride_block():
    assert offset_series(8, 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert offset_series(4, 4).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="multiple"):
        offset_series(8, 6)


@pytest.mark.parametrize("side, pairing", [("leading", "half"), ("trailing", "half"), ("trailing", "interleaved")])
def test_rotary_rotates_the_chosen_dims_preserves_norms_and_inverts(side, pairing):
    rot = Rotary(4, 100.0, side=side, pairing=pairing)
    x = torch.randn(1, 5, 2, 10)
    pos = torch.arange(5) * 3
    y = rot(x, pos)
    fixed = slice(4, None) if side == "leading" else slice(0, 6)
    assert torch.equal(y[..., fixed], x[..., fixed])
    # each rotated pair keeps its norm: pairs (i, i + 2) for halves, (2i, 2i + 1) interleaved
    r = y[..., :4] if side == "leading" else y[..., 6:]
    xr = x[..., :4] if side == "leading" else x[..., 6:]
    pairs = [(0, 2), (1, 3)] if pairing == "half" else [(0, 1), (2, 3)]
    for a, b in pairs:
        assert torch.allclose(r[..., a] ** 2 + r[..., b] ** 2, xr[..., a] ** 2 + xr[..., b] ** 2, atol=1e-5)
    assert torch.allclose(rot(y, pos, inverse=True), x, atol=1e-5)
    # relative positions: <R(p) q, R(p') k> depends on p - p' only
    q, k = torch.randn(1, 1, 1, 10), torch.randn(1, 1, 1, 10)
    dots = [(rot(q, torch.tensor([p + 7])) * rot(k, torch.tensor([p]))).sum() for p in (0, 5)]
    assert torch.allclose(dots[0], dots[1], atol=1e-5)


def test_per_series_maps_use_one_map_per_stride_block():
    """A token's payload in entry j depends on its series (which block of the window it sits in), not on its
    exact offset: the CSA entry j pools block j-1 through map 0 ("Ca") and block j through map 1 ("Cb")."""
    cfg = small_config(dict(variant("deepseek_v4_csa"), impl="torch"), n_layers=1)
    comp = Transformer(cfg).layers[0].self_attn.compressors()["K"]
    assert comp.payload.shape == (2, cfg.d_model, cfg.head_dim)
    hw = torch.randn(1, 3, 8, cfg.d_model)
    mapped = comp._map(hw, comp.payload)  # (B, E, W, D)
    for i in range(8):
        assert torch.allclose(mapped[:, :, i], hw[:, :, i] @ comp.payload[i // 4], atol=1e-6)
