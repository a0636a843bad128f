"""Phase-staggered grids (attention.grid, ckv.options.grid, docs/attention.md "Staggered grids") against the rule:
entry j of a grid shifted by o covers [(j+1)S - W + o, (j+1)S - 1 + o] and is visible at t iff (j+1)S - 1 + o <= t,
positions below 0 absent. What is unique to grids: geometry.influence_mask and the gradients against the rule
written out, at EVERY offset (the property matrix, tests/attention/test_properties.py, runs base + grid=stagger),
decode == prefill at every offset, equality with the unshifted model at offset 0, the compressor's FLOPs per
shifted layer, cached decoding through the kernels, config errors."""

import pytest
import torch

from ckv import Transformer
from ckv.attention import CompressedAttention, check_attention
from ckv.config import ConfigError
from ckv.flops import flops_per_token
from ckv.geometry import influence_mask
from tests.helpers import small_config, variant


def rule_entries(t: int, window: int, stride: int, offset: int) -> list[int]:
    """The issue's rule written out: indices j of the shifted entries visible at t that hold a present position
    (j = -1 holds positions 0..o-1 when o > 0)."""
    return [j for j in range(-1, t + 1) if (j + 1) * stride - 1 + offset <= t and (j + 1) * stride - 1 + offset >= 0]


def rule_covers(j: int, p: int, window: int, stride: int, offset: int) -> bool:
    return (j + 1) * stride - window + offset <= p <= (j + 1) * stride - 1 + offset and p >= 0


def rule_local(t: int, p: int, stride: int, offset: int, local) -> bool:
    """Exact local window: the last N tokens, or in tail mode the tokens after the last visible entry's end."""
    if local == "tail":
        ends = [(j + 1) * stride - 1 + offset for j in rule_entries(t, 0, stride, offset)]
        return max(ends, default=-1) < p <= t
    return t - local + 1 <= p <= t


def rule_influence(t: int, p: int, window: int, stride: int, offset: int, local) -> bool:
    if p > t or p < 0:
        return False
    via_entry = any(rule_covers(j, p, window, stride, offset) for j in rule_entries(t, window, stride, offset))
    return via_entry or rule_local(t, p, stride, offset, local)


GEOMETRIES = [(4, 4), (8, 4), (8, 6), (5, 2)]


@pytest.mark.parametrize("window, stride", GEOMETRIES)
@pytest.mark.parametrize("local", [0, 3, "tail"])
def test_influence_mask_with_a_grid_offset_is_the_rule(window, stride, local):
    T = 27
    for offset in range(stride):
        m = influence_mask(T, window, stride, local, grid_offset=offset)
        expected = torch.tensor(
            [[rule_influence(t, p, window, stride, offset, local) for p in range(T)] for t in range(T)]
        )
        assert torch.equal(m, expected), offset
    unshifted = influence_mask(T, window, stride, local)
    assert torch.equal(influence_mask(T, window, stride, local, grid_offset=0), unshifted)


def assert_layer_influence(layer, T: int, sees) -> None:
    """By gradients: input token p acts on the output of query t exactly when sees(t, p) (or p == t: through q)."""
    x = torch.randn(1, T, layer.config.d_model, requires_grad=True)
    y = layer(x)
    for t in range(T):
        (grad,) = torch.autograd.grad(y[0, t].sum(), x, retain_graph=True)
        touched = grad[0].abs().sum(-1) > 0
        row = [sees(t, p) for p in range(T)]
        expected = torch.tensor([s or (p == t and any(row)) for p, s in enumerate(row)])
        assert torch.equal(touched, expected), f"query {t}"


@pytest.mark.parametrize("window, stride, local", [(4, 4, 0), (4, 4, 3), (8, 4, "tail"), (8, 6, 2)])
def test_a_token_reaches_a_query_only_through_a_visible_shifted_entry_or_the_local_window(window, stride, local):
    """Every layer of a model with one offset per layer (0..S-1): the gradient pattern is the rule's, and it is
    influence_mask's with that layer's offset."""
    T = 22
    att = dict(
        variant("w8s8"), window=window, stride=stride, local_window=local, grid=dict(offsets=list(range(stride)))
    )
    model = Transformer(small_config(att, n_layers=stride))
    for layer_idx, block in enumerate(model.layers):
        layer = block.self_attn
        assert layer.grid_offsets == [layer_idx]
        mask = influence_mask(T, window, stride, local, grid_offset=layer_idx)
        assert_layer_influence(layer, T, lambda t, p, o=layer_idx: rule_influence(t, p, window, stride, o, local))
        assert_layer_influence(layer, T, lambda t, p, mask=mask: bool(mask[t, p]))


