import dataclasses

import pytest
import torch

from ckv import AttentionConfig, ConfigError, ModelConfig, Transformer
from ckv.config import upgrade_attention


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kind="compressed", stride=0), "stride"),
        (dict(kind="compressed", window=4, stride=8), "window"),
        (dict(gate=dict(kind="matrix")), r"attention.gate.kind='matrix' is not allowed"),
        (dict(gate="max"), r"attention.gate='max' must be a mapping"),
        (dict(local_window=-1), "local_window"),
        (dict(local_window="head"), "local_window"),
        (dict(rope=dict(mode="partial")), r"attention.rope.mode='partial' needs attention.rope.dims"),
        (dict(rope=dict(mode="full", dims=8)), r"attention.rope.dims=8 is only used"),
        (dict(rope=None), r"attention.rope=None must be a mapping"),
        (dict(kv="shared"), "kv"),
        (dict(qk_norm="yes"), "qk_norm"),
        (dict(kind=""), "kind"),
        (dict(impl=None), "impl"),
    ],
)
def test_bad_attention_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AttentionConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_heads=6, n_kv_heads=4), "n_heads"),
        (dict(attention=dict(kv_heads=3)), "n_heads"),
        (dict(head_dim=15), "head_dim"),
        (dict(attention=dict(rope=dict(mode="partial", dims=7))), r"attention.rope.dims=7"),
        (dict(attention=dict(rope=dict(mode="partial", dims=32))), r"attention.rope.dims=32"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(rope_theta=float("inf")), "rope_theta"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(init_std="abc"), "init_std"),
        (dict(tie_embeddings=1), "tie_embeddings"),
        (dict(attention=dict(windw=8)), "windw"),
    ],
)
def test_bad_model_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_preset("tiny", **kwargs)


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="preset"):
        ModelConfig.from_preset("qwen9")
    with pytest.raises(ConfigError, match="n_layer"):
        ModelConfig.from_preset("tiny", n_layer=3)


def test_dict_roundtrip():
    c = ModelConfig.from_preset("tiny", attention=dict(kind="compressed", window=8, stride=4, local_window="tail"))
    assert ModelConfig.from_dict(c.to_dict()) == c
    grouped = dict(kind="compressed", window=8, stride=4, gate=None, mixing=dict(kernel=3), grid=dict(offsets=[0, 1]))
    c = ModelConfig.from_preset("tiny", attention=grouped)
    assert ModelConfig.from_dict(c.to_dict()) == c


# A weights config.json / run config.yaml written before the option groups (flat keys), and what it means now.
LEGACY = {
    "kind": "compressed",
    "window": 4,
    "stride": 4,
    "rope": "partial",
    "rope_dims": 8,
    "rope_side": "trailing",
    "rope_pairing": "interleaved",
    "rope_theta": 160000.0,
    "pooling": "gate",
    "gate": "vector",
    "gate_bias": False,
    "mixing": "conv",
    "mixing_kernel": 3,
    "grid_offsets": "stagger",
    "gate_entropy_floor": 0.5,
    "gate_entropy_weight": 0.1,
}


def test_a_config_from_before_the_option_groups_is_upgraded():
    attention, training = upgrade_attention(LEGACY)
    assert attention == {
        "kind": "compressed",
        "window": 4,
        "stride": 4,
        "rope": {"mode": "partial", "dims": 8, "side": "trailing", "pairing": "interleaved", "theta": 160000.0},
        "gate": {"kind": "vector", "bias": False},
        "mixing": {"kernel": 3},
        "grid": {"offsets": "stagger"},
    }
    assert training == {"gate_entropy": {"floor": 0.5, "weight": 0.1}}
    assert upgrade_attention(dict(LEGACY, pooling="mean"))[0]["gate"] is None
    assert upgrade_attention({"kind": "full", "rope": "none", "rope_dims": None})[0] == {
        "kind": "full",
        "rope": {"mode": "none", "dims": None},
        "gate": {"kind": "scalar", "bias": True},
        "mixing": None,
        "grid": None,
    }
    today = AttentionConfig.from_dict(attention).to_dict()
    assert upgrade_attention(today) == (today, {})  # today's shape passes through
    assert ModelConfig.from_preset("tiny", attention=LEGACY).attention == AttentionConfig.from_dict(attention)


@pytest.mark.parametrize("group", sorted(AttentionConfig.GROUPS))
def test_every_option_group_field_rejects_wrong_values_with_one_line_naming_it(group):
    """Generated from the group dataclasses, so a new field cannot escape: each field, given values of the wrong
    type or range, fails with one ConfigError line naming ``attention.<group>.<field>`` (never another error)."""
    cls = AttentionConfig.GROUPS[group]
    wrong = ["not-a-choice", -7, 2.5, True, [1.5], {"x": 1}]
    for f in dataclasses.fields(cls):
        rejected = 0
        for value in wrong:
            try:
                cls(**{f.name: value})
            except ConfigError as err:
                assert f"attention.{group}.{f.name}" in str(err) and "\n" not in str(err), (f.name, value, err)
                rejected += 1
        assert rejected >= len(wrong) - 1, f"attention.{group}.{f.name} accepts most wrong values"


def test_qwen3_06b_parameter_count():
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_preset("qwen3_0.6b"))
    assert model.num_parameters() == 596_049_920


@pytest.mark.parametrize(
    "ids, match",
    [
        (torch.tensor([[1, 2, 300]]), "token ids"),
        (torch.tensor([[-1, 2]]), "token ids"),
        (torch.zeros(1, 0, dtype=torch.long), "empty"),
        (torch.zeros(1, 513, dtype=torch.long), "max_seq_len"),
        (torch.zeros(3, dtype=torch.long), "batch"),
        (torch.zeros(1, 4), "integer"),
    ],
)
def test_bad_input_is_a_clear_error(ids, match):
    model = Transformer(ModelConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match=match):
        model(ids)
