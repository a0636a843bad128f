"""Dual-offset compression (``attention.dual_offset``, an inference-time mitigation; docs/mitigation.md): each
compressed layer also pools its windows moved by ``offset`` with the same compressor, and every query attends to both
sets of entries in one joint softmax.

Checked against a naive reference written from that description (windows listed position by position, one softmax
per query and head over every visible entry of both sets, the local window and the sink), on a case computed by hand,
with offset 0 (nothing added), decoding through the cache against the full forward, and the accounting against the
module and its cache."""

from __future__ import annotations

import math

import pytest
import torch

from ckv import ModelConfig, Transformer
from ckv.attention import CompressedAttention, build_attention, compressed_layers
from ckv.config import ConfigError
from ckv.flops import flops_per_token, kv_bytes_per_token
from ckv.geometry import num_entries, shifted_origin, window_positions
from tests.helpers import small_config, variant


def layer_of(attention: dict, seed: int = 0, **model) -> CompressedAttention:
    """One compressed layer of ``small_config(attention)`` with non-trivial weights, in eval mode."""
    torch.manual_seed(seed)
    cfg = small_config(attention, **model)
    layer = compressed_layers(build_attention(cfg, 0))[0]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.3)
    return layer.eval()


def naive_entry(layer: CompressedAttention, x: torch.Tensor, positions: list[int], rope_position: int):
    """One entry pooled by the layer's own compressors from the window at ``positions`` (real; below 0 absent),
    normalised as the layer does and its key rotated at ``rope_position``: kc, vc (B, KV, D)."""
    B, T, d = x.shape
    hw = torch.stack([x[:, p] if p >= 0 else x.new_zeros(B, d) for p in positions], dim=1)[:, None]  # (B,1,W,d)
    present = torch.tensor([[p >= 0 for p in positions]])
    pre = layer.norm_before_pooling
    kc = layer.k_compressor(hw, present, norm=layer.ck_norm if pre else None)
    if layer.ck_norm is not None and not pre:
        kc = layer.ck_norm(kc)
    kc = layer.rotary(kc, torch.tensor([rope_position]))
    vc = kc if layer.v_compressor is None else layer.v_compressor(hw, present)
    return kc[:, 0], vc[:, 0]


