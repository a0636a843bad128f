"""``ckv.io.hf.attention_from_deepseek_v4``: transformers' DeepSeek-V4 attention layers (CSA with its lightning
indexer and top-k binding, HCA, YaRN) loaded into ckv's compressed attention, every weight copied, equal to
transformers' single forward in fp32 to 1e-5: in one forward, in chunked prefill and token by token through ckv's
cache (transformers' own chunked path is not the reference: where index scores tie its top-k depends on the tensor's
shape, docs/attention.md)."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ckv.attention.indexer import LightningIndexer, index_scores
from ckv.cache import CompressedLayerCache
from ckv.config import ConfigError
from ckv.io.hf import attention_from_deepseek_v4
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


def test_a_sliding_layer_has_no_compressed_counterpart():
    layer = v4_layer(CSA)
    layer.layer_type = "sliding_attention"
    with pytest.raises(ConfigError, match="'sliding_attention' has no compressor"):
        attention_from_deepseek_v4(layer)


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
