"""Token mixing before pooling (attention.mixing, ckv.options.mixing, docs/robustness.md): what is unique to it.
The standing properties (visibility widened by the kernel, decode == prefill, torch == triton, gradients,
parameter and cache accounting) run for every base + mixing=conv in tests/attention/test_properties.py; here: the
convolution's definition, kernels shorter than the stride, the decode cache's history and the config errors."""

import pytest
import torch

from ckv import Transformer
from ckv.config import ConfigError
from ckv.options.mixing import CausalMixing
from tests.helpers import small_config, variant
from tests.kernels.helpers import assert_impls_match


def test_mixing_is_the_residual_causal_depthwise_convolution_with_zero_history():
    mix = CausalMixing(d_model=3, kernel=3)
    with torch.no_grad():
        mix.weight.copy_(torch.randn(3, 3))
    h = torch.randn(2, 7, 3)
    out = mix(h)
    for t in range(7):
        expected = h[:, t] + sum(mix.weight[k] * h[:, t - k] for k in range(3) if t - k >= 0)
        assert torch.allclose(out[:, t], expected, atol=1e-6), t


@pytest.mark.parametrize("window, stride, kernel, local", [(4, 4, 2, 0), (8, 4, 3, "tail")])
def test_a_shorter_kernel_decodes_like_prefill_and_keeps_kernel_minus_one_predecessors(window, stride, kernel, local):
    att = dict(variant("w8s8"), window=window, stride=stride, local_window=local, mixing=dict(kernel=kernel))
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


def test_a_shorter_kernel_matches_between_impls():
    att = dict(window=8, stride=4, gate=dict(kind="vector"), kv="tied", mixing=dict(kernel=3), local_window="tail")
    assert_impls_match(att, 30)


@pytest.mark.parametrize(
    "attention, match",
    [
        (dict(kind="compressed", window=4, stride=4, mixing=dict(kernel=5)), "must be <= attention.stride=4"),
        (dict(kind="compressed", window=4, stride=4, mixing=dict(kernel=1)), r"attention.mixing.kernel=1 must be"),
        (dict(kind="compressed", window=1, stride=1, mixing={}), "needs attention.stride >= 2"),
        (dict(kind="compressed", mixing=dict(taps=2)), r"unknown attention.mixing field\(s\) \['taps'\]"),
        (dict(kind="compressed", mixing=4), "attention.mixing=4 must be a mapping"),
        (dict(kind="full", mixing=dict(kernel=2)), "attention.mixing is not a field of attention.kind='full'"),
    ],
)
def test_bad_mixing_settings_raise_one_clear_error(attention, match):
    with pytest.raises(ConfigError, match=match) as err:
        Transformer(small_config(attention, n_layers=1, n_heads=4, n_kv_heads=1))
    assert "\n" not in str(err.value)


def test_zero_init_taps_start_as_the_unmixed_model_exactly():
    """``attention/mixing=conv_zero``: the taps start at 0, every other weight is drawn as without mixing (the
    mixing draws nothing), so at step 0 the logits equal the unmixed base's bit for bit."""
    for base in ("w4s4", "deepseek_v4_csa"):
        torch.manual_seed(0)
        plain = Transformer(small_config(variant(base))).eval()
        torch.manual_seed(0)
        mixed = Transformer(small_config(variant(f"{base}+mixing=conv_zero"))).eval()
        ids = torch.randint(0, 64, (2, 23))
        with torch.no_grad():
            assert torch.equal(mixed(ids), plain(ids)), base
