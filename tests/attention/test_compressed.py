"""The compressed reference against the definitions: visibility, pooling, cache memory."""

import pytest
import torch

from ckv import Transformer
from ckv.attention.reference import joint_attention_reference, pool_reference
from ckv.cache import CompressedLayerCache
from ckv.geometry import window_positions
from tests.helpers import assert_influence, brute_covers, brute_influence, small_config, variant


# geometries no conf/attention option has (the property matrix, test_properties.py, runs every option's own):
# a window that is not a multiple of the stride, and local windows of 0 and 3 with either pooling
@pytest.mark.parametrize("window, stride", [(8, 6), (5, 2)])
@pytest.mark.parametrize("local", [0, 3, "tail"])
@pytest.mark.parametrize("gate", [dict(kind="scalar"), None])
def test_a_token_influences_a_query_only_through_visible_entries_or_the_local_window(window, stride, local, gate):
    att = dict(variant("w8s8"), window=window, stride=stride, local_window=local, gate=gate)
    assert_influence(att, 22, lambda t, p: brute_influence(t, p, window, stride, local))


def test_uniform_pooling_is_the_mean_over_present_offsets():
    window, stride, E = 8, 4, 5
    _, present = window_positions(0, E, window, stride)
    payload = torch.randn(2, E, window, 3, 6)
    pooled, alpha = pool_reference(payload, None, present)
    for j in range(E):
        keep = present[j]
        assert torch.allclose(pooled[:, j], payload[:, j, keep].mean(1), atol=1e-6)
    assert not present[0, :4].any() and present[0, 4:].all()  # entry 0 starts at position -4


@pytest.mark.parametrize("gate_dim", [1, 6])
def test_gate_weights_sum_to_one_over_present_offsets_only(gate_dim):
    window, stride, E = 8, 4, 5
    _, present = window_positions(0, E, window, stride)
    payload = torch.randn(2, E, window, 3, 6)
    logits = torch.randn(2, E, window, 3, gate_dim)
    pooled, alpha = pool_reference(payload, logits, present)
    assert torch.allclose(alpha.sum(2), torch.ones(()), atol=1e-6)
    assert (alpha[:, ~present] == 0).all()
    # changing what sits at absent offsets changes nothing
    payload2, logits2 = payload.clone(), logits.clone()
    payload2[:, ~present] = 1e3
    logits2[:, ~present] = 1e3
    assert torch.equal(pool_reference(payload2, logits2, present)[0], pooled)


def test_query_with_nothing_visible_outputs_zero():
    q = torch.randn(1, 3, 2, 4)
    kc = torch.zeros(1, 0, 1, 4)
    k = torch.randn(1, 3, 1, 4)
    out, lse = joint_attention_reference(q, kc, kc, k, k, stride=4, local_window=0)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


@pytest.mark.parametrize(
    "name, local", [("w8s8", 16), ("w8s6", 5), ("w8s8_tied_kv", 16), ("w8s8_tail", "tail"), ("deepseek_v4_csa", 5)]
)
@pytest.mark.parametrize("T", [1, 7, 8, 23, 40])
def test_cache_memory_is_entries_plus_local_window(name, local, T):
    att = dict(variant(name), local_window=local)
    cfg = small_config(att, max_seq_len=64)
    model = Transformer(cfg).eval()
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, T)), cache)
    W, S, KV, D = att["window"], att["stride"], cfg.kv_heads, cfg.head_dim
    per_token = KV * D * (1 if att["kv"] == "tied" else 2) * 4  # fp32 bytes
    local_tokens = len(
        {
            p
            for t in range(T, T + 64)
            for p in range(T)
            if (p >= ((t + 1) // S) * S if local == "tail" else t - local + 1 <= p)
        }
    )
    pending_tokens = len({p for p in range(T) for j in range(T // S, T // S + 3) if brute_covers(j, p, W, S)})
    expected = {
        "entries": (T // S) * per_token * cfg.n_layers,
        "local": local_tokens * per_token * cfg.n_layers,
        "pending": pending_tokens * cfg.d_model * 4 * cfg.n_layers,
    }
    got = cache.nbytes()
    assert {k: got[k] for k in expected} == expected
    assert got["total"] == sum(expected.values())


@pytest.mark.parametrize("tied", [False, True])
def test_cache_append_returns_everything_held_and_keeps_only_the_last_tokens(tied):
    """``CompressedLayerCache.append``: entries and indexer keys accumulate; the forward attends to the exact tokens
    held before it plus its own; the cache keeps the last ``local_keep`` of them and the last ``pending_keep`` hidden
    states (at most those given); tied K/V keep one tensor for both."""
    cache, length = CompressedLayerCache(), 0
    for T, n_entries in ((5, 1), (3, 0), (4, 2)):
        kc, ki = torch.randn(1, n_entries, 1, 2), torch.randn(1, n_entries, 3)
        k, v = torch.randn(1, T, 1, 2), torch.randn(1, T, 1, 2)
        h, h_start = cache.pooling_input(torch.randn(1, T, 4))
        assert h_start == cache.length + T - h.shape[1]
        all_kc, all_ki, all_k = (
            t if old is None else torch.cat([old, t], 1) for old, t in zip((cache.kc, cache.ki, cache.k), (kc, ki, k))
        )
        out = cache.append(kc, None if tied else -kc, ki, k, None if tied else v, h, local_keep=2, pending_keep=9)
        assert torch.equal(out[0], all_kc) and torch.equal(out[2], all_ki) and torch.equal(out[3], all_k)
        assert (out[1] is out[0] and out[4] is out[3]) if tied else torch.equal(out[1], -all_kc)
        assert torch.equal(cache.k, all_k[:, -2:]) and (cache.v is cache.k if tied else torch.equal(cache.v, v[:, -2:]))
        assert cache.vc is None if tied else cache.vc is out[1]
        assert torch.equal(cache.pending, h[:, -9:]) and cache.pending.shape[1] == min(9, h.shape[1])
        length += T
        assert cache.length == length
