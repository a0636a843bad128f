"""Token mixing before pooling (attention.mixing='conv', docs/robustness.md) against its definition and every standing
attention property: the visibility rule (reach widened by the kernel, never past the query), decode == prefill
across window boundaries, torch == triton under the interpreter, gradients, parameter count, config errors.
(conf/attention/w4s4_conv.yaml also runs through the variant-parametrised tests of tests/attention and tests/test_*.py.)"""

import pytest
import torch

from ckv import ModelConfig, Transformer
from ckv.attention.compressed import CausalMixing
from ckv.config import ConfigError
from ckv.flops import parameter_count
from tests.helpers import assert_influence, small_config, variant
from tests.test_geometry import brute_covers
from tests.kernels.test_model import assert_impls_match


def test_mixing_is_the_residual_causal_depthwise_convolution_with_zero_history():
    mix = CausalMixing(d_model=3, kernel=3)
    with torch.no_grad():
        mix.weight.copy_(torch.randn(3, 3))
    h = torch.randn(2, 7, 3)
    out = mix(h)
    for t in range(7):
        expected = h[:, t] + sum(mix.weight[k] * h[:, t - k] for k in range(3) if t - k >= 0)
        assert torch.allclose(out[:, t], expected, atol=1e-6), t


def brute_mixed_influence(t: int, p: int, window: int, stride: int, local, kernel: int) -> bool:
    """Does token p reach query t? Through a visible entry whose window (widened by kernel - 1 predecessors of its
    tokens) holds p, or through the exact local window (unchanged by mixing)."""
    if p > t:
        return False
    via_entry = any(
        brute_covers(j, q, window, stride)
        for j in range(t + 1)
        if (j + 1) * stride - 1 <= t
        for q in range(p, p + kernel)
    )
    in_local = p >= ((t + 1) // stride) * stride if local == "tail" else t - local + 1 <= p
    return via_entry or in_local


@pytest.mark.parametrize("window, stride, kernel", [(4, 4, 4), (4, 4, 2), (8, 4, 3)])
@pytest.mark.parametrize("local", [0, 3, "tail"])
def test_a_token_reaches_a_query_only_through_visible_entries_widened_by_the_kernel(window, stride, kernel, local):
    att = dict(variant("w8s8"), window=window, stride=stride, local_window=local, mixing="conv", mixing_kernel=kernel)
    assert_influence(att, 22, lambda t, p: brute_mixed_influence(t, p, window, stride, local, kernel))


@pytest.mark.parametrize("window, stride, kernel, local", [(4, 4, 4, 4), (8, 4, 4, "tail"), (4, 4, 2, 0)])
def test_decode_matches_prefill_token_by_token_and_in_chunks(window, stride, kernel, local):
    att = dict(variant("w8s8"), window=window, stride=stride, local_window=local, mixing="conv", mixing_kernel=kernel)
    model = Transformer(small_config(att)).eval()
    with torch.no_grad():
        for p in model.parameters():  # mixing taps far from zero, so a missing history state would show
            p.add_(0.1 * torch.randn_like(p))
        ids = torch.randint(0, 64, (2, 27))
        full = model(ids)
        for chunks in ([1] * 27, [5, 3, 1, 6, 2, 1, 1, 8]):
            cache, parts, s = model.new_cache(2), [], 0
            for n in chunks:
                parts.append(model(ids[:, s : s + n], cache))
                s += n
            assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-4, chunks
            # the cache keeps the next window's states plus kernel - 1 predecessors, no more
            pending = cache.layers[0].pending.shape[1]
            next_start = (27 // stride + 1) * stride - window
            assert pending == 27 - max(next_start - (kernel - 1), 0)


def test_every_mixing_tap_gets_a_gradient_and_parameters_are_counted():
    cfg = small_config(variant("w4s4_conv"))
    model = Transformer(cfg)
    model(torch.randint(0, 64, (2, 21))).logsumexp(-1).mean().backward()
    for layer in model.layers:
        for comp in (layer.self_attn.k_compressor, layer.self_attn.v_compressor):
            assert comp.mixing.weight.grad is not None and (comp.mixing.weight.grad.abs().sum(-1) > 0).all()
    base = small_config(variant("w4s4"))
    extra = cfg.n_layers * 2 * cfg.attention.mixing_kernel * cfg.d_model  # K and V branches
    assert parameter_count(cfg) == model.num_parameters() == parameter_count(base) + extra


@pytest.mark.parametrize(
    "attention",
    [
        dict(window=4, stride=4, mixing="conv", mixing_kernel=4, local_window=4),
        dict(window=8, stride=4, gate="vector", kv="tied", mixing="conv", mixing_kernel=3, local_window="tail"),
    ],
)
def test_model_loss_and_gradients_match_between_impls_with_mixing(attention):
    assert_impls_match(attention, 30)


@pytest.mark.parametrize(
    "attention, match",
    [
        (dict(kind="compressed", window=4, stride=4, mixing="conv"), "needs attention.mixing_kernel"),
        (dict(kind="compressed", window=4, stride=4, mixing="conv", mixing_kernel=5), "must be <= attention.stride=4"),
        (dict(kind="compressed", window=4, stride=4, mixing="conv", mixing_kernel=1), "mixing_kernel"),
        (dict(kind="compressed", mixing_kernel=2), "only used with attention.mixing='conv'"),
        (dict(kind="compressed", mixing="lstm"), "attention.mixing='lstm' is not allowed"),
        (dict(kind="full", mixing="conv", mixing_kernel=2), "option of kind='compressed'"),
    ],
)
def test_bad_mixing_settings_raise_one_clear_error(attention, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(
            vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=16, mlp_dim=64, attention=attention
        )
