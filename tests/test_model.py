"""Model-level behaviour of every backend and paper variant: parity, causality, decoding, gradients."""

import json
from pathlib import Path

import pytest
import torch

from ckv import Transformer
from ckv.io.hf import from_hf, load_hf, save_hf, to_hf
from tests.helpers import small_config, variant

# A rope theta that is no default anywhere (ckv's and transformers' 1e4, the 1e6 ckv.io.hf falls back to), so a
# conversion that drops it in either direction changes the rotation of every position and fails the parity.
THETA = 100.0


def test_parity_with_qwen3_for_causal_lm(tmp_path):
    transformers = pytest.importorskip("transformers")  # noqa: F841  (a dev dependency: always installed in CI)
    cfg = small_config(dict(kind="full"), n_kv_heads=2, tie_embeddings=False, rope_theta=THETA)
    model = Transformer(cfg).eval()
    hf = to_hf(model).eval()
    assert hf.config.rope_parameters["rope_theta"] == THETA
    ids = torch.randint(0, cfg.vocab_size, (2, 45))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5  # fp32, same op order: differences are rounding only
    back = from_hf(hf)
    save_hf(model, tmp_path)
    loaded = load_hf(tmp_path)
    assert back.config.rope_theta == loaded.config.rope_theta == THETA
    with torch.no_grad():
        assert torch.equal(back(ids), ours)
        assert torch.equal(loaded(ids), ours)


def test_parity_with_tied_embeddings():
    cfg = small_config(dict(kind="full"), tie_embeddings=True)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert (model(ids) - to_hf(model).eval()(ids).logits).abs().max().item() < 1e-5


def test_hf_config_without_rope_theta_is_refused():
    from types import SimpleNamespace

    from ckv.config import ConfigError
    from ckv.io.hf import from_hf_config

    with pytest.raises(ConfigError, match=r"no rope_parameters\['rope_theta'\]"):
        from_hf_config(SimpleNamespace(model_type="qwen3", rope_parameters={"rope_type": "default"}))


def test_compressed_model_has_no_hf_peer():
    from ckv.config import ConfigError

    with pytest.raises(ConfigError, match="full attention"):
        to_hf(Transformer(small_config(variant("w4s4"))))


def test_generate_matches_argmax_of_full_forward():
    cfg = small_config(variant("w4s4"))
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    out = model.generate(ids, max_new_tokens=11)
    assert out.shape == (2, 20)
    with torch.no_grad():
        for t in range(9, 20):
            assert torch.equal(model(out[:, :t])[:, -1].argmax(-1), out[:, t])


def test_generate_runs_the_lm_head_on_one_position_per_step():
    cfg = small_config(variant("w4s4"))
    model = Transformer(cfg).eval()
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    out = model.generate(torch.randint(0, cfg.vocab_size, (2, 17)), max_new_tokens=5)
    assert out.shape == (2, 22)
    # prefill of 17 tokens and 4 one-token steps (the 5th token needs no further forward): one position each
    assert seen == [(2, cfg.d_model)] * 5


def test_generate_stops_at_eos_and_pads_finished_rows_with_it():
    cfg = small_config(variant("w4s4"))
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    free = model.generate(ids, max_new_tokens=8)
    eos = int(free[0, 11])  # row 0 produces it by its 3rd new token at the latest
    out = model.generate(ids, max_new_tokens=8, eos_token_id=eos)
    ends = [9 + int((row[9:] == eos).nonzero()[0]) if (row[9:] == eos).any() else None for row in free]
    length = 17 if None in ends else max(ends) + 1  # decoding stops once every row has produced eos
    assert out.shape == (2, length)
    for r, end in enumerate(ends):  # rows decode independently; after its first eos a row repeats it
        stop = length if end is None else end + 1
        assert torch.equal(out[r, :stop], free[r, :stop]) and (out[r, stop:] == eos).all()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens=-1 must be an integer >= 0"),
        (dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be an integer"),
        (dict(max_new_tokens=True), "max_new_tokens=True must be an integer"),
        (dict(max_new_tokens=3, eos_token_id=64), r"eos_token_id=64 must be None or a token id in \[0, 64\)"),
        (dict(max_new_tokens=120), "plus max_new_tokens=120 exceeds model.max_seq_len=128"),
    ],
)
def test_generate_rejects_bad_arguments(kw, match):
    model = Transformer(small_config(variant("w4s4"))).eval()
    with pytest.raises(ValueError, match=match):
        model.generate(torch.zeros(1, 9, dtype=torch.long), **kw)


