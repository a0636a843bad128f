"""Weight conversion between ckv and transformers.

- ckv's ``Transformer`` (full attention) and transformers' ``Qwen3ForCausalLM``: ckv's module names follow Qwen3's,
  so conversion is a rename (``model.`` prefix) plus a config mapping; the rope theta travels in
  ``Qwen3Config.rope_parameters``, which needs transformers >= 5.0 (4.x configs take ``rope_theta`` and would keep
  their default). Compressed-attention models have no HF model peer: converting one raises.
- One attention layer of transformers' DeepSeek-V4 (CSA or HCA into ckv's compressed attention, a sliding-only
  layer into ckv's sliding attention: ``attention_from_deepseek_v4``), every weight copied; a whole
  ``DeepseekV4Config``'s ``layer_types`` into a ckv layer schedule (``deepseek_v4_model_config``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ckv.attention import AttentionBackend, CompressedAttention, build_attention, compressed_layers
from ckv.config import AttentionConfig, ConfigError, ModelConfig
from ckv.io.atomic import umask_mode
from ckv.model import Transformer
from ckv.options import RopeConfig


def _require_convertible(config: ModelConfig) -> None:
    for i in range(config.n_layers):  # every layer of a layer schedule
        a = config.layer_attention(i)
        if a.kind != "full" or a.rope != RopeConfig() or not a.qk_norm:
            where = "attention" if config.layers is None else f"layer {i}'s attention"
            raise ConfigError(
                "only full attention with Qwen3's RoPE (every dim, half pairing, model.rope_theta) and Q/K norm maps "
                f"onto Qwen3ForCausalLM; got {where}: kind={a.kind!r}, rope={a.rope}, qk_norm={a.qk_norm}"
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
    """Write a full-attention ckv model as a transformers checkpoint (``save_pretrained``), its weights with the
    umask's mode like its other files (safetensors writes them 0600)."""
    to_hf(model).save_pretrained(str(directory))
    for weights in Path(directory).glob("*.safetensors"):
        umask_mode(weights)


def load_hf(directory: Union[str, os.PathLike]) -> Transformer:
    """Read a local Qwen3 transformers checkpoint into ckv (no download)."""
    from transformers import Qwen3ForCausalLM

    return from_hf(Qwen3ForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32))


# transformers' DeepSeek-V4 layer types: two with a compressor (ckv's compressed attention) and the sliding-only one
# (ckv's sliding attention, V4's "compress ratio 0")
_V4_CSA, _V4_HCA, _V4_SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_V4_TYPES = (_V4_SLIDING, _V4_CSA, _V4_HCA)

# the model types of DeepSeek's V4 family that ckv knows, and the transformers class each needs
_V4_MODEL_TYPES = {"deepseek_v4": "DeepseekV4Config", "deepseek_v41": "DeepseekV41Config"}


def _v4_rope(c: Any, which: str) -> dict[str, Any]:
    """ckv's ``attention.rope`` for V4's rope setting ``which`` (``rope_parameters['main']`` of the sliding-only
    layers, ``['compress']`` of CSA/HCA): partial, trailing, interleaved dims at its theta, YaRN when it has it."""
    rope, rope_dims = c.rope_parameters[which], int(c.head_dim * c.partial_rotary_factor)
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise ConfigError(f"rope_parameters[{which!r}]['rope_type']={kind!r}: ckv has default RoPE and YaRN only")
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
    return {
        "mode": "partial" if partial else "full",
        "dims": rope_dims if partial else None,
        "side": "trailing",
        "pairing": "interleaved",
        "theta": float(rope["rope_theta"]),
        "yarn": yarn,
    }


def _v4_attention(c: Any, layer_type: str) -> dict[str, Any]:
    """ckv's attention mapping of a DeepSeek-V4 layer of ``layer_type`` under the config ``c``."""
    if layer_type not in _V4_TYPES:
        raise ConfigError(f"DeepSeek-V4 layer type {layer_type!r} is unknown to ckv; it maps {list(_V4_TYPES)}")
    if getattr(c, "num_key_value_heads", 1) != 1:
        raise ConfigError(
            f"DeepSeek-V4 attention has one shared K=V head; got num_key_value_heads={c.num_key_value_heads}"
        )
    v4 = {"kind": "sliding", "kv_heads": 1, "qk_norm": True, "kv": "tied", "sink": True, "output_rope": "inverse"}
    v4["query"] = {"lora_rank": c.q_lora_rank}
    if layer_type == _V4_SLIDING:
        return {**v4, "rope": _v4_rope(c, "main"), "sliding_window": c.sliding_window}
    csa, rate = layer_type == _V4_CSA, c.compress_rates[layer_type]
    return {
        **v4,
        "kind": "compressed",
        "rope": _v4_rope(c, "compress"),
        "window": 2 * rate if csa else rate,
        "stride": rate,
        "local_window": c.sliding_window,
        "gate": {"kind": "vector", "bias": True},
        "offset_maps": "series" if csa else "shared",
        "compressed_norm": "post",
        "entry_rope_position": "block_start",
        "selection": {"topk": c.index_topk, "heads": c.index_n_heads, "head_dim": c.index_head_dim} if csa else None,
    }


