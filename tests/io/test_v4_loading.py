"""``ckv.io.hf.attention_from_deepseek_v4``: transformers' DeepSeek-V4 attention layers (CSA with its lightning
indexer and top-k binding, HCA, YaRN) loaded into ckv's compressed attention, every weight copied, equal to
transformers' single forward in fp32 to 1e-5: in one forward, in chunked prefill and token by token through ckv's
cache (transformers' own chunked path is not the reference: where index scores tie its top-k depends on the tensor's
shape, docs/attention.md). A sliding-only layer loads into ckv's sliding attention, and a config's ``layer_types``
build a ckv layer schedule whose every layer matches transformers' of the same index."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ckv.attention.indexer import LightningIndexer, index_scores
from ckv.cache import CompressedLayerCache
from ckv.config import ConfigError
from ckv.io.hf import attention_from_deepseek_v4, deepseek_v4_model_config
from tests.helpers import CSA, HCA, V4_DIMS, randomise, tiny_v4_config

D_MODEL, TOPK = V4_DIMS[0], 2
TOL = 1e-5
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def v4_layer(layer_type: str, rope_parameters: dict | None = None, seed: int = 0) -> torch.nn.Module:
    """One randomised V4 attention layer: CSA at rate 4 with top-2 of its entries (8 index heads of 16 dims), or
    HCA at rate 8 (a short rate keeps the test fast; V4's is 128)."""
    torch.manual_seed(seed)
    cfg = tiny_v4_config(
        layer_type,
        index_topk=TOPK,
        index_n_heads=8,
        compress_rates={CSA: 4, HCA: 8},
        rope_parameters=rope_parameters,
        max_position_embeddings=64,
    )
    layer = v4.DeepseekV4Attention(cfg, 0).eval()
    randomise(layer)
    return layer


@torch.no_grad()
def v4_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' single forward of the layer over x (B, T, d) at positions 0.., with the model's masks."""
    B, T, _ = x.shape
    pos = torch.arange(T)[None].expand(B, -1)
    rotary = v4.DeepseekV4RotaryEmbedding(layer.config)
    embeddings = {t: rotary(x, position_ids=pos, layer_type=t) for t in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=layer.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos
    )
    return layer(x, embeddings, pos, mask)[0]


@torch.no_grad()
def in_chunks(module: torch.nn.Module, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    cache, parts, s = CompressedLayerCache(), [], 0
    for n in sizes:
        parts.append(module(x[:, s : s + n], cache))
        s += n
    assert s == x.shape[1]
    return torch.cat(parts, dim=1)


def selections(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's scores (``index_scores`` of the queries it returns and the keys it read) and top-k of one ckv
    forward over x (read by a forward hook)."""
    seen = []
    hook = module.indexer.register_forward_hook(lambda m, args, out: seen.append((args, out)))
    with torch.no_grad():
        module(x)
    hook.remove()
    (_, _, keys, _, q_start, stride), (queries, selected) = seen[0]
    return index_scores(queries, keys, q_start, stride), selected


CASES = [(CSA, None, 39), (HCA, None, 29), (CSA, YARN, 39)]  # lengths not multiples of the rate


@pytest.mark.parametrize("layer_type, rope, T", CASES, ids=["csa-topk", "hca", "csa-yarn"])
def test_loaded_layer_equals_transformers_in_one_forward_chunked_prefill_and_decoding(layer_type, rope, T):
    layer = v4_layer(layer_type, rope)
    module = attention_from_deepseek_v4(layer).eval()
    x = torch.randn(2, T, D_MODEL)
    ref = v4_forward(layer, x)
    assert ref.abs().max() > 1e-2
    with torch.no_grad():
        out = module(x)
    chunked = in_chunks(module, x, [7, 1, 5, 13, 2, T - 28])
    decoded = in_chunks(module, x, [1] * T)
    errors = [(o - ref).abs().max().item() for o in (out, chunked, decoded)]
    assert max(errors) <= TOL, errors
    if layer_type == CSA:  # top-k binds: most queries keep 2 of up to 9 visible entries, and no score ties there
        scores, selected = selections(module, x)
        visible = torch.isfinite(scores).sum(-1)  # (B, T)
        binding = visible > TOPK
        assert binding.float().mean() > 0.6 and selected.shape[-1] == TOPK
        ranked = scores.sort(-1, descending=True).values
        assert (ranked[..., TOPK - 1] > ranked[..., TOPK])[binding].all()  # the comparison does not hinge on ties
    if rope is not None:  # YaRN changed the frequencies (the scaled setting is exercised)
        default = v4_layer(layer_type).compressor.rotary_emb.compress_inv_freq
        assert not torch.allclose(module.rotary.inv_freq, default)


def test_the_selection_binds_and_matters():
    """With top-2 the loaded CSA layer differs from the same weights attending every entry (index_topk 1024)."""
    layer = v4_layer(CSA)
    sparse = attention_from_deepseek_v4(layer).eval()
    layer.config.index_topk = 1024
    layer.compressor.indexer.index_topk = 1024
    dense = attention_from_deepseek_v4(layer).eval()
    x = torch.randn(1, 39, D_MODEL)
    with torch.no_grad():
        assert (sparse(x) - dense(x)).abs().max() > 1e-3
        assert (dense(x) - v4_forward(layer, x)).abs().max() <= TOL
    assert isinstance(sparse.indexer, LightningIndexer) and sparse.indexer.topk == TOPK


def test_a_weight_without_a_ckv_counterpart_is_named():
    layer = v4_layer(CSA)
    layer.compressor.indexer.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"without a ckv counterpart: \['compressor.indexer.extra'\]"):
        attention_from_deepseek_v4(layer)