def naive_dual(layer: CompressedAttention, x: torch.Tensor, offset: int) -> torch.Tensor:
    """The layer's output (B, T, d) by the description: the grid's entries j (positions (j+1)S - W .. (j+1)S - 1,
    rotated at jS) and the moved grid's (the same moved by ``offset``, from j = -1, rotated at jS + offset), each
    visible to the query at t once its last position is <= t, one softmax per query and head over them, the local
    window's exact keys and the sink."""
    B, T, _ = x.shape
    S, W, a = layer.stride, layer.window, layer.config.attention
    positions = torch.arange(T)
    q, k, v = layer.project(x, positions, layer.query_latent(x))  # (B, T, H|KV, D)
    windows = []  # (last position, kc, vc) of every entry of both sets
    for shift, first in ((0, 0), (offset, -1)):
        j = first
        while (j + 1) * S - 1 + shift <= T - 1:
            span = list(range((j + 1) * S - W + shift, (j + 1) * S + shift))
            if span[-1] >= 0:
                windows.append((span[-1], *naive_entry(layer, x, span, j * S + shift)))
            j += 1
    G = layer.n_heads // layer.kv_heads
    out = torch.zeros_like(q)
    for t in range(T):
        first_local = ((t + 1) // S) * S if a.local_window == "tail" else t - a.local_window + 1
        local = [p for p in range(max(first_local, 0), t + 1)]
        for h in range(layer.n_heads):
            g = h // G
            keys = [kc[:, g] for end, kc, _ in windows if end <= t] + [k[:, p, g] for p in local]
            values = [vc[:, g] for end, _, vc in windows if end <= t] + [v[:, p, g] for p in local]
            logits = torch.stack([(q[:, t, h] * key).sum(-1) for key in keys], -1) / math.sqrt(layer.head_dim)
            if layer.sinks is not None:
                logits = torch.cat([logits, layer.sinks[h].expand(B, 1)], -1)
            p = torch.softmax(logits, -1)[:, : len(keys)]  # the sink's probability is dropped
            out[:, t, h] = (p[..., None] * torch.stack(values, 1)).sum(1)
    if layer.inverse_output_rope:
        out = layer.rotary(out, positions, inverse=True)
    return layer.o_proj(out.reshape(B, T, -1))


CASES = {
    "w8s8": (dict(variant("w8s8"), local_window=4), 4),
    "w4s4_tail": (dict(variant("w4s4"), local_window="tail"), 1),
    "w8s4_mean_shared": (dict(variant("w8s4"), gate=None, offset_maps="shared"), 2),
    "deepseek_v4_csa": (dict(variant("deepseek_v4_csa"), local_window=5), 2),  # sinks, tied K=V, series maps
    "w8s8_kv2_post": (dict(variant("w8s8_kv2"), compressed_norm="post", local_window=3), 3),
}


@pytest.mark.parametrize("name", sorted(CASES))
@torch.no_grad()
def test_the_layer_equals_the_naive_reference(name: str) -> None:
    attention, offset = CASES[name]
    layer = layer_of({**attention, "dual_offset": offset, "impl": "reference"})
    x = torch.randn(2, 23, layer.config.d_model)
    out = layer(x)
    assert torch.allclose(out, naive_dual(layer, x, offset), atol=2e-5, rtol=1e-4)
    plain = layer_of({**attention, "impl": "reference"})  # the same weights without the second set
    assert (plain(x) - out).abs().max() > 1e-3


@torch.no_grad()
def test_the_fast_path_equals_the_reference() -> None:
    attention, offset = CASES["w8s8"]
    ref = layer_of({**attention, "dual_offset": offset, "impl": "reference"})
    fast = layer_of({**attention, "dual_offset": offset, "impl": "torch"})
    x = torch.randn(2, 41, ref.config.d_model)
    assert torch.allclose(ref(x), fast(x), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_triton_kernels_equal_the_reference() -> None:
    """The second set's joint softmax (no local window, no sink) runs on the kernels unchanged (interpreter on CPU)."""
    from ckv.attention.dispatch import triton_available

    if not triton_available():
        pytest.skip("ckv_kernels / triton not installed")
    attention, offset = CASES["deepseek_v4_csa"]  # sinks on the first set only
    ref = layer_of({**attention, "dual_offset": offset, "impl": "reference"})
    tri = layer_of({**attention, "dual_offset": offset, "impl": "triton"})
    x = torch.randn(1, 19, ref.config.d_model)
    assert torch.allclose(ref(x), tri(x), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_case_computed_by_hand() -> None:
    """W = S = 2, offset 1, one head of 2 dims, identity maps, uniform means, no RoPE, no norms, a local window of
    the query alone. Four tokens x0..x3: the grid's entries are mean(x0, x1) (visible from t = 1) and mean(x2, x3)
    (t = 3); the moved grid's are x0 (window [-1, 0], visible from t = 0) and mean(x1, x2) (t = 2); so query 3
    attends to [mean(x0, x1), mean(x2, x3), x0, mean(x1, x2), x3] and query 2 to [mean(x0, x1), x0, mean(x1, x2),
    x2]."""
    attention = dict(
        kind="compressed", window=2, stride=2, local_window=1, gate=None, offset_maps="shared", qk_norm=False,
        rope={"mode": "none"}, dual_offset=1, impl="reference",
    )  # fmt: skip
    cfg = ModelConfig(
        vocab_size=8, d_model=2, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, mlp_dim=4, attention=attention
    )
    layer = compressed_layers(build_attention(cfg, 0))[0].eval()
    for p in layer.parameters():  # every map the identity (payload maps are (maps, d, D))
        p.copy_(torch.eye(2).expand_as(p))
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]]])
    x0, x1, x2, x3 = x[0]
    by_hand = {
        3: [(x0 + x1) / 2, (x2 + x3) / 2, x0, (x1 + x2) / 2, x3],
        2: [(x0 + x1) / 2, x0, (x1 + x2) / 2, x2],
    }
    out = layer(x)[0]
    for t, columns in by_hand.items():
        keys = torch.stack(columns)  # values are the same vectors (identity maps)
        p = torch.softmax(keys @ x[0, t] / math.sqrt(2), 0)
        assert torch.allclose(out[t], p @ keys, atol=1e-6), t


@pytest.mark.parametrize("name", sorted(CASES))
@torch.no_grad()
def test_offset_0_is_the_unmitigated_layer(name: str) -> None:
    attention, _ = CASES[name]
    plain, zero = layer_of(attention), layer_of({**attention, "dual_offset": 0})
    x = torch.randn(2, 19, plain.config.d_model)
    assert torch.equal(plain(x), zero(x))


