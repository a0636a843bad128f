"""ckv's DeepSeek-V4 variants against transformers' own DeepSeek-V4 code, with copied weights, fp32, CPU.

- Pooled entries: ckv's compressor (``offset_maps: series`` for CSA, ``shared`` for HCA) equals
  ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``, in one forward and when both decode token by token
  through their caches (ckv's ``CompressedLayerCache``, transformers' ``DeepseekV4CSACache`` / ``HCACache``).
- Joint attention: ckv's RoPE (trailing, interleaved, theta 160000), entries, joint softmax with sinks, sliding
  window and visibility, and the output's inverse rotation equal ``DeepseekV4Attention``'s output with its eager
  attention and block mask (``index_topk`` larger than the number of entries, so the indexer selects every
  visible entry; the layer loaded by ``ckv.io.hf.attention_from_deepseek_v4``, whose top-k binding cases are in
  tests/io/test_v4_loading.py), in one forward and when ckv decodes token by token through its cache.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers.models.deepseek_v4",
    reason="the installed transformers has no DeepSeek-V4 (transformers >= 5.x ships it)",
)

from transformers import DeepseekV4Config  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4  # noqa: E402

from ckv import ModelConfig  # noqa: E402
from ckv.attention import CompressedAttention, build_attention  # noqa: E402
from ckv.attention.reference import joint_attention_reference  # noqa: E402
from ckv.cache import CompressedLayerCache  # noqa: E402
from ckv.io.hf import attention_from_deepseek_v4  # noqa: E402
from tests.helpers import CSA, HCA, V4_DIMS, randomise, tiny_v4_config, variant  # noqa: E402

D_MODEL, HEADS, HEAD_DIM, ROPE_DIMS, SLIDING = V4_DIMS
VARIANT = {CSA: "deepseek_v4_csa", HCA: "deepseek_v4_hca"}
TOL = 1e-5


def v4_config(layer_type: str) -> DeepseekV4Config:
    """One V4 layer at ckv's stride for that layer type (CSA 4, HCA 128, the configs' values)."""
    return tiny_v4_config(
        layer_type,
        index_topk=1024,
        compress_rates={CSA: variant(VARIANT[CSA])["stride"], HCA: variant(VARIANT[HCA])["stride"]},
        compress_rope_theta=variant(VARIANT[layer_type])["rope"]["theta"],
    )


def ckv_layer(layer_type: str) -> CompressedAttention:
    att = variant(VARIANT[layer_type])
    att.update(impl="torch", local_window=SLIDING)
    att["rope"]["dims"] = ROPE_DIMS
    cfg = ModelConfig(
        vocab_size=64,
        d_model=D_MODEL,
        n_layers=1,
        n_heads=HEADS,
        n_kv_heads=1,
        head_dim=HEAD_DIM,
        mlp_dim=64,
        max_seq_len=512,
        attention=att,
    )
    return build_attention(cfg, 0)


@torch.no_grad()
def copy_compressor(src: torch.nn.Module, layer: CompressedAttention) -> None:
    """V4's compressor weights into ckv's. V4 stacks the series along the output: ``kv_proj``/``gate_proj``
    (n_series * D, d) and ``position_bias`` (stride, n_series * D); ckv holds per-series maps (n_series, d, D)
    (one (d, D) map for a single series) and a bias per offset (window, D), offset = series * stride + r."""
    comp, (D, d), S = layer.compressors()["K"], (HEAD_DIM, D_MODEL), layer.stride
    n_series = layer.window // S
    for name, target in (("kv_proj", comp.payload), ("gate_proj", comp.gate.weight)):
        w = getattr(src, name).weight.view(n_series, D, d).transpose(1, 2)  # (n_series, d, D)
        target.copy_(w.reshape(target.shape))
    comp.gate.bias.copy_(src.position_bias.view(S, n_series, D).transpose(0, 1).reshape(n_series * S, D))
    layer.ck_norm.weight.copy_(src.kv_norm.weight)


def pair(layer_type: str, seed: int = 0) -> tuple[torch.nn.Module, CompressedAttention, DeepseekV4Config]:
    """transformers' V4 attention layer (randomised) and ckv's layer with the compressor weights copied."""
    torch.manual_seed(seed)
    cfg = v4_config(layer_type)
    attn = v4.DeepseekV4Attention(cfg, 0).eval()
    randomise(attn)
    layer = ckv_layer(layer_type).eval()
    copy_compressor(attn.compressor, layer)
    return attn, layer, cfg


def v4_entries(attn, x: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
    """V4's compressed entries (B, E, D) for hidden states x at ``positions``."""
    q_residual = attn.q_a_norm(attn.q_a_proj(x))
    compressed, _ = attn.compressor(x, q_residual, positions[None].expand(x.shape[0], -1), cache, 0)
    return compressed[:, 0]


# lengths not multiples of the stride (HCA's 300: two entries); decoding starts after a prefill of `prefill`
CASES = [(CSA, 23, 6), (HCA, 300, 250)]


