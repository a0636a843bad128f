"""Weight conversion between ckv's ``Transformer`` (full attention) and transformers' ``Qwen3ForCausalLM``.

ckv's module names follow Qwen3's, so conversion is a rename (``model.`` prefix) plus a config mapping; the
rope theta travels in ``Qwen3Config.rope_parameters``, which needs transformers >= 5.0 (4.x configs take
``rope_theta`` and would keep their default). Compressed-attention models have no HF peer: converting one
raises."""

from __future__ import annotations

import os
from typing import Any, Union

import torch

from ckv.config import AttentionConfig, ConfigError, ModelConfig
from ckv.model import Transformer
from ckv.options import RopeConfig


def _require_convertible(config: ModelConfig) -> None:
    a = config.attention
    if a.kind != "full" or a.rope != RopeConfig() or not a.qk_norm:
        raise ConfigError(
            "only full attention with Qwen3's RoPE (every dim, half pairing, model.rope_theta) and Q/K norm maps onto "
            f"Qwen3ForCausalLM; got attention.kind={a.kind!r}, rope={a.rope}, qk_norm={a.qk_norm}"
        )


def to_hf_config(config: ModelConfig) -> Any:
    """The ``Qwen3Config`` of a full-attention ckv config."""
    from transformers import Qwen3Config

    _require_convertible(config)
    return Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.mlp_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=False,
        use_sliding_window=False,
    )


def from_hf_config(hf_config: Any) -> ModelConfig:
    """The ckv config of a ``Qwen3Config`` (full attention)."""
    if getattr(hf_config, "model_type", None) != "qwen3":
        raise ConfigError(f"expected a qwen3 config, got model_type={getattr(hf_config, 'model_type', None)!r}")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope scaling {rope.get('rope_type')!r} is not supported by ckv")
    if "rope_theta" not in rope:
        raise ConfigError("the Qwen3 config has no rope_parameters['rope_theta'] (transformers >= 5.0 sets it)")
    theta = rope["rope_theta"]
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("attention biases and sliding-window layers are not supported by ckv")
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads,
        head_dim=hf_config.head_dim,
        mlp_dim=hf_config.intermediate_size,
        rope_theta=float(theta),
        max_seq_len=hf_config.max_position_embeddings,
        norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        attention=AttentionConfig(kind="full"),
    )


def to_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """ckv names -> Qwen3ForCausalLM names."""
    out = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in state.items()}
    if tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Qwen3ForCausalLM names -> ckv names."""
    out = {}
    for k, v in state.items():
        if k == "lm_head.weight":
            out[k] = v
        elif k.startswith("model."):
            out[k[len("model.") :]] = v
        elif not k.endswith("rotary_emb.inv_freq"):
            raise KeyError(f"unexpected Qwen3 weight {k!r}")
    if tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def to_hf(model: Transformer) -> Any:
    """A ``Qwen3ForCausalLM`` holding a copy of the weights of a full-attention ckv model."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(to_hf_config(model.config))
    missing, unexpected = hf.load_state_dict(
        to_hf_state_dict(model.state_dict(), model.config.tie_embeddings), strict=False
    )
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"conversion to Qwen3 left missing={missing}, unexpected={unexpected}")
    return hf.to(next(model.parameters()).dtype)


def from_hf(hf_model: Any) -> Transformer:
    """A ckv ``Transformer`` holding a copy of the weights of a ``Qwen3ForCausalLM``."""
    config = from_hf_config(hf_model.config)
    model = Transformer(config)
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), config.tie_embeddings))
    return model.to(next(hf_model.parameters()).dtype)


def save_hf(model: Transformer, directory: Union[str, os.PathLike]) -> None:
    """Write a full-attention ckv model as a transformers checkpoint (``save_pretrained``)."""
    to_hf(model).save_pretrained(str(directory))


def load_hf(directory: Union[str, os.PathLike]) -> Transformer:
    """Read a local Qwen3 transformers checkpoint into ckv (no download)."""
    from transformers import Qwen3ForCausalLM

    return from_hf(Qwen3ForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32))
