"""Weight conversion between ckv and transformers.

- ckv's ``Transformer`` (full attention) and transformers' ``Qwen3ForCausalLM``: ckv's module names follow Qwen3's,
  so conversion is a rename (``model.`` prefix) plus a config mapping; the rope theta travels in
  ``Qwen3Config.rope_parameters``, which needs transformers >= 5.0 (4.x configs take ``rope_theta`` and would keep
  their default). Compressed-attention models have no HF model peer: converting one raises.
- One attention layer of transformers' DeepSeek-V4 (CSA or HCA) into ckv's compressed attention
  (``attention_from_deepseek_v4``), every weight copied."""

from __future__ import annotations

import os
from typing import Any, Union

import torch

from ckv.attention import CompressedAttention, build_attention, compressed_layers
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


# transformers' DeepSeek-V4 layer types with a compressor, and the ckv attention each one is
_V4_CSA, _V4_HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def deepseek_v4_attention_config(hf_config: Any, layer_type: str) -> ModelConfig:
    """The ckv config of one DeepSeek-V4 attention layer of ``layer_type`` (CSA or HCA) under ``hf_config``
    (a ``DeepseekV4Config``): ckv's ``deepseek_v4_csa``/``deepseek_v4_hca`` design at the config's sizes, window
    ``2 * rate`` (CSA, two series) or ``rate`` (HCA, shared maps), its sliding window, the compress rope (theta,
    partial dims, YaRN), the low-rank query path and, for CSA, the lightning indexer. ``n_layers`` is 1."""
    if layer_type not in (_V4_CSA, _V4_HCA):
        raise ConfigError(
            f"layer type {layer_type!r} has no compressor: only {_V4_CSA!r} and {_V4_HCA!r} map onto ckv's "
            "compressed attention"
        )
    c, csa = hf_config, layer_type == _V4_CSA
    if getattr(c, "num_key_value_heads", 1) != 1:
        raise ConfigError(
            f"DeepSeek-V4 attention has one shared K=V head; got num_key_value_heads={c.num_key_value_heads}"
        )
    rate, rope = c.compress_rates[layer_type], c.rope_parameters["compress"]
    rope_dims = int(c.head_dim * c.partial_rotary_factor)
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise ConfigError(f"rope_parameters['compress']['rope_type']={kind!r}: ckv has default RoPE and YaRN only")
    yarn = None
    if kind == "yarn":
        if rope.get("attention_factor") != 1.0 or rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ConfigError(
                "ckv's YaRN scales frequencies only (V4's attention_factor 1); got attention_factor="
                f"{rope.get('attention_factor')!r}, mscale={rope.get('mscale')!r}, "
                f"mscale_all_dim={rope.get('mscale_all_dim')!r}"
            )
        yarn = {
            "factor": float(rope["factor"]),
            "original_max_positions": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32),
            "beta_slow": float(rope.get("beta_slow") or 1),
        }
    partial = rope_dims < c.head_dim
    attention = {
        "kind": "compressed",
        "kv_heads": 1,
        "qk_norm": True,
        "rope": {
            "mode": "partial" if partial else "full",
            "dims": rope_dims if partial else None,
            "side": "trailing",
            "pairing": "interleaved",
            "theta": float(rope["rope_theta"]),
            "yarn": yarn,
        },
        "window": 2 * rate if csa else rate,
        "stride": rate,
        "local_window": c.sliding_window,
        "gate": {"kind": "vector", "bias": True},
        "offset_maps": "series" if csa else "shared",
        "kv": "tied",
        "compressed_norm": "post",
        "entry_rope_position": "block_start",
        "sink": True,
        "output_rope": "inverse",
        "query": {"lora_rank": c.q_lora_rank},
        "selection": {"topk": c.index_topk, "heads": c.index_n_heads, "head_dim": c.index_head_dim} if csa else None,
    }
    return ModelConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=1,
        n_heads=c.num_attention_heads,
        n_kv_heads=1,
        head_dim=c.head_dim,
        mlp_dim=c.moe_intermediate_size,
        rope_theta=float(c.rope_theta),
        max_seq_len=c.max_position_embeddings,
        norm_eps=c.rms_norm_eps,
        attention=attention,
    )