def test_generate_zero_new_tokens_returns_the_prompt():
    model = Transformer(small_config(variant("w4s4"))).eval()
    ids = torch.randint(0, 64, (2, 5))
    assert torch.equal(model.generate(ids, max_new_tokens=0), ids)


def test_attention_sinks_start_at_zero():
    """DeepSeek-V4 initialises its attention sinks to 0; reset_parameters does too (and draws the matrices)."""
    torch.manual_seed(0)
    model = Transformer(small_config(dict(kind="compressed", window=8, stride=4, sink=True)))
    sinks = [m.self_attn.sinks for m in model.layers]
    assert sinks and all(s is not None and torch.equal(s, torch.zeros_like(s)) for s in sinks)
    with torch.no_grad():
        for s in sinks:
            s.fill_(1.0)
    model.reset_parameters()
    assert all(torch.equal(s, torch.zeros_like(s)) for s in sinks)
    assert model.layers[0].self_attn.q_proj.weight.std() > 0


# ---- layer schedules ------------------------------------------------------------------------------------------------

OLD_CHECKPOINT = Path(__file__).parent / "io" / "old_checkpoint"


def scheduled_model() -> Transformer:
    """Four layers: sliding-only, two compressed W4/S4 (the model's attention), full."""
    cfg = small_config(
        dict(kind="compressed", window=4, stride=4, local_window=2),
        n_layers=4,
        layers=[
            {"count": 1, "attention": {"kind": "sliding", "sliding_window": 3}},
            {"count": 2},
            {"count": 1, "attention": {"kind": "full"}},
        ],
    )
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def test_a_scheduled_model_builds_each_layers_backend_and_decodes_as_it_prefills():
    model = scheduled_model()
    kinds = [type(block.self_attn).__name__ for block in model.layers]
    assert kinds == ["SlidingAttention", "CompressedAttention", "CompressedAttention", "FullAttention"]
    assert all(block.self_attn.config == model.config.layer_config(i) for i, block in enumerate(model.layers))
    ids = torch.randint(0, model.config.vocab_size, (2, 23))
    with torch.no_grad():
        whole = model(ids)
        cache, parts, s = model.new_cache(2), [], 0
        for n in (6, 1, 9, 7):
            parts.append(model(ids[:, s : s + n], cache))
            s += n
    assert (torch.cat(parts, dim=1) - whole).abs().max() < 1e-5
    assert model.generate(ids[:, :5], 4).shape == (2, 9)


def test_a_scheduled_model_saves_and_loads_its_schedule(tmp_path):
    from ckv.io.weights import load_weights, save_weights

    model = scheduled_model()
    save_weights(model, tmp_path / "w")
    loaded = load_weights(tmp_path / "w")
    assert loaded.config == model.config and loaded.config.layers is not None
    ids = torch.randint(0, model.config.vocab_size, (1, 17))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_a_checkpoint_written_before_schedules_loads_unchanged():
    """tests/io/old_checkpoint was written by ckv before layer schedules existed (a 2-layer compressed W4/S4 model,
    its config.json without ``layers``, and its logits on fixed ids): it loads as a uniform stack with the same
    parameter names and gives the same logits."""
    from safetensors.torch import load_file

    from ckv.io.weights import load_weights

    saved = json.loads((OLD_CHECKPOINT / "model" / "config.json").read_text())
    assert "layers" not in saved
    model = load_weights(OLD_CHECKPOINT / "model").eval()
    now = model.config.to_dict()
    assert model.config.layers is None and {k: v for k, v in now.items() if k != "attention"} == {
        k: v for k, v in saved.items() if k != "attention"
    }
    assert all(now["attention"][k] == v for k, v in saved["attention"].items())
    expected = load_file(str(OLD_CHECKPOINT / "logits.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(model(expected["input_ids"]), expected["logits"], atol=1e-6, rtol=1e-6)
