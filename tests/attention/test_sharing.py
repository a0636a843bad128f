"""Cross-layer KV sharing (``model.layers``' ``kv``: a ``source`` layer publishes its KV, the ``shared`` layers after
it read it): a consumer equals one softmax, by the rule, over its source's visible entries and its own window with
its own queries; prefill then token-by-token decoding equals one forward; consumers own no compressor and hold only
their window, so the KV-memory report counts a shared cache once; the phase stride follows the source; the config
round-trips; each bad input is one line."""

from __future__ import annotations

import math

import pytest
import torch

from ckv.attention import (
    AttentionBackend,
    EntrySet,
    SlidingAttention,
    build_attention,
    layer_backends,
    model_phase_stride,
)
from ckv.config import ConfigError, KVSource, ModelConfig, ModelSpec
from ckv.flops import flops_per_token, kv_bytes_per_token, parameter_count
from ckv.io.weights import load_weights, save_weights
from ckv.model import Transformer
from tests.helpers import randomise

SIZES = dict(vocab_size=32, d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=16, max_seq_len=64)
W = 3  # the consumers' sliding window
SLIDING = {"kind": "sliding", "sliding_window": W}
RATIO2 = {"kind": "compressed", "window": 4, "stride": 2, "local_window": 3}  # overlapping windows: V4's geometry
V41 = {"offset_maps": "shared", "gate": {"kind": "vector", "bias": False}}  # V4.1's compressor (W = S = ratio)
RATIO1 = {"kind": "compressed", "window": 1, "stride": 1, "local_window": 3, **V41}  # every token's K/V, pooled alone
FULL = {"kind": "full"}  # ratio 1: every token's K/V, projected once
SOURCES = {
    "ratio2": RATIO2,
    "ratio1": RATIO1,
    "full": FULL,
    "dual_offset": dict(RATIO2, dual_offset=1),  # the source attends two grids: its consumers read both
}
CONSUMERS = {"plain": {}, "v4": {"sink": True, "kv": "tied", "output_rope": "inverse", "query": {"lora_rank": 8}}}
# DeepSeek-V4.1's plan at this size: sliding layers, a ratio-2 encoder, a ratio-1 decoder
CSA2 = [
    {"count": 2, "attention": SLIDING},
    {"count": 1, "kv": "source", "attention": {**RATIO2, "window": 2, **V41}},
    {"count": 2, "kv": "shared", "attention": SLIDING},
    {"count": 1, "kv": "source", "attention": RATIO1},
    {"count": 2, "kv": "shared", "attention": SLIDING},
]


def shared_config(source: dict, consumer: dict | None = None, consumers: int = 2, **sizes: int) -> ModelConfig:
    """Layer 0 a sliding layer, layer 1 the source, then ``consumers`` layers reading its KV (``sizes`` override
    ``SIZES``)."""
    layers = [
        {"count": 1, "attention": SLIDING},
        {"count": 1, "kv": "source", "attention": source},
        {"count": consumers, "kv": "shared", "attention": {**SLIDING, **(consumer or {})}},
    ]
    return ModelConfig(**{**SIZES, **sizes}, n_layers=2 + consumers, attention=SLIDING, layers=layers)


def csa2_config() -> ModelConfig:
    return ModelConfig(**SIZES, n_layers=8, attention=SLIDING, layers=CSA2)