def test_stagger_gives_layer_l_the_offset_l_times_stride_over_layers():
    for stride, n_layers, expected in [
        (8, 2, [0, 4]),
        (4, 2, [0, 2]),
        (4, 3, [0, 1, 2]),
        (8, 3, [0, 2, 5]),
        (2, 4, [0, 0, 1, 1]),
    ]:
        cfg = small_config(
            dict(variant("w8s8"), window=stride, stride=stride, grid=dict(offsets="stagger")), n_layers=n_layers
        )
        assert [cfg.grid_offset(layer) for layer in range(n_layers)] == expected
        assert [b.self_attn.grid_offsets for b in Transformer(cfg).layers] == [[o] for o in expected]


def _perturbed(model: Transformer) -> Transformer:
    with torch.no_grad():  # weights far from init, so a wrongly kept or missing state shows in the logits
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize(
    "name, changes",
    [
        ("w4s4", dict(local_window=4)),
        ("w4s4", dict(local_window=0)),
        ("w8s4", dict(local_window="tail")),
        ("w8s8", dict(window=8, stride=6, local_window=5)),
        (
            "w4s4",
            dict(local_window=3, mixing=dict(kernel=4)),
        ),  # token mixing: the pending states keep K - 1 predecessors
        ("deepseek_v4_csa", dict(local_window=5)),  # sinks, per-series maps, trailing interleaved RoPE, inverse output
    ],
)
def test_decode_matches_prefill_token_by_token_and_in_uneven_chunks_for_every_offset(name, changes):
    att = dict(variant(name), **changes)
    S = att["stride"]
    for offset in range(1, S):
        model = _perturbed(Transformer(small_config(dict(att, grid=dict(offsets=[offset, (offset + 1) % S])))))
        ids = torch.randint(0, 64, (2, 29))
        with torch.no_grad():
            full = model(ids)
            for chunks in ([1] * 29, [5, 3, 1, 6, 2, 1, 1, 9, 1], [S - 1, 1, S + 1, 2 * S, 29 - 4 * S - 1]):
                cache, parts, s = model.new_cache(2), [], 0
                for n in chunks:
                    parts.append(model(ids[:, s : s + n], cache))
                    s += n
                err = (torch.cat(parts, 1) - full).abs().max().item()
                assert err < 1e-5, (offset, chunks, err)


@pytest.mark.parametrize("name", ["w4s4", "w8s4", "deepseek_v4_csa"])
def test_offsets_of_zero_are_the_unshifted_model_exactly(name):
    base = Transformer(small_config(variant(name)))
    zero = Transformer(small_config(dict(variant(name), grid=dict(offsets=[0, 0]))))
    zero.load_state_dict(base.state_dict())
    ids = torch.randint(0, 64, (2, 23))
    assert torch.equal(zero(ids), base(ids))
    shifted = Transformer(small_config(dict(variant(name), grid=dict(offsets=[0, 1]))))
    shifted.load_state_dict(base.state_dict())
    assert not torch.equal(shifted(ids), base(ids))  # and a shift does change the model


def _brute_pairs(T: int, window: int, stride: int, offset: int, local) -> int:
    return sum(
        len(rule_entries(t, window, stride, offset)) + sum(rule_local(t, p, stride, offset, local) for p in range(T))
        for t in range(T)
    )