@pytest.mark.parametrize(
    "attention,offset",
    [*CASES.values(), (dict(variant("w4s4"), grid={"offsets": "stagger"}), 2),
     (dict(variant("w8s8_kv2"), grid={"offsets": "stagger", "per": "kv_head"}), 4),
     (dict(variant("w4s4"), mixing={"kernel": 3}), 2)],
)  # fmt: skip
@torch.no_grad()
def test_decoding_through_the_cache_equals_the_full_forward(attention: dict, offset: int) -> None:
    torch.manual_seed(1)
    cfg = small_config({**attention, "dual_offset": offset})
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    full = model(ids)  # (B, T, V)
    for chunks in ([1] * 37, [5, 1, 9, 2, 20]):
        cache, outs, start = model.new_cache(2), [], 0
        for n in chunks:
            outs.append(model.lm_head(model.hidden_states(ids[:, start : start + n], cache)))
            start += n
        assert torch.allclose(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5), chunks
        held = cache.nbytes()
        expected = kv_bytes_per_token(cfg, 37, bytes_per_element=4) * 37 * 2  # two sequences, fp32
        assert held["total"] == pytest.approx(expected)


def test_the_accounting_counts_the_second_set() -> None:
    """FLOPs: one more pooled entry per moved window and one more scored pair per visible moved entry and query head;
    KV bytes: the moved entries and their pending states (matched to the real cache in the decoding test)."""
    attention, offset = CASES["w8s8"]
    base, dual = small_config(attention), small_config({**attention, "dual_offset": offset})
    T, S, W = 64, 8, 8
    f0, f1 = flops_per_token(base, T), flops_per_token(dual, T)
    P = shifted_origin(0, offset, S)
    moved = num_entries(T + P, S)
    pairs = sum(min((t + P + 1) // S, moved) for t in range(T)) * base.n_heads * base.n_layers
    assert (f1.attention - f0.attention) * T == pytest.approx(4 * base.head_dim * pairs)
    assert f1.compressor / f0.compressor == pytest.approx(moved / num_entries(T, S) + 1)
    assert f1.linear == f0.linear
    assert kv_bytes_per_token(dual, T) > kv_bytes_per_token(base, T)
    # the moved grid's windows are the grid's moved by the offset
    pos, present = window_positions(0, moved, W, S, origin=P)
    assert (pos - P)[1].tolist() == list(range(offset, offset + W)) and present[0].any()


def test_every_short_record_lies_in_a_window_of_one_grid() -> None:
    """geometry: with offsets 0 and o the window ends fall o and S - o apart, so a record of at most
    W - max(o, S - o) + 1 tokens always lies in one window (one grid alone: W - S + 1)."""
    for W, S in ((4, 4), (8, 8), (8, 4), (12, 12)):
        for o in range(1, S):
            longest = W - max(o, S - o) + 1
            starts = {}
            for P in (0, shifted_origin(0, o, S)):
                pos, present = window_positions(0, num_entries(200 + P, S), W, S, origin=P)
                for row, ok in zip((pos - P).tolist(), present.tolist()):
                    if all(ok):
                        starts[row[0]] = True

            def fits(p: int, r: int, starts: dict = starts, W: int = W) -> bool:  # in one window of either grid
                return any(s <= p and p + r - 1 <= s + W - 1 for s in starts)

            assert all(fits(p, longest) for p in range(W, 150)), (W, S, o)
            assert not all(fits(p, longest + 1) for p in range(W, 150)), (W, S, o)


@pytest.mark.parametrize(
    "attention,line",
    [
        (dict(variant("w4s4"), dual_offset=4), "attention.dual_offset=4 must be < attention.stride=4"),
        (dict(variant("w4s4"), dual_offset=-1), "attention.dual_offset=-1 must be an integer >= 0"),
        (dict(variant("deepseek_v4_csa_sparse"), dual_offset=2), "attention.dual_offset: dual-offset compression"),
    ],
)
def test_bad_offsets_are_one_line_errors(attention: dict, line: str) -> None:
    with pytest.raises(ConfigError) as e:
        small_config(attention)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_training_with_the_option_is_refused() -> None:
    layer = layer_of({**variant("w4s4"), "dual_offset": 2}).train()
    with pytest.raises(RuntimeError, match="inference-time option"):
        layer(torch.randn(1, 9, layer.config.d_model))