def _v4_model(c: Any, n_layers: int, attention: dict[str, Any], layers: Optional[list] = None) -> ModelConfig:
    return ModelConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=n_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=1,
        head_dim=c.head_dim,
        mlp_dim=c.moe_intermediate_size,
        rope_theta=float(c.rope_theta),
        max_seq_len=c.max_position_embeddings,
        norm_eps=c.rms_norm_eps,
        attention=attention,
        layers=layers,
    )


def deepseek_v4_attention_config(hf_config: Any, layer_type: str) -> ModelConfig:
    """The ckv config of one DeepSeek-V4 attention layer of ``layer_type`` under ``hf_config`` (a
    ``DeepseekV4Config``), ``n_layers`` 1. CSA and HCA: ckv's ``deepseek_v4_csa``/``deepseek_v4_hca`` design at the
    config's sizes, window ``2 * rate`` (CSA, two series) or ``rate`` (HCA, shared maps), its sliding window as the
    local window, the compress rope (theta, partial dims, YaRN), and for CSA the lightning indexer. Sliding-only:
    ckv's ``kind: sliding`` at the config's ``sliding_window`` with the main rope. Every type: one K=V head, the
    low-rank query path, per-head sinks, the output rotated back (``output_rope: inverse``)."""
    return _v4_model(hf_config, 1, _v4_attention(hf_config, layer_type))


