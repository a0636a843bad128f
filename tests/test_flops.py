"""ckv.flops: FLOPs derived from first principles on tiny configs, the compressed/full cost ratio, the peak table
and MFU. (Parameter counts, visible pairs and KV-cache bytes of every attention option are checked against the
modules in tests/attention/test_properties.py.)"""

import pytest

from ckv.attention import check_attention, layer_backends
from ckv.config import ConfigError, ModelConfig
from ckv.flops import (
    CACHE_DTYPES,
    PEAK_BF16_FLOPS,
    flops_per_token,
    kv_bytes_by_part,
    kv_bytes_per_token,
    mfu,
    parameter_count,
    peak_flops,
)
from tests.helpers import VARIANTS, small_config, variant


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


def test_indexer_and_low_rank_query_have_lines_of_their_own():
    """The same one-layer model with V4's low-rank query (rank 3) and top-1 selection by 2 index heads of 4 dims:
    the indexer's branch, maps and scoring on ``indexer``; the query latent's maps replace the query map on
    ``linear``; the K/V compressor's line is the dense model's."""
    base = dict(kind="compressed", window=4, stride=2, local_window=3, kv_heads=1, gate=dict(kind="scalar"))
    sizes = dict(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, mlp_dim=16)
    plain = ModelConfig(**sizes, attention=base)
    cfg = ModelConfig(
        **sizes, attention=dict(base, query=dict(lora_rank=3), selection=dict(topk=1, heads=2, head_dim=4))
    )
    T = 6
    f, p = flops_per_token(cfg, T), flops_per_token(plain, T)
    # its branch pools 3 entries of 4 tokens (payload 8x4 + scalar gate 8x1 MACs per token, gated sum 4x4 per
    # entry); per token index queries 3 -> 2x4 and head weights 8 -> 2; 2 x (4 + 1) per (query, visible entry),
    # 0+1+1+2+2+3 = 9 visible pairs
    indexer = 2 * 3 * (4 * 8 * (4 + 1) + 4 * 4) / T + 2 * (3 * 2 * 4 + 8 * 2) + 2 * 2 * (4 + 1) * 9 / T
    assert f.indexer == pytest.approx(indexer) and p.indexer == 0
    assert f.compressor == pytest.approx(p.compressor)
    assert f.linear - p.linear == 2 * (8 * 3 + 3 * 8 - 8 * 8)  # q: 8 -> 3 -> 8 instead of 8 -> 8
    assert f.forward == pytest.approx(f.linear + f.attention + f.compressor + f.indexer)


@pytest.mark.parametrize("name", VARIANTS)
def test_every_flop_line_is_non_negative(name):
    cfg = small_config(variant(name))
    backend = check_attention(cfg)
    for T in (1, 37):
        for layer in range(cfg.n_layers):
            f = backend.flops_per_token(cfg, T, layer)
            assert min(f.projections, f.attention, f.compressor, f.indexer) >= 0, (T, layer, f)


@pytest.mark.parametrize("name", ["full", "w8s8", "deepseek_v4_csa_sparse", "w8s8_kv2_heads"])
def test_kv_bytes_by_part_sum_to_the_cache_at_one_dtype(name):
    cfg = small_config(variant(name))
    for T in (None, 1, 37):
        for precision, b in (("fp32", 4), ("bf16", 2)):
            parts = kv_bytes_by_part(cfg, T, precision)
            assert sum(n for n, _ in parts.values()) == pytest.approx(kv_bytes_per_token(cfg, T, b)), (T, precision)
    with pytest.raises(ConfigError, match="precision 'fp6' is unknown"):
        kv_bytes_by_part(cfg, None, "fp6")