def naive_consumer(layer: SlidingAttention, x: torch.Tensor, sets: list[EntrySet]) -> torch.Tensor:
    """The consumer's output by the rule alone: per query ``t`` and head, one softmax over every visible entry of each
    set (entry ``j`` once ``(j + 1) S - 1 <= t + origin``), its own keys ``t - W < p <= t`` and its sink (its
    probability dropped); the layer's own projections and RoPE, loops over queries and heads."""
    B, T, _ = x.shape
    positions = torch.arange(T)
    q, k, v = layer.project(x, positions)  # (B, T, H, D), (B, T, KV, D) x 2
    H, KV, D = q.shape[2], k.shape[2], q.shape[3]
    out = torch.zeros_like(q)
    for t in range(T):
        for h in range(H):
            g = h // (H // KV)
            visible = [(s, j) for s in sets for j in range(s.kc.shape[1]) if (j + 1) * s.stride - 1 <= t + s.origin]
            keys = [s.kc[:, j, g] for s, j in visible]
            values = [s.vc[:, j, g] for s, j in visible]
            own = [p for p in range(T) if t - layer.window < p <= t]
            keys += [k[:, p, g] for p in own]
            values += [v[:, p, g] for p in own]
            logits = torch.stack([(q[:, t, h] * key).sum(-1) / math.sqrt(D) for key in keys], -1)  # (B, n)
            if layer.sinks is not None:
                logits = torch.cat([logits, layer.sinks[h].expand(B, 1)], -1)
            w = logits.softmax(-1)[:, : len(keys)]
            out[:, t, h] = sum(w[:, i, None] * value for i, value in enumerate(values))
    if layer.inverse_output_rope:
        out = layer.rotary(out, positions, inverse=True)
    return layer.o_proj(out.reshape(B, T, -1))