def check_deepseek_v4_model_type(hf_config: Any) -> None:
    """ConfigError unless ``hf_config`` (a transformers config or its ``config.json`` mapping) is a DeepSeek-V4 one;
    a DeepSeek-V4.1 config names the transformers class it needs and the installed transformers' version."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", None)
    if model_type == "deepseek_v4":
        return
    if model_type in _V4_MODEL_TYPES:
        import transformers

        cls = _V4_MODEL_TYPES[model_type]
        if not hasattr(transformers, cls):
            raise ConfigError(
                f"model_type={model_type!r} needs transformers' {cls}, which transformers {transformers.__version__} "
                "does not have: ckv maps model_type 'deepseek_v4' (DeepseekV4Config) only"
            )
    raise ConfigError(f"model_type={model_type!r} has no ckv mapping: ckv maps model_type 'deepseek_v4' only")


def deepseek_v4_model_config(hf_config: Any) -> ModelConfig:
    """The ckv config of a whole ``DeepseekV4Config``'s attention: a layer schedule (``model.layers``) with one
    segment per run of equal ``layer_types``, each layer's attention ``deepseek_v4_attention_config``'s, so that
    layer ``i`` of the schedule is transformers' layer ``i`` (``attention_from_deepseek_v4`` of it has the same
    attention config); the model's ``attention`` is its first compressed layer's. V4's MoE feed-forward and
    hyper-connections have no ckv counterpart: ``mlp_dim`` is one expert's width, and only the attention layers
    convert. A config of another model type is a ConfigError (``check_deepseek_v4_model_type``)."""
    check_deepseek_v4_model_type(hf_config)
    types = list(hf_config.layer_types)
    if len(types) != hf_config.num_hidden_layers:
        raise ConfigError(
            f"layer_types has {len(types)} entries but num_hidden_layers={hf_config.num_hidden_layers}: transformers' "
            "config gives one type per layer"
        )
    segments: list[dict[str, Any]] = []
    for i, layer_type in enumerate(types):
        if i and layer_type == types[i - 1]:
            segments[-1]["count"] += 1
        else:
            segments.append({"count": 1, "attention": _v4_attention(hf_config, layer_type)})
    # the model's own attention (what reads one config for the whole model sees, e.g. its phase stride): the first
    # compressed layer's; every segment states its own
    compressed = [seg["attention"] for seg in segments if seg["attention"]["kind"] == "compressed"]
    return _v4_model(hf_config, len(types), (compressed or [segments[0]["attention"]])[0], segments)


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


def attention_from_deepseek_v4(layer: Any) -> AttentionBackend:
    """ckv's attention equal to transformers' ``DeepseekV4Attention`` ``layer``, every weight copied: compressed
    attention for CSA and HCA, sliding attention for a sliding-only layer; ``forward(x, cache=None)`` as every ckv
    backend, positions from 0.

    The config is ``deepseek_v4_attention_config``'s. V4's query path (``q_a_proj``, ``q_a_norm``, ``q_b_proj``)
    maps onto ``attention.query`` (its unweighted ``q_b_norm`` onto ckv's per-head query norm with gain 1), the raw
    K=V map and its norm onto ``k_proj``/``k_norm``, the compressor and the indexer's compressor onto ckv's
    ``Compressor`` layout (``_v4_compressor``), the indexer's ``q_b_proj`` and ``weights_proj`` onto the
    ``LightningIndexer``'s maps, the sinks onto ``sinks``. V4's grouped low-rank output projection (``o_a_proj``,
    block-diagonal over ``o_groups`` groups of heads, then ``o_b_proj``) is linear: ckv's ``o_proj`` holds its
    product. Every parameter and persistent buffer of ``layer`` is used (one left over is a ConfigError naming it),
    and the layer's rope frequencies (compress rope: CSA/HCA; main rope: sliding) must equal ckv's."""
    if type(layer).__name__ != "DeepseekV4Attention":
        raise ConfigError(f"expected transformers' DeepseekV4Attention, got {type(layer).__name__}")
    cfg = deepseek_v4_attention_config(layer.config, layer.layer_type)
    csa = layer.layer_type == _V4_CSA
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
    }
    ckv_layer = build_attention(cfg, 0)
    if layer.layer_type == _V4_SLIDING:
        rotary = _v4_rotary(layer.config)
        inv_freq, scaling = rotary.main_inv_freq, rotary.main_attention_scaling
    else:
        compressed = compressed_layers(ckv_layer)[0]  # the layer itself, as a CompressedAttention
        mapped.update(_v4_compressor_weights(compressed, state, used, cfg.attention.stride, csa))
        rotary = layer.compressor.rotary_emb
        inv_freq, scaling = rotary.compress_inv_freq, rotary.compress_attention_scaling
    left = sorted(set(state) - used)
    if left:
        raise ConfigError(f"DeepSeek-V4 weights without a ckv counterpart: {left}")
    ckv_layer.load_state_dict(mapped, strict=True)
    if scaling != 1.0 or not torch.allclose(ckv_layer.rotary.inv_freq, inv_freq.float().cpu(), rtol=1e-6, atol=0.0):
        raise ConfigError("the layer's rope frequencies or attention scaling differ from ckv's RoPE")
    weight = layer.q_a_proj.weight
    return ckv_layer.to(device=weight.device, dtype=weight.dtype).train(layer.training)


def _v4_rotary(hf_config: Any) -> Any:
    """transformers' DeepSeek-V4 rotary embedding of ``hf_config`` (its ``main`` and ``compress`` frequencies)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    return DeepseekV4RotaryEmbedding(hf_config)


def _v4_compressor_weights(
    compressed: CompressedAttention, state: dict[str, torch.Tensor], used: set[str], stride: int, csa: bool
) -> dict[str, torch.Tensor]:
    """The compressed layer ``compressed``'s compressor weights (and for CSA the lightning indexer's) by their ckv
    names, from the V4 layer's ``state``; the V4 names read are added to ``used``."""
    S, mapped = stride, {}
    key = {id(p): name for name, p in compressed.named_parameters()}  # each parameter's name in the state dict
    used.add("compressor.kv_norm.weight")
    mapped["ck_norm.weight"] = state["compressor.kv_norm.weight"]
    branches = {"compressor.": compressed.compressors()["K"]}
    if csa:
        branches["compressor.indexer."] = compressed.indexer.compressor
    for prefix, compressor in branches.items():
        for name in ("kv_proj.weight", "gate_proj.weight", "position_bias"):
            used.add(prefix + name)
        targets = (compressor.payload, compressor.gate.weight, compressor.gate.bias)
        mapped.update({key[id(p)]: v for p, v in zip(targets, _v4_compressor(state, prefix, S, 2 if csa else 1))})
    if csa:
        for ckv_name, v4_name in (
            ("indexer.norm.weight", "compressor.indexer.kv_norm.weight"),
            ("indexer.q_proj.weight", "compressor.indexer.q_b_proj.weight"),
            ("indexer.weights_proj.weight", "compressor.indexer.scorer.weights_proj.weight"),
        ):
            used.add(v4_name)
            mapped[ckv_name] = state[v4_name]
    return mapped
