"""DeepSeek-V4.1's compressor is an existing option, not a new one: per-channel gate, no offset bias, non-overlapping
windows of any ratio ``r`` (ratio 1: no pooling) are ``kind: compressed`` with ``window = stride = r``,
``gate: {kind: vector, bias: false}`` and ``offset_maps: shared`` (one payload map ``C`` and one gate map ``Z`` for
every offset). Checked here against a naive reference written from that description (each group of ``r`` tokens
``[j r, (j + 1) r)`` pooled channel by channel with softmax weights over its ``r`` gate logits, no position bias), a
hand-computed case, and ratio 1 (each entry one token's payload)."""

from __future__ import annotations

import math

import pytest
import torch

from ckv.attention import build_attention
from ckv.config import ModelConfig


def v41_config(ratio: int, d_model: int = 12, head_dim: int = 4, impl: str = "torch") -> ModelConfig:
    """V4.1's compressor at ``ratio`` as ckv's options (no RoPE and no norm, so that the pooled values are the
    compressor's output alone)."""
    return ModelConfig(
        vocab_size=16,
        d_model=d_model,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=head_dim,
        mlp_dim=8,
        max_seq_len=64,
        attention={
            "kind": "compressed",
            "impl": impl,
            "window": ratio,
            "stride": ratio,
            "gate": {"kind": "vector", "bias": False},
            "offset_maps": "shared",
            "qk_norm": False,
            "rope": {"mode": "none"},
        },
    )


def naive_v41(h: torch.Tensor, payload: torch.Tensor, gate: torch.Tensor, ratio: int) -> torch.Tensor:
    """The description, loop by loop: h (B, T, d), payload C and gate Z (d, KV * D); entry ``j`` of the
    ``T // ratio`` finished groups is ``sum_i softmax_i(Z h_{j r + i})[c] * (C h_{j r + i})[c]`` for every channel
    ``c``. Returns (B, T // ratio, KV * D)."""
    B, T, _ = h.shape
    out = torch.zeros(B, T // ratio, payload.shape[1])
    for j in range(T // ratio):
        group = h[:, j * ratio : (j + 1) * ratio]  # (B, r, d): the tokens of group j, no overlap
        for c in range(payload.shape[1]):
            w = (group @ gate[:, c]).softmax(-1)  # (B, r): this channel's weights over the group's tokens
            out[:, j, c] = (w * (group @ payload[:, c])).sum(-1)
    return out


def v41_layer(ratio: int, **sizes):  # -> CompressedAttention
    """The layer of ``v41_config``, its weights drawn (std 0.5: payloads of order 1)."""
    layer = build_attention(v41_config(ratio, **sizes), 0)
    layer.init_weights(0.5, 0.5)
    return layer


def values(layer, h: torch.Tensor) -> torch.Tensor:
    """The layer's pooled values of every finished entry of h (B, T, d), (B, T // r, KV * D)."""
    n = h.shape[1] // layer.config.attention.stride
    _, vc = layer.entries(h, 0, 0, n)  # (B, n, KV, D)
    return vc.flatten(2)


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_ckv_options_pool_as_v41s_compressor(ratio, impl):
    torch.manual_seed(ratio)
    layer = v41_layer(ratio, impl=impl)
    V = layer.compressors()["V"]
    assert V.gate.bias is None and V.payload.dim() == 2 and V.gate.weight.dim() == 2  # shared maps, no bias
    assert V.gate.weight.shape == V.payload.shape  # one gate logit per channel
    with torch.no_grad():
        V.gate.weight.normal_()  # a gate far from uniform
    h = torch.randn(2, 4 * ratio + ratio - 1, 12)  # an unfinished group at the end: not pooled
    with torch.no_grad():
        ours = values(layer, h)
    torch.testing.assert_close(ours, naive_v41(h, V.payload.detach(), V.gate.weight.detach(), ratio))


def test_ratio_1_is_no_pooling():
    layer = v41_layer(1)
    V = layer.compressors()["V"]
    h = torch.randn(2, 7, 12)
    with torch.no_grad():
        torch.testing.assert_close(values(layer, h), h @ V.payload)  # each entry is its one token's payload


def test_a_hand_computed_case():
    """d = 2, one KV head of 2 dims, ratio 2, C = Z = identity: channel 0 of group 0 has logits (0, ln 3), weights
    (1/4, 3/4) and pools 3/4 ln 3; channel 1 has logits (ln 3, 0) and the same value; group 1's tokens are equal, so
    it pools them unchanged."""
    layer = v41_layer(2, d_model=2, head_dim=2)
    V = layer.compressors()["V"]
    with torch.no_grad():
        V.payload.copy_(torch.eye(2))
        V.gate.weight.copy_(torch.eye(2))
    ln3 = math.log(3)
    h = torch.tensor([[[0.0, ln3], [ln3, 0.0], [1.0, -2.0], [1.0, -2.0]]])  # (1, 4, 2)
    with torch.no_grad():
        pooled = values(layer, h)
    expected = torch.tensor([[[0.75 * ln3, 0.75 * ln3], [1.0, -2.0]]])
    torch.testing.assert_close(pooled, expected)
