import pytest
import torch

from ckv import AttentionConfig, ConfigError, ModelConfig, Transformer
from ckv.attention import CompressedAttentionConfig
from ckv.config import saved_attention, upgrade_attention


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kind="compressed", stride=0), "stride"),
        (dict(kind="compressed", window=4, stride=8), "window"),
        (dict(kind="compressed", local_window=-1), "local_window"),
        (dict(kind="compressed", local_window="head"), "local_window"),
        (dict(kind="compressed", kv="shared"), "kv"),
        (dict(qk_norm="yes"), "qk_norm"),
        (dict(kind=""), "kind"),
        (
            dict(kind="sparse"),
            r"attention.kind='sparse' has no registered backend; available: \['compressed', 'full', 'sliding'\]",
        ),
        (dict(impl=None), "impl"),
    ],
)
def test_bad_attention_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AttentionConfig.from_dict(kwargs)


@pytest.mark.parametrize(
    "attention, message",
    [
        (dict(window=4), "attention.window is not a field of attention.kind='full'"),
        (
            dict(window=4, stride=2, kv="tied"),
            "attention.kv, attention.stride, attention.window are not fields of attention.kind='full'",
        ),
        (dict(mixing=dict(kernel=2)), "attention.mixing is not a field of attention.kind='full'"),
        (dict(selection=dict()), "attention.selection is not a field of attention.kind='full'"),
        (dict(query=dict()), "attention.query is not a field of attention.kind='full'"),
        (dict(kind="compressed", windw=8), "attention.windw is not a field of attention.kind='compressed'"),
    ],
)
def test_a_field_the_kind_does_not_take_is_one_line_naming_it_and_the_kind(attention, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_preset("tiny", attention=attention)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert "; it takes [" in str(err.value)


def test_each_kind_builds_its_own_config_class():
    full = AttentionConfig.from_dict({"kind": "full"})
    compressed = AttentionConfig.from_dict({"kind": "compressed", "stride": 4})
    assert type(full) is AttentionConfig and type(compressed) is CompressedAttentionConfig
    assert (compressed.window, compressed.stride) == (8, 4)  # the compressor's defaults
    assert CompressedAttentionConfig.from_dict({}).kind == "compressed"  # a class's own kind when none is given
    with pytest.raises(ConfigError, match="attention.kind='full' is configured by AttentionConfig"):
        CompressedAttentionConfig(kind="full")


def test_a_saved_config_drops_the_fields_of_the_one_config_of_before_that_its_kind_does_not_take():
    """A weights config.json saved while one AttentionConfig held every kind's fields carries the compressor's
    (any values: the model ignored them); loading it drops them, and only them."""
    saved = {"kind": "full", "window": 4, "local_window": 4, "gate": {"kind": "scalar", "bias": True}, "query": None}
    assert saved_attention(saved) == ({"kind": "full"}, {})
    assert ModelConfig.from_dict({**ModelConfig().to_dict(), "attention": saved}) == ModelConfig()
    assert saved_attention({"kind": "compressed", "window": 4}) == ({"kind": "compressed", "window": 4}, {})
    with pytest.raises(ConfigError, match="attention.windw is not a field of attention.kind='full'"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "attention": {"kind": "full", "windw": 4}})
    with pytest.raises(
        ConfigError, match="attention.gate, attention.local_window, attention.query, attention.window are"
    ):
        AttentionConfig.from_dict(saved)  # a config built now refuses them


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
    assert saved_attention({"kind": "full", "rope": "none", "rope_dims": None})[0] == {
        "kind": "full",
        "rope": {"mode": "none", "dims": None},
    }
    today = AttentionConfig.from_dict(attention).to_dict()
    assert upgrade_attention(today) == (today, {})  # today's shape passes through
    assert ModelConfig.from_preset("tiny", attention=LEGACY).attention == AttentionConfig.from_dict(attention)


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


# ---- layer schedules (model.layers) ---------------------------------------------------------------------------------

SLIDING = {"kind": "sliding", "sliding_window": 4}
W4S4 = {"kind": "compressed", "window": 4, "stride": 4, "local_window": 2}


def scheduled(layers, n_layers: int = 4, attention=W4S4) -> ModelConfig:
    return ModelConfig(n_layers=n_layers, attention=attention, layers=layers)


def test_a_schedule_gives_each_layer_its_segments_attention():
    """Segments in order; one without ``attention`` takes the model's."""
    cfg = scheduled([{"count": 1, "attention": SLIDING}, {"count": 2}, {"count": 1, "attention": {"kind": "full"}}])
    kinds = [cfg.layer_attention(i).kind for i in range(4)]
    assert kinds == ["sliding", "compressed", "compressed", "full"]
    assert cfg.layer_attention(1) == cfg.attention and cfg.layer_attention(0).sliding_window == 4
    layer = cfg.layer_config(3)
    assert layer.layers is None and layer.attention.kind == "full" and layer.n_layers == 4


def test_without_a_schedule_every_layer_is_the_model_itself():
    cfg = ModelConfig(n_layers=3, attention=W4S4)
    assert all(cfg.layer_config(i) is cfg for i in range(3))
    assert "layers" not in cfg.to_dict()  # a uniform model saves the config.json of before schedules
    with pytest.raises(IndexError, match="layer 3 is not one of the model's 3 layers"):
        cfg.layer_attention(3)


def test_a_schedule_round_trips_through_its_saved_dict():
    cfg = scheduled([{"count": 2, "attention": SLIDING}, {"count": 2}])
    saved = cfg.to_dict()
    assert [seg["count"] for seg in saved["layers"]] == [2, 2] and saved["layers"][0]["attention"]["kind"] == "sliding"
    assert ModelConfig.from_dict(saved) == cfg
    assert ModelConfig.from_dict(saved).to_dict() == saved


def test_a_schedule_from_before_the_option_groups_is_upgraded_segment_by_segment():
    """A saved segment's attention goes through ``saved_attention`` as the model's does (flat ``rope_dims`` ...)."""
    cfg = scheduled([{"count": 1, "attention": SLIDING}, {"count": 3}])
    saved = cfg.to_dict()
    saved["layers"][1]["attention"] = {"kind": "compressed", "window": 4, "stride": 4, "local_window": 2,
                                       "rope": "partial", "rope_dims": 4}  # fmt: skip
    assert ModelConfig.from_dict(saved).layer_attention(1).rope.dims == 4


@pytest.mark.parametrize(
    "layers, message",
    [
        (
            [{"count": 1, "attention": SLIDING}, {"count": 2}],
            r"model.layers counts \[1, 2\] add up to 3 layers, not model.n_layers=4: make the segment counts add up "
            r"to n_layers \(or set model.layers=null for a uniform stack\)",
        ),
        ([{"attention": SLIDING}], r"model.layers\[0\]=.* needs a 'count'"),
        ([{"count": 4, "atention": SLIDING}], r"model.layers\[0\]"),
        ([{"count": 0}, {"count": 4}], "model.layers\\[\\].count=0"),
        ("sliding", "model.layers='sliding' must be null .* or a list of \\{count, attention\\} segments"),
        ([{"count": 4, "attention": {"kind": "sliding", "window": 4}}], "attention.window is not a field of"),
        (
            [{"count": 4, "attention": {**W4S4, "kv_heads": 3}}],
            "model.n_heads=4 is not divisible by attention.kv_heads=3",
        ),
        ([4], r"model.layers\[0\]=4 must be a mapping"),
    ],
)
def test_a_bad_schedule_is_one_line(layers, message):
    with pytest.raises(ConfigError, match=message) as e:
        scheduled(layers)
    assert "\n" not in str(e.value)