def test_a_layer_whose_weights_are_not_its_types_is_named():
    """A CSA layer relabelled sliding-only: its compressor's weights have no counterpart in ckv's sliding layer."""
    layer = v4_layer(CSA)
    layer.layer_type = SLIDING
    with pytest.raises(ConfigError, match=r"without a ckv counterpart: \['compressor\."):
        attention_from_deepseek_v4(layer)


SLIDING = "sliding_attention"
SCHEDULE = [SLIDING, CSA, CSA, HCA, SLIDING, HCA]  # every type, a run of two, and types that recur


def v4_model_config(layer_types: list[str]):  # -> transformers.DeepseekV4Config
    """A tiny DeepSeek-V4 config of several layers (rates and top-k as ``v4_layer``'s)."""
    return tiny_v4_config(
        SLIDING,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        index_topk=TOPK,
        index_n_heads=8,
        compress_rates={CSA: 4, HCA: 8},
        max_position_embeddings=64,
    )


@torch.no_grad()
def in_chunks_of(module: torch.nn.Module, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``module`` over x (B, T, d) fed in chunks of ``sizes`` through its own decode cache."""
    cache, parts, s = module.new_cache(x.shape[0]), [], 0
    for n in sizes:
        parts.append(module(x[:, s : s + n], cache))
        s += n
    assert s == x.shape[1]
    return torch.cat(parts, dim=1)


def test_a_sliding_only_layer_equals_transformers():
    """V4's sliding-only layer ("compress ratio 0"): ckv's sliding attention with V4's options (tied K=V, sinks,
    low-rank query, inverse output RoPE, the main rope) equals transformers' layer in one forward, in chunks and
    token by token, over more tokens than the window."""
    torch.manual_seed(0)
    layer = v4.DeepseekV4Attention(tiny_v4_config(SLIDING, max_position_embeddings=64), 0).eval()
    randomise(layer)
    module = attention_from_deepseek_v4(layer).eval()
    assert module.config.attention.kind == "sliding" and module.config.attention.sliding_window == V4_DIMS[4]
    T = 23
    x = torch.randn(2, T, D_MODEL)
    ref = v4_forward(layer, x)
    with torch.no_grad():
        out = module(x)
    errors = [
        (o - ref).abs().max().item()
        for o in (out, in_chunks_of(module, x, [7, 1, 5, 10]), in_chunks_of(module, x, [1] * T))
    ]
    assert ref.abs().max() > 1e-2 and max(errors) <= TOL, errors
    cache = module.new_cache(2)
    module(x, cache)
    assert cache.k.shape[1] == V4_DIMS[4] - 1 and cache.v is None  # the window's keys, once (K = V)


def test_layer_types_build_a_schedule_whose_every_layer_matches_transformers():
    """``deepseek_v4_model_config`` of a V4 config with sliding, CSA and HCA layers: one segment per run of equal
    types, and layer ``i`` of the ckv model built from it, given transformers' layer ``i``'s weights, equals that
    layer in one forward and token by token."""
    from ckv.attention import build_attention

    hf_config = v4_model_config(SCHEDULE)
    config = deepseek_v4_model_config(hf_config)
    assert [seg.count for seg in config.layers] == [1, 2, 1, 1, 1] and config.n_layers == len(SCHEDULE)
    assert config.attention == config.layer_attention(1)  # the model's attention: its first compressed layer's
    kinds = {SLIDING: "sliding", CSA: "compressed", HCA: "compressed"}
    x = torch.randn(2, 21, D_MODEL)
    torch.manual_seed(1)
    for i, layer_type in enumerate(SCHEDULE):
        layer = v4.DeepseekV4Attention(hf_config, i).eval()
        randomise(layer)
        loaded = attention_from_deepseek_v4(layer)
        attention = config.layer_attention(i)
        assert attention == loaded.config.attention and attention.kind == kinds[layer_type]
        own = build_attention(config, i).eval()  # the schedule's layer i, as the model builds it
        own.load_state_dict(loaded.state_dict())
        ref = v4_forward(layer, x)
        with torch.no_grad():
            errors = [(o - ref).abs().max().item() for o in (own(x), in_chunks_of(own, x, [1] * x.shape[1]))]
        assert ref.abs().max() > 1e-2 and max(errors) <= TOL, (i, layer_type, errors)


@pytest.mark.parametrize(
    "hf_config, message",
    [
        (
            {"model_type": "deepseek_v41"},
            r"model_type='deepseek_v41' needs transformers' DeepseekV41Config, which transformers \S+ does not have",
        ),
        ({"model_type": "qwen3"}, r"model_type='qwen3' has no ckv mapping: ckv maps model_type 'deepseek_v4' only"),
    ],
)
def test_a_config_of_a_model_type_ckv_cannot_map_is_one_line(hf_config, message):
    import transformers

    assert not hasattr(transformers, "DeepseekV41Config")  # the lock's transformers (5.25) has no V4.1 class
    with pytest.raises(ConfigError, match=message) as e:
        deepseek_v4_model_config(hf_config)
    assert "\n" not in str(e.value)


def main() -> None:
    """Print the parity figures of docs/attention.md: max |ckv - transformers| per case and path."""
    heads = ("one forward", "chunked", "token by token")
    print(f"{'case':8s} {'T':>3s} {'max|out|':>9s}  " + "  ".join(f"{h:>14s}" for h in heads))
    for (layer_type, rope, T), name in zip(CASES, ("csa-topk", "hca", "csa-yarn")):
        layer = v4_layer(layer_type, rope)
        module = attention_from_deepseek_v4(layer).eval()
        x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(0))
        ref = v4_forward(layer, x)
        with torch.no_grad():
            paths = (module(x), in_chunks(module, x, [7, 1, 5, 13, 2, T - 28]), in_chunks(module, x, [1] * T))
        errors = "  ".join(f"{(o - ref).abs().max().item():14.1e}" for o in paths)
        print(f"{name:8s} {T:3d} {ref.abs().max().item():9.2f}  {errors}")


if __name__ == "__main__":
    main()
