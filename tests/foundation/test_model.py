"""Model-level behaviour of every backend and paper variant: parity, causality, decoding, gradients."""

import pytest
import torch

from ckv import Transformer
from ckv.io.hf import from_hf, load_hf, save_hf, to_hf

from .helpers import VARIANTS, small_config, variant


def test_parity_with_qwen3_for_causal_lm(tmp_path):
    transformers = pytest.importorskip("transformers")  # noqa: F841  (a dev dependency: always installed in CI)
    cfg = small_config(dict(kind="full"), n_kv_heads=2, tie_embeddings=False, rope_theta=1e6)
    model = Transformer(cfg).eval()
    hf = to_hf(model).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 45))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5  # fp32, same op order: differences are rounding only
    back = from_hf(hf)
    save_hf(model, tmp_path)
    loaded = load_hf(tmp_path)
    with torch.no_grad():
        assert torch.equal(back(ids), ours)
        assert torch.equal(loaded(ids), ours)


def test_parity_with_tied_embeddings():
    cfg = small_config(dict(kind="full"), tie_embeddings=True)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert (model(ids) - to_hf(model).eval()(ids).logits).abs().max().item() < 1e-5


def test_compressed_model_has_no_hf_peer():
    from ckv.config import ConfigError

    with pytest.raises(ConfigError, match="full attention"):
        to_hf(Transformer(small_config(variant("w4s4"))))


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_causal_decodes_like_prefill_and_trains(name):
    cfg = small_config(variant(name), max_seq_len=512)
    model = Transformer(cfg).eval()
    S = cfg.attention.stride
    T = 29 if S < 29 else S + 29  # not a multiple of any stride in the variants; an entry for long strides too
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    with torch.no_grad():
        full = model(ids)
        # causality: changing tokens after t leaves logits up to t unchanged
        t = 13
        changed = ids.clone()
        changed[:, t + 1:] = torch.randint(0, cfg.vocab_size, (2, T - t - 1))
        assert torch.equal(model(changed)[:, : t + 1], full[:, : t + 1])
        # decode == prefill: a prefill of 7 tokens, chunks of 3, then single tokens (from 16 for T = 29)
        cache = model.new_cache(2)
        parts = [model(ids[:, :7], cache)]
        split = 7 + 3 * ((T - 18) // 3)
        for s in range(7, split, 3):
            parts.append(model(ids[:, s:s + 3], cache))
        for s in range(split, T):
            parts.append(model(ids[:, s:s + 1], cache))
        assert cache.length == T
        assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-4
    # every parameter, gates included, receives a gradient
    model.train()
    model(ids).logsumexp(-1).mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    if cfg.attention.kind == "compressed" and cfg.attention.pooling == "gate":
        comp = model.layers[0].self_attn.k_compressor
        assert comp.gate_weight.grad.abs().sum() > 0


def test_generate_matches_argmax_of_full_forward():
    cfg = small_config(variant("w4s4"))
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    out = model.generate(ids, max_new_tokens=11)
    assert out.shape == (2, 20)
    with torch.no_grad():
        for t in range(9, 20):
            assert torch.equal(model(out[:, :t])[:, -1].argmax(-1), out[:, t])