def source_and_consumer(
    source: str, consumer: str = "plain", **sizes: int
) -> tuple[ModelConfig, AttentionBackend, SlidingAttention, torch.Tensor, dict[int, list[EntrySet]]]:
    """``shared_config``'s layer 1 (the source) and layer 2 (a consumer), built, their weights drawn, and the
    entry sets the source published for 13 random hidden states (batch 2)."""
    config = shared_config(SOURCES[source], CONSUMERS[consumer], **sizes)
    src, dst = build_attention(config, 1).eval(), build_attention(config, 2).eval()
    randomise(src)
    randomise(dst)
    x = torch.randn(2, 13, config.d_model)
    shared: dict[int, list[EntrySet]] = {}
    with torch.no_grad():
        src(x, shared=shared)
    return config, src, dst, x, shared


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_consumer_is_one_softmax_over_its_sources_entries_and_its_own_window(source, consumer):
    torch.manual_seed(0)
    _, _, dst, _, shared = source_and_consumer(source, consumer)
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        torch.testing.assert_close(dst(x, shared=shared), naive_consumer(dst, x, shared[1]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_source_publishes_what_it_attends_and_a_consumer_runs_its_attend(source):
    """A full source's sets are its own keys and values, a compressed one's its pooled entries (and, dual-offset, its
    moved grid's), at the stride and origins its consumers' ``kv_source`` states; a consumer's output is the
    source's own joint softmax (its ``attend``) called with the consumer's queries and window."""
    torch.manual_seed(1)
    config, src, dst, x_src, shared = source_and_consumer(source, "v4")
    sets, kv_source = shared[1], config.layer_config(2).kv_source
    assert [(s.stride, s.origin) for s in sets] == [(kv_source.stride, P) for P in kv_source.origins]
    assert len(sets) == (2 if source == "dual_offset" else 1)
    if source == "full":
        _, k, v = src.project(x_src, torch.arange(13))
        torch.testing.assert_close((sets[0].kc, sets[0].vc), (k, v))
        return
    torch.testing.assert_close((sets[0].kc, sets[0].vc), src.entries(x_src, 0, 0, 13 // src.stride))
    if source == "dual_offset":
        return
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        q, k, v = dst.project(x, torch.arange(13))
        joint, _ = src.attend(q, sets[0].kc, sets[0].vc, k, v, stride=src.stride, local_window=W, sinks=dst.sinks)
        joint = dst.rotary(joint, torch.arange(13), inverse=True)  # the v4 consumer's output RoPE undone
        torch.testing.assert_close(dst(x, shared=shared), dst.o_proj(joint.reshape(2, 13, -1)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", ["ratio2", "full"])
def test_the_consumers_joint_softmax_runs_on_the_triton_kernels(source):
    """On CUDA a consumer's ``impl: auto`` takes the Triton kernels: they attend a source's entries (stride 2, or 1:
    every token's K/V) beside the window and the sinks as the reference does (interpreter on CPU)."""
    from ckv.attention.dispatch import attend_entries, triton_available

    if not triton_available():
        pytest.skip("ckv_kernels / triton not installed")
    torch.manual_seed(3)
    _, _, dst, _, shared = source_and_consumer(source, "v4", head_dim=16)  # a head size the kernels take
    with torch.no_grad():
        q, k, v = dst.project(torch.randn(2, 13, 16), torch.arange(13))
        outs = [
            attend_entries(q, shared[1], k, v, start=0, local_window=W, impl=impl, sinks=dst.sinks)
            for impl in ("reference", "triton")
        ]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_a_consumer_outside_its_model_says_what_it_needs():
    layer = build_attention(shared_config(RATIO2), 2)
    with pytest.raises(ValueError, match=r"layer 2 reads the KV of layer 1 \(kv: shared\): run it in its model"):
        layer(torch.randn(1, 4, 16))


@pytest.mark.parametrize(
    "layers",
    [
        CSA2,
        shared_config(FULL).layers,
        shared_config(dict(RATIO2, dual_offset=1)).layers,
        [  # two sources in one segment: the consumers read the later
            {"count": 2, "kv": "source", "attention": RATIO2},
            {"count": 1, "kv": "shared", "attention": SLIDING},
            {"count": 1, "attention": SLIDING},  # a layer of its own between a source and its consumer
            {"count": 1, "kv": "shared", "attention": SLIDING},
        ],
    ],
    ids=["csa2", "full_source", "dual_offset", "two_sources"],
)
def test_prefill_then_decoding_token_by_token_equals_one_forward(layers):
    torch.manual_seed(1)
    n = sum(seg["count"] if isinstance(seg, dict) else seg.count for seg in layers)
    config = ModelConfig(**SIZES, n_layers=n, attention=SLIDING, layers=layers)
    model = Transformer(config).eval()
    randomise(model)
    ids = torch.randint(0, 32, (2, 23))
    with torch.no_grad():
        full = model(ids)
        for sizes in ([7] + [1] * 16, [5, 1, 9, 2, 6]):
            cache, parts, s = model.new_cache(2), [], 0
            for size in sizes:
                parts.append(model(ids[:, s : s + size], cache))
                s += size
            torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_consumers_gradient_reaches_the_sources_compressor():
    config = shared_config(RATIO2)
    src, dst = build_attention(config, 1), build_attention(config, 2)
    randomise(src)
    randomise(dst)
    shared: dict[int, list[EntrySet]] = {}
    src(torch.randn(1, 9, 16), shared=shared)
    dst(torch.randn(1, 9, 16), shared=shared).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in src.compressors()["K"].parameters())
    assert all(p.grad is None for p in src.o_proj.parameters())  # the source's own output took no part


def test_consumers_own_no_compressor_and_the_cache_counts_shared_entries_once():
    """Parameters held = predicted; a consumer owns a sliding layer's parameters (its queries, its window's K/V
    maps, output map, norms), no compressor; the decode cache after ``T`` tokens is the KV-memory report, the
    source's entries counted once and each consumer's window only; FLOPs add each query's visible entries."""
    T = 21
    config = csa2_config()
    model = Transformer(config).eval()
    assert model.num_parameters() == parameter_count(config)
    plain = ModelConfig(**SIZES, n_layers=8, attention=SLIDING)  # a sliding layer reading nothing
    for i in (3, 4, 6, 7):
        layer = model.layers[i].self_attn
        assert type(layer) is SlidingAttention and not any("compressor" in n for n, _ in layer.named_parameters())
        assert sum(p.numel() for p in layer.parameters()) == SlidingAttention.num_params(plain)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 32, (1, T)), cache)
    assert cache.nbytes()["total"] == pytest.approx(kv_bytes_per_token(config, T, bytes_per_element=4) * T)
    window = (W - 1) * config.kv_heads * config.head_dim * 2 * 4  # W - 1 keys and values, fp32
    assert [cache.layers[i].nbytes() for i in (3, 4, 6, 7)] == [{"keys_values": window}] * 4
    backends = layer_backends(config)
    per_layer = [backend.kv_bytes_per_token(layer, T, i) for i, (backend, layer) in enumerate(backends)]
    assert per_layer[3] == per_layer[0] == SlidingAttention.kv_bytes_per_token(plain, T)  # the window only
    unshared = [{**seg, "kv": "own"} for seg in CSA2]  # the same layers, nothing shared
    every_own = [
        {**seg, "kv": "own"} for seg in (CSA2[0], CSA2[1], {**CSA2[1], "count": 2}, CSA2[3], {**CSA2[3], "count": 2})
    ]
    for layers, same in ((unshared, True), (every_own, False)):  # a consumer adds its window only, not entries
        other = ModelConfig(**SIZES, n_layers=8, attention=SLIDING, layers=layers)
        assert (kv_bytes_per_token(other, T) == kv_bytes_per_token(config, T)) is same
    assert kv_bytes_per_token(config, None) == pytest.approx(
        sum(  # long run: the two sources grow, nothing else
            backend.kv_bytes_per_token(layer, None, i) for i, (backend, layer) in enumerate(backends) if i in (2, 5)
        )
    )
    pairs = {2: sum((t + 1) // 2 for t in range(T)), 1: sum(t + 1 for t in range(T))}  # visible entries per query
    for i, stride in ((3, 2), (6, 1)):
        backend, layer = backends[i]
        ours, alone = backend.flops_per_token(layer, T, i), SlidingAttention.flops_per_token(plain, T)
        extra = 4 * config.head_dim * config.n_heads * pairs[stride] / T
        assert ours.attention == pytest.approx(alone.attention + extra) and ours.compressor == 0
        assert ours.projections == alone.projections
    assert flops_per_token(config, T).compressor == pytest.approx(
        sum(backends[i][0].flops_per_token(backends[i][1], T, i).compressor for i in (2, 5))
    )


def test_the_phase_stride_follows_the_sources():
    """A consumer's phase period is its source's stride (none at ratio 1); the model's is its layers' least common
    multiple, as for any schedule."""
    config = csa2_config()
    strides = [backend.phase_stride(layer) for backend, layer in layer_backends(config)]
    assert strides == [None, None, 2, 2, 2, 1, None, None]  # the ratio-1 source's own stride is 1: no phase
    assert model_phase_stride(config) == 2
    assert model_phase_stride(shared_config(FULL)) is None


def test_the_schedule_round_trips_and_says_how_layers_share():
    config = csa2_config()
    d = config.to_dict()
    assert "kv_source" not in d  # the segments' kv is written where a segment shares, as the schedule says it
    assert [seg.get("kv") for seg in d["layers"]] == [None, "source", "shared", "source", "shared"]
    assert ModelConfig.from_dict(d) == config
    assert config.layer_kinds == (
        "2x sliding + 1x compressed kv=source + 2x sliding kv=shared + 1x compressed kv=source + 2x sliding kv=shared"
    )
    segments = config.describe_attention()["layers"]
    assert [s.get("kv") for s in segments] == [None, "source", "shared", "source", "shared"]
    assert [config.layer_kv(i) for i in range(8)] == ["own"] * 2 + ["source", "shared", "shared"] * 2
    assert [config.source_layer(i) for i in range(8)] == [None, None, None, 2, 2, None, 5, 5]
    assert config.layer_config(4).kv_source == KVSource(layer=2, stride=2, origins=(0,))
    assert config.layer_config(7).kv_source == KVSource(layer=5, stride=1, origins=(0,))
    assert config.map_attention(lambda a: a).layers == config.layers  # an impl override keeps each segment's kv
    uniform = ModelConfig(**SIZES, attention=SLIDING).to_dict()
    assert "layers" not in uniform and "kv_source" not in uniform  # a uniform model's config.json as before


def test_a_shared_model_saves_and_loads_with_its_schedule(tmp_path):
    torch.manual_seed(2)
    model = Transformer(csa2_config()).eval()
    save_weights(model, tmp_path / "model")
    loaded = load_weights(tmp_path / "model").eval()
    assert loaded.config == model.config
    ids = torch.randint(0, 32, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))


def _config(layers: list[dict]) -> ModelConfig:
    return ModelConfig(**SIZES, n_layers=sum(seg["count"] for seg in layers), attention=SLIDING, layers=layers)


@pytest.mark.parametrize(
    "layers, message",
    [
        (
            [{"count": 1, "attention": SLIDING}, {"count": 1, "kv": "shared", "attention": SLIDING}],
            "model.layers[1].kv='shared': layer 1 reads the KV of the nearest layer before it with kv='source', and "
            "no layer before it has one: put a kv: source segment before it (or set kv: own)",
        ),
        (
            [
                {"count": 1, "kv": "source", "attention": RATIO2},
                {"count": 1, "kv": "shared", "attention": dict(SLIDING, kv_heads=1, rope={"mode": "none"})},
            ],
            "model.layers[1].kv='shared': layer 1 reads the KV of layer 0 but disagrees with it on attention.kv_heads "
            "(1 vs the source's 2), attention.rope.mode ('none' vs the source's 'full'): a sharing group's layers must "
            "agree on KV heads and RoPE (the head size is the model's, model.head_dim)",
        ),
        (
            [{"count": 1, "kv": "source", "attention": RATIO2}, {"count": 1, "kv": "shared", "attention": RATIO2}],
            "model.layers[1].kv='shared': a consumer attends its source's KV beside its own sliding window, so its "
            "attention.kind must be one that does (['sliding']), not 'compressed'",
        ),
        (
            [{"count": 1, "kv": "source", "attention": SLIDING}, {"count": 1, "kv": "shared", "attention": SLIDING}],
            "model.layers[0].kv='source': attention.kind='sliding' keeps only its last sliding_window tokens, so it "
            "has no KV to publish to other layers: make the source a full layer (ratio 1) or a compressed one (ratio "
            "= its stride)",
        ),
        (
            [
                {"count": 1, "kv": "source", "attention": dict(RATIO2, grid={"offsets": [0, 1], "per": "kv_head"})},
                {"count": 1, "kv": "shared", "attention": SLIDING},
            ],
            "model.layers[0].kv='source': attention.grid.per='kv_head' gives each KV head its own grid of entries, "
            "which other layers cannot read as one set: give the source one grid (attention.grid.per: layer)",
        ),
        (
            [{"count": 1, "kv": "sorce", "attention": RATIO2}],
            "model.layers[0].kv='sorce' is not allowed; choose one of ['own', 'source', 'shared']",
        ),
    ],
    ids=["no_source", "group_disagrees", "consumer_kind", "source_kind", "source_grids", "bad_role"],
)
def test_each_bad_sharing_is_one_line(layers, message):
    with pytest.raises(ConfigError) as e:
        _config(layers)
    assert str(e.value) == message


def test_a_layer_count_the_schedule_does_not_fill_is_one_line():
    with pytest.raises(ConfigError, match=r"model.layers counts \[2, 1, 2, 1, 2\] add up to 8 layers, not "):
        ModelConfig(**SIZES, n_layers=7, attention=SLIDING, layers=CSA2)


def test_kv_source_is_set_by_the_schedule_not_by_hand():
    with pytest.raises(ConfigError, match="model.kv_source=.* is set by ModelConfig.layer_config"):
        ModelConfig(**SIZES, kv_source={"layer": 0, "stride": 2})
    with pytest.raises(ConfigError, match=r"unknown model field\(s\) \['kv_source'\]"):
        ModelSpec.from_dict({"preset": "tiny", "kv_source": None})