def test_deepseek_v4_dtypes_price_each_part():
    """V4-like entries (1 KV head of 512 dims, tied K/V, 64 rotated dims) and a 128-dim indexer key, stride 4:
    per token 448 fp8 dims + 4 fp32 scales per 128 (3.5 scales), 64 bf16 dims, 128 fp4 dims + 1 byte per 32."""
    attention = dict(
        kind="compressed", window=8, stride=4, local_window=8, kv_heads=1, kv="tied", sink=True,
        rope=dict(mode="partial", dims=64), selection=dict(topk=4, heads=2, head_dim=128),
    )  # fmt: skip
    cfg = ModelConfig(
        vocab_size=10, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=512, mlp_dim=16, attention=attention
    )
    parts = kv_bytes_by_part(cfg, None, "deepseek_v4")
    assert parts["entries"][0] == pytest.approx((448 + 4 * 448 / 128) / 4)
    assert parts["entries.rope"][0] == pytest.approx(64 * 2 / 4)
    assert parts["index"][0] == pytest.approx((128 / 2 + 128 / 32) / 4)
    assert {dtype for _, dtype in parts.values()} >= {CACHE_DTYPES[k].name for k in ("fp8", "bf16", "fp4")}


def test_a_layer_schedule_is_accounted_layer_by_layer():
    """Parameters, FLOPs and cache bytes of a schedule (sliding, compressed, full layers) are each segment's share of
    the uniform model of its attention, and the built model's own counts (parameters held, cache bytes after T)."""
    import torch

    from ckv.model import Transformer

    segments = [
        ({"kind": "sliding", "sliding_window": 5}, 1),
        ({"kind": "compressed", "window": 8, "stride": 4, "local_window": 4}, 2),
        ({"kind": "full"}, 1),
    ]
    cfg = small_config(segments[1][0], n_layers=4, layers=[{"count": n, "attention": a} for a, n in segments])
    uniform = [(small_config(a, n_layers=4), n / 4) for a, n in segments]  # each segment's share of its uniform model
    T = 21
    ours, theirs = flops_per_token(cfg, T), [(flops_per_token(u, T), share) for u, share in uniform]
    for part in ("attention", "compressor", "indexer"):
        assert getattr(ours, part) == pytest.approx(sum(getattr(f, part) * s for f, s in theirs))
    assert ours.attention < flops_per_token(small_config({"kind": "full"}, n_layers=4), T).attention
    for seq_len in (T, None):
        assert kv_bytes_per_token(cfg, seq_len) == pytest.approx(
            sum(kv_bytes_per_token(u, seq_len) * s for u, s in uniform)
        )
    parts = kv_bytes_by_part(cfg, T)
    assert sum(b for b, _ in parts.values()) == pytest.approx(kv_bytes_per_token(cfg, T))
    assert {"keys_values", "entries", "local"} <= set(parts)
    model = Transformer(cfg).eval()
    assert model.num_parameters() == parameter_count(cfg)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, T)), cache)
    assert cache.nbytes()["total"] == pytest.approx(kv_bytes_per_token(cfg, T, bytes_per_element=4) * T)


def test_a_shared_kv_cache_is_counted_once():
    """Cross-layer KV sharing: the source's entries are counted in its layer only (the ``entries`` parts equal the
    source's alone, however many layers read them); each consumer adds its window's keys and values."""
    sliding = {"kind": "sliding", "sliding_window": 5}
    source = {"kind": "compressed", "window": 8, "stride": 4, "local_window": 4}
    T = 21
    for consumers in (1, 3):
        layers = [{"count": 1, "kv": "source", "attention": source}, {"count": consumers, "kv": "shared"}]
        cfg = small_config(sliding, n_layers=1 + consumers, layers=layers)
        parts = kv_bytes_by_part(cfg, T)
        assert sum(b for b, _ in parts.values()) == pytest.approx(kv_bytes_per_token(cfg, T))
        alone = small_config(source, n_layers=1 + consumers)  # one layer of it: the source's own cache
        backend, layer = layer_backends(alone)[0]
        assert parts["entries"][0] == pytest.approx(backend.kv_elements_per_token(layer, T)["entries"] * 2)
        window = kv_bytes_per_token(small_config(sliding, n_layers=1 + consumers), T) / (1 + consumers)
        assert kv_bytes_per_token(cfg, T) == pytest.approx(backend.kv_bytes_per_token(layer, T) + consumers * window)