@pytest.mark.parametrize("layer_type, T, prefill", CASES)
def test_entries_equal_transformers_compressor(layer_type, T, prefill):
    attn, layer, _ = pair(layer_type)
    x = torch.randn(2, T, D_MODEL)
    with torch.no_grad():
        ref = v4_entries(attn, x, torch.arange(T))  # (B, E, D)
        E = ref.shape[1]
        kc, vc = layer.entries(x, 0, 0, E)  # (B, E, 1, D)
    assert E == T // layer.stride and E > 0
    assert vc is kc  # one shared K=V head
    assert (kc[:, :, 0] - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("layer_type, T, prefill", CASES)
def test_entries_equal_transformers_when_decoding_through_both_caches(layer_type, T, prefill):
    attn, layer, cfg = pair(layer_type)
    x = torch.randn(2, T, D_MODEL)
    v4_cache, ckv_cache = DynamicCache(config=cfg), CompressedLayerCache()
    assert type(v4_cache.layers[0]).__name__ == {CSA: "DeepseekV4CSACache", HCA: "DeepseekV4HCACache"}[layer_type]
    bounds = [0, prefill, *range(prefill + 1, T + 1)]  # a prefill, then one token at a time
    with torch.no_grad():
        for s, e in zip(bounds[:-1], bounds[1:]):
            ref = v4_entries(attn, x[:, s:e], torch.arange(s, e), v4_cache)  # every entry so far
            layer(x[:, s:e], ckv_cache)
            assert ckv_cache.kc.shape[1] == ref.shape[1] == e // layer.stride
            if ref.shape[1]:
                assert (ckv_cache.kc[:, :, 0] - ref).abs().max().item() <= TOL, f"after {e} tokens"
    assert ckv_cache.kc.shape[1] > 1


@pytest.mark.parametrize("layer_type, T, prefill", CASES)
def test_joint_attention_with_sinks_equals_transformers_eager_attention(layer_type, T, prefill):
    attn, _, cfg = pair(layer_type)
    layer = attention_from_deepseek_v4(attn).eval()  # V4's projections, compressor and indexer, weights copied
    B = 2
    x = torch.randn(B, T, D_MODEL)
    with torch.no_grad():
        # transformers: its attention layer with the model's sliding-window mask and the compressor's block mask
        pos_ids = torch.arange(T)[None].expand(B, -1)
        rotary = v4.DeepseekV4RotaryEmbedding(cfg)
        embeddings = {t: rotary(x, position_ids=pos_ids, layer_type=t) for t in ("main", "compress")}
        mask = create_sliding_window_causal_mask(
            config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos_ids
        )
        ref, _ = attn(x, embeddings, pos_ids, mask)  # (B, T, d)
        # ckv: its RoPE, entries, joint softmax with sinks, local window, visibility and inverse RoPE
        out = layer(x)
        cache = CompressedLayerCache()
        steps = [layer(x[:, :prefill], cache)] + [layer(x[:, t : t + 1], cache) for t in range(prefill, T)]
        decoded = torch.cat(steps, dim=1)
    assert ref.abs().max().item() > 1e-2  # a non-trivial output
    assert (out - ref).abs().max().item() <= TOL
    assert (decoded - ref).abs().max().item() <= TOL


def test_the_sink_changes_the_output_and_its_gradient_matches_the_definition():
    """The sink is one more logit in the softmax, with value 0: with sink s, out = out_nosink * Z / (Z + e^s)."""
    torch.manual_seed(0)
    q, kc, k = torch.randn(1, 9, 2, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 9, 1, 16)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse = joint_attention_reference(q, kc, kc, k, k, stride=4, local_window=3, sinks=sinks)
    plain, plain_lse = joint_attention_reference(q, kc, kc, k, k, stride=4, local_window=3)
    keep = torch.exp(plain_lse - lse)  # Z / (Z + e^s), (B, T, H)
    assert torch.allclose(out, plain * keep[..., None], atol=1e-6)
    assert torch.allclose(lse, torch.logaddexp(plain_lse, sinks.detach()), atol=1e-6)
    (g,) = torch.autograd.grad(out.sum(), sinks)
    # d out / d s = -P(sink) * out
    expected = -(torch.exp(sinks.detach() - lse)[..., None] * out.detach()).sum((0, 1, 3))
    assert torch.allclose(g, expected, atol=1e-6)


# Two limitations of transformers' V4 code that docs/attention.md reports; if one of these fails after a
# transformers upgrade, the limitation is gone and that note is stale.
def tiny_v4_lm(sliding_window: int):
    from transformers import DeepseekV4ForCausalLM

    cfg = tiny_v4_config(
        CSA,
        sliding_window=sliding_window,
        index_topk=2,
        moe_intermediate_size=32,
        n_routed_experts=2,
        num_experts_per_tok=1,
        mlp_layer_types=["moe"],
    )
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(cfg)


def test_transformers_v4_with_sliding_window_1_keeps_the_history_and_fails_to_decode():
    ids = torch.randint(0, 64, (1, 12))
    for window in (4, 1):
        model = tiny_v4_lm(window).eval()
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
            kept = cache.layers[0].keys.shape[2]  # raw keys kept for the next query
            if window == 4:
                assert kept == window - 1
                model(ids[:, -1:], cache=cache, use_cache=True)  # decodes
            else:
                assert kept == ids.shape[1], "sliding_window=1 no longer keeps the whole history"
                with pytest.raises(RuntimeError, match="size of tensor"):
                    model(ids[:, -1:], cache=cache, use_cache=True)


def test_transformers_v4_indexer_gets_no_gradient_from_the_lm_loss():
    model = tiny_v4_lm(4).train()
    ids = torch.randint(0, 64, (2, 24))
    model(ids, labels=ids).loss.backward()
    compressor = model.model.layers[0].self_attn.compressor
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in compressor.named_parameters()
        if not n.startswith("indexer.")
    )
    assert all(p.grad is None for p in compressor.indexer.parameters())  # top-k returns indices only
