import pytest
import torch

from ckv import AttentionConfig, ConfigError, ModelConfig, Transformer


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kind="compressed", stride=0), "stride"),
        (dict(kind="compressed", window=4, stride=8), "window"),
        (dict(pooling="max"), "pooling"),
        (dict(gate="matrix"), "gate"),
        (dict(local_window=-1), "local_window"),
        (dict(local_window="head"), "local_window"),
        (dict(rope="partial"), "rope_dims"),
        (dict(rope="full", rope_dims=8), "rope_dims"),
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
        (dict(attention=dict(rope="partial", rope_dims=7)), "rope_dims"),
        (dict(attention=dict(rope="partial", rope_dims=32)), "rope_dims"),
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