@pytest.mark.parametrize("window, stride, local", [(4, 4, 4), (8, 4, "tail"), (8, 6, 3), (8, 8, 0)])
@pytest.mark.parametrize("T", [1, 5, 8, 37])
def test_flops_count_the_visible_pairs_of_each_shifted_layer(window, stride, local, T):
    offsets = list(range(stride))
    cfg = small_config(
        dict(variant("w8s8"), window=window, stride=stride, local_window=local, grid=dict(offsets=offsets)),
        n_layers=stride,
    )
    pairs = [CompressedAttention.visible_pairs(cfg, T, layer) for layer in range(stride)]
    assert pairs == [_brute_pairs(T, window, stride, o, local) for o in offsets]
    f = flops_per_token(cfg, T)
    assert f.attention == pytest.approx(4 * cfg.head_dim * cfg.n_heads * sum(pairs) / T)
    entries = sum((T + (stride - o) % stride) // stride for o in offsets)  # finished shifted windows per layer
    out = cfg.kv_heads * cfg.head_dim  # scalar gate: one logit per KV head
    per_entry = window * 2 * cfg.d_model * (out + cfg.kv_heads) + 2 * window * out
    assert f.compressor == pytest.approx(2 * per_entry * entries / T)


@pytest.mark.parametrize(
    "attention, overrides, match",
    [
        (
            dict(grid=dict(offsets=[0])),
            {},
            r"attention.grid.offsets has 1 entries; it needs one per layer \(model.n_layers=2\)",
        ),
        (dict(grid=dict(offsets=[0, 4])), {}, r"attention.grid.offsets\[1\]=4 must be < attention.stride=4"),
        (dict(grid=dict(offsets=[0, -1])), {}, r"attention.grid.offsets\[1\]=-1 must be an integer >= 0"),
        (dict(grid=dict(offsets=[0, 1.5])), {}, r"attention.grid.offsets\[1\]=1.5 must be an integer >= 0"),
        (dict(grid=dict(offsets="shuffle")), {}, "attention.grid.offsets='shuffle' is not allowed"),
        (dict(grid=dict(offsets=2)), {}, "must be 'stagger' or a list of ints"),
        (dict(grid="stagger"), {}, "attention.grid='stagger' must be a mapping"),
        (
            dict(kind="full", grid=dict(offsets="stagger")),
            {},
            r"attention.grid, attention.stride, attention.window are not fields of attention.kind='full'",
        ),
        (dict(kind="full", grid=dict(offsets=[0, 0])), {}, "attention.grid, .* are not fields of"),
        (dict(grid=dict(offsets=[0], per="kv_head"), kv_heads=2), {}, r"needs one per kv_head \(KV heads=2\)"),
        (dict(grid=dict(per="layers")), {}, "attention.grid.per='layers' is not allowed"),
        (
            dict(grid=dict(per="kv_head"), kv_heads=2, selection=dict(topk=2)),
            {},
            "attention.grid.per='kv_head' gives each KV head its own entries",
        ),
    ],
)
def test_bad_grid_offsets_raise_one_clear_error(attention, overrides, match):
    att = {**dict(kind="compressed", window=4, stride=4), **attention}
    with pytest.raises(ConfigError, match=match) as err:
        check_attention(small_config(att, **{"n_heads": 4, "n_kv_heads": 1, **overrides}))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("window, stride, local", [(8, 8, 0), (8, 4, 3)])
def test_each_kv_head_reads_through_its_own_grid(window, stride, local):
    """grid.per=kv_head: the query heads of KV head h see tokens exactly by the rule at h's offset (the output
    projection restricted to their block), and stagger gives head h the offset (h * stride) // kv_heads."""
    att = dict(variant("w8s8"), window=window, stride=stride, local_window=local, kv_heads=2)
    cfg = small_config(dict(att, grid=dict(offsets="stagger", per="kv_head")), n_layers=1)
    offsets = [0, stride // 2]
    assert cfg.grid_offsets(0) == offsets
    with pytest.raises(ValueError, match="one grid per KV head"):
        cfg.grid_offset(0)
    layer = Transformer(cfg).layers[0].self_attn
    block = (cfg.n_heads // 2) * cfg.head_dim  # o_proj input columns of one KV head's query heads
    weight = layer.o_proj.weight.detach().clone()
    for h, o in enumerate(offsets):
        with torch.no_grad():
            layer.o_proj.weight.zero_()
            layer.o_proj.weight[:, h * block : (h + 1) * block] = weight[:, h * block : (h + 1) * block]
        assert_layer_influence(layer, 22, lambda t, p, o=o: rule_influence(t, p, window, stride, o, local))


def test_decoding_a_staggered_model_with_kernels_matches_the_full_forward():
    """Cache continuation through the kernels: q_start in grid coordinates, exact keys trimmed at the origin."""
    from tests.kernels.helpers import DEVICE, model_config, rel_rms

    model = Transformer(model_config("triton", window=8, stride=4, local_window=3, grid=dict(offsets=[1, 3]))).to(
        DEVICE
    )
    ids = torch.randint(0, 64, (1, 30), device=DEVICE)
    with torch.no_grad():
        full = model.eval()(ids)
        cache = model.new_cache(1)
        steps = [model(ids[:, :2], cache), model(ids[:, 2:9], cache)] + [
            model(ids[:, t : t + 1], cache) for t in range(9, 30)
        ]
    assert rel_rms(torch.cat(steps, dim=1), full) < 1e-5
