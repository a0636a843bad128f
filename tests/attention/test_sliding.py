"""``kind: sliding`` (``ckv.attention.full.SlidingAttention``): a query at ``t`` sees keys ``t - W < p <= t``,
checked against a naive masked softmax written from that rule, in one forward, in chunks and token by token; a
window the sequence never exceeds is full attention; the decode cache keeps ``W - 1`` tokens; the accounting is the
module's (parameters, attended pairs, cache bytes); bad values are one line."""

from __future__ import annotations

import math

import pytest
import torch

from ckv.attention import SlidingAttention, build_attention
from ckv.config import ConfigError, ModelConfig
from ckv.flops import flops_per_token, kv_bytes_per_token, parameter_count
from ckv.model import Transformer

V4_STYLE = {  # DeepSeek-V4's sliding-only layer: tied K = V, sinks, low-rank query, output RoPE undone
    "kv": "tied",
    "sink": True,
    "output_rope": "inverse",
    "query": {"lora_rank": 8},
    "rope": {"mode": "partial", "dims": 4, "side": "trailing", "pairing": "interleaved"},
}


def sliding_config(window: int, **attention) -> ModelConfig:
    return ModelConfig(
        vocab_size=32,
        d_model=16,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        mlp_dim=16,
        max_seq_len=64,
        attention={"kind": "sliding", "sliding_window": window, **attention},
    )


def naive(layer: SlidingAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's output by the rule alone: per head, softmax over the keys ``t - W < p <= t`` (and the head's
    sink logit, its probability dropped), loops over queries and heads; the layer's own projections and RoPE."""
    B, T, _ = x.shape
    positions = torch.arange(T)
    q, k, v = layer.project(x, positions)  # (B, T, H, D), (B, T, KV, D) x 2
    H, KV, D = q.shape[2], k.shape[2], q.shape[3]
    out = torch.zeros_like(q)
    for t in range(T):
        keys = [p for p in range(T) if t - layer.window < p <= t]
        for h in range(H):
            kv = h // (H // KV)
            logits = torch.stack([(q[:, t, h] * k[:, p, kv]).sum(-1) / math.sqrt(D) for p in keys], -1)  # (B, n)
            if layer.sinks is not None:
                logits = torch.cat([logits, layer.sinks[h].expand(B, 1)], -1)
            w = logits.softmax(-1)[:, : len(keys)]
            out[:, t, h] = sum(w[:, i, None] * v[:, p, kv] for i, p in enumerate(keys))
    if layer.inverse_output_rope:
        out = layer.rotary(out, positions, inverse=True)
    return layer.o_proj(out.reshape(B, T, -1))


@torch.no_grad()
def in_chunks(layer: SlidingAttention, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    cache, parts, s = layer.new_cache(x.shape[0]), [], 0
    for n in sizes:
        parts.append(layer(x[:, s : s + n], cache))
        s += n
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("options", [{}, V4_STYLE], ids=["plain", "v4"])
def test_sliding_attention_equals_the_naive_masked_softmax(window, options):
    torch.manual_seed(window)
    layer = build_attention(sliding_config(window, **options), 0).eval()
    if layer.sinks is not None:
        torch.nn.init.normal_(layer.sinks)
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        ref = naive(layer, x)
        outs = [layer(x), in_chunks(layer, x, [5, 1, 4, 3]), in_chunks(layer, x, [1] * 13)]
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_window_the_sequence_never_exceeds_is_full_attention():
    torch.manual_seed(0)
    config = sliding_config(16)
    sliding = build_attention(config, 0).eval()
    full = build_attention(ModelConfig(**{**config.to_dict(), "attention": {"kind": "full"}}), 0).eval()
    full.load_state_dict(sliding.state_dict())
    x = torch.randn(2, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(sliding(x), full(x), atol=1e-6, rtol=1e-6)
        shorter = build_attention(sliding_config(15), 0).eval()
        shorter.load_state_dict(sliding.state_dict())
        assert (shorter(x)[:, -1] - full(x)[:, -1]).abs().max() > 1e-4  # the last query loses its first key


@pytest.mark.parametrize("options", [{}, V4_STYLE], ids=["plain", "v4"])
def test_the_cache_keeps_the_window_and_the_accounting_is_the_modules(options):
    W, T = 5, 19
    config = sliding_config(W, **options)
    config = ModelConfig(**{**config.to_dict(), "n_layers": 2, "attention": config.attention})
    model = Transformer(config).eval()
    assert model.num_parameters() == parameter_count(config)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 32, (1, T)), cache)
    assert all(layer.k.shape[1] == W - 1 for layer in cache.layers)
    assert cache.nbytes()["total"] == kv_bytes_per_token(config, T, bytes_per_element=4) * T
    assert kv_bytes_per_token(config, None) == 0  # the cache stops growing
    pairs = sum(min(t + 1, W) for t in range(T))  # query t sees min(t + 1, W) keys
    full = flops_per_token(ModelConfig(**{**config.to_dict(), "attention": {"kind": "full"}}), T)
    assert flops_per_token(config, T).attention == config.n_layers * 4 * config.head_dim * config.n_heads * pairs / T
    assert flops_per_token(config, T).attention < full.attention


@pytest.mark.parametrize(
    "attention, message",
    [
        ({"sliding_window": 0}, "attention.sliding_window=0 must be"),
        ({"sliding_window": 4, "output_rope": "inverse"}, "attention.output_rope='inverse' undoes the RoPE"),
        ({"sliding_window": 4, "window": 4}, "attention.window is not a field of attention.kind='sliding'"),
        ({"sliding_window": 4, "kv": "shared"}, "attention.kv='shared'"),
    ],
)
def test_bad_sliding_values_are_one_line(attention, message):
    with pytest.raises(ConfigError, match=message) as e:
        ModelConfig(attention={"kind": "sliding", **attention})
    assert "\n" not in str(e.value)