def _v4_compressor(
    state: dict[str, torch.Tensor], prefix: str, stride: int, series: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A V4 compressor's maps and position bias in ckv's ``Compressor`` layout: its ``payload``, ``gate.weight`` and
    ``gate.bias``. V4 stacks the series along the output (``kv_proj``/``gate_proj`` (series * D, d),
    ``position_bias`` (stride, series * D)); ckv holds one map per series (series, d, D) (one (d, D) map for a single
    series) and a bias per offset ``series * stride + r``."""
    maps = []
    for name in ("kv_proj.weight", "gate_proj.weight"):
        w = state[prefix + name]
        D = w.shape[0] // series
        w = w.view(series, D, -1).transpose(1, 2)  # (series, d, D)
        maps.append(w if series > 1 else w[0])
    bias = state[prefix + "position_bias"]
    return maps[0], maps[1], bias.view(stride, series, -1).transpose(0, 1).reshape(series * stride, -1)


def attention_from_deepseek_v4(layer: Any) -> CompressedAttention:
    """ckv's compressed attention equal to transformers' ``DeepseekV4Attention`` ``layer`` (CSA or HCA), every
    weight copied: ``forward(x, cache=None)`` as every ckv backend, positions from 0.

    The config is ``deepseek_v4_attention_config``'s. V4's query path (``q_a_proj``, ``q_a_norm``, ``q_b_proj``)
    maps onto ``attention.query`` (its unweighted ``q_b_norm`` onto ckv's per-head query norm with gain 1), the raw
    K=V map and its norm onto ``k_proj``/``k_norm``, the compressor and the indexer's compressor onto ckv's
    ``Compressor`` layout (``_v4_compressor``), the indexer's ``q_b_proj`` and ``weights_proj`` onto the
    ``LightningIndexer``'s maps, the sinks onto ``sinks``. V4's grouped low-rank output projection (``o_a_proj``,
    block-diagonal over ``o_groups`` groups of heads, then ``o_b_proj``) is linear: ckv's ``o_proj`` holds its
    product. Every parameter and persistent buffer of ``layer`` is used (one left over is a ConfigError naming it),
    and the layer's compress-rope frequencies must equal ckv's (theta, partial dims, YaRN)."""
    if type(layer).__name__ != "DeepseekV4Attention":
        raise ConfigError(f"expected transformers' DeepseekV4Attention, got {type(layer).__name__}")
    cfg = deepseek_v4_attention_config(layer.config, layer.layer_type)
    csa, S = layer.layer_type == _V4_CSA, cfg.attention.stride
    state = {k: v.detach().float() for k, v in layer.state_dict().items()}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return state[name]

    o_a, o_b = take("o_a_proj.weight"), take("o_b_proj.weight")  # (g * r, H * D / g), (d, g * r)
    groups = layer.config.o_groups
    mapped = {
        "q_latent.proj.weight": take("q_a_proj.weight"),
        "q_latent.norm.weight": take("q_a_norm.weight"),
        "q_proj.weight": take("q_b_proj.weight"),
        "q_norm.weight": torch.ones(cfg.head_dim),  # V4's q_b_norm has no gain
        "k_proj.weight": take("kv_proj.weight"),
        "k_norm.weight": take("kv_norm.weight"),
        "o_proj.weight": o_b @ torch.block_diag(*o_a.view(groups, -1, o_a.shape[-1])),  # (d, H * D)
        "sinks": take("sinks"),
        "ck_norm.weight": take("compressor.kv_norm.weight"),
    }
    series = 2 if csa else 1
    module = compressed_layers(build_attention(cfg, 0))[0]  # the layer itself, as a CompressedAttention
    key = {id(p): name for name, p in module.named_parameters()}  # each parameter's name in the state dict
    branches = {"compressor.": module.compressors()["K"]}
    if csa:
        branches["compressor.indexer."] = module.indexer.compressor
    for prefix, compressor in branches.items():
        for name in ("kv_proj.weight", "gate_proj.weight", "position_bias"):
            used.add(prefix + name)
        targets = (compressor.payload, compressor.gate.weight, compressor.gate.bias)
        mapped.update({key[id(p)]: v for p, v in zip(targets, _v4_compressor(state, prefix, S, series))})
    if csa:
        mapped["indexer.norm.weight"] = take("compressor.indexer.kv_norm.weight")
        mapped["indexer.q_proj.weight"] = take("compressor.indexer.q_b_proj.weight")
        mapped["indexer.weights_proj.weight"] = take("compressor.indexer.scorer.weights_proj.weight")
    left = sorted(set(state) - used)
    if left:
        raise ConfigError(f"DeepSeek-V4 weights without a ckv counterpart: {left}")
    module.load_state_dict(mapped, strict=True)
    rotary = layer.compressor.rotary_emb
    if rotary.compress_attention_scaling != 1.0 or not torch.allclose(
        module.rotary.inv_freq, rotary.compress_inv_freq.float().cpu(), rtol=1e-6, atol=0.0
    ):
        raise ConfigError("the layer's compress-rope frequencies or attention scaling differ from ckv's RoPE")
    weight = layer.q_a_proj.weight
    return module.to(device=weight.device, dtype=weight.dtype).train(layer.training)
