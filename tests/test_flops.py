"""ckv.flops: FLOPs derived from first principles on tiny configs, the compressed/full cost ratio, the peak table
and MFU. (Parameter counts, visible pairs and KV-cache bytes of every attention option are checked against the
modules in tests/attention/test_properties.py.)"""

import pytest

from ckv.config import ConfigError, ModelConfig
from ckv.flops import PEAK_BF16_FLOPS, flops_per_token, mfu, peak_flops
from tests.helpers import variant


def test_flops_from_first_principles():
    """One layer, d=8, 2 heads of dim 4 sharing 1 KV head, MLP 16, vocab 10, W4/S2, local window 3, T=6."""
    att = dict(kind="compressed", window=4, stride=2, local_window=3, kv_heads=1, gate=dict(kind="scalar"))
    cfg = ModelConfig(
        vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, mlp_dim=16, attention=att
    )
    T = 6
    # linear maps per token: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8, head 8x10; 2 FLOPs per MAC
    linear = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 128 + 80)
    # visible entries at t=0..5: (t+1)//2 = 0,1,1,2,2,3; local keys min(3, t+1) = 1,2,3,3,3,3 -> 24 pairs
    attention = 4 * 4 * 2 * 24 / T
    # 3 entries x 4 window tokens x 2 branches x (payload 8x4 + scalar gate 8x1) MACs, + gated sums 4x4 per entry
    compressor = 2 * 3 * (4 * 2 * 8 * (4 + 1) + 2 * 4 * 4) / T
    f = flops_per_token(cfg, T)
    assert (f.linear, f.attention, f.compressor) == (linear, pytest.approx(attention), pytest.approx(compressor))
    assert f.training == pytest.approx(3 * (linear + attention + compressor))
    full = flops_per_token(ModelConfig(**{**cfg.to_dict(), "attention": dict(kind="full", kv_heads=1)}), T)
    assert full.attention == pytest.approx(4 * 4 * 2 * 21 / T) and full.compressor == 0  # 6*7/2 causal pairs


def test_compressed_costs_less_than_full_at_long_sequences():
    full = ModelConfig.from_preset("qwen3_0.6b", attention=dict(kind="full"))
    comp = ModelConfig.from_preset("qwen3_0.6b", attention=variant("w8s8"))
    short, long = 256, 32768
    assert flops_per_token(comp, long).forward < flops_per_token(full, long).forward
    assert flops_per_token(comp, long).attention < flops_per_token(full, long).attention / 6  # ~T/8 + 16 vs T/2
    # full attention's share grows linearly with T; compressed attention's grows by 1/stride as fast
    assert flops_per_token(full, long).attention / flops_per_token(full, short).attention == pytest.approx(
        (long + 1) / (short + 1)
    )


def test_peak_table_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == PEAK_BF16_FLOPS["H200"] == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Other GPU") is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", override=1e15) == 1e15
    with pytest.raises(ConfigError):
        peak_flops(override=0)
    assert mfu(1e4, 6e9, 1e15) == pytest.approx(0.06)
