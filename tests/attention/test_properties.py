"""The property matrix: the standing properties of attention, run over every option of conf/attention (each YAML,
and each group option composed onto the group bases: ``tests.helpers.VARIANTS``).

- visibility by gradients: in every layer, input token p acts on query t exactly when the compression geometry
  says so (a visible entry covering p, widened by token mixing, or t's local window; full attention: p <= t; with
  top-k selection only the entries the layer's indexer selected for t, recorded from its forward);
- decode == prefill: token by token and in uneven chunks, with a cache;
- the fast path (``impl=torch``) == the reference, loss and every gradient, and decode == prefill on it; triton ==
  the reference under the Triton interpreter (backends that run triton);
- every parameter receives a gradient (the lightning indexer's from its training loss, ``ckv.train.indexer``);
- the accounting is the module's: parameter count (tied and untied embeddings), KV-cache bytes after T tokens and
  per token in the long run, attended (query, key) pairs behind the FLOPs.
A feature's own test file keeps only what is unique to it.

The cheap columns (gradients reach every parameter, parameter count, FLOPs) run on every option in CI's fast set;
the costly ones (influence by Jacobian, decoding, KV-cache bytes, torch == triton) run there on ``CODE_PATHS``, one
option per code path, and on every other option in the slow set (``make test-slow``, ``make test-all``)."""

from __future__ import annotations

from typing import Union

import pytest
import torch

from ckv import AttentionConfig, ModelConfig, Transformer
from ckv.attention import check_attention
from ckv.flops import flops_per_token, kv_bytes_per_token, parameter_count
from ckv.geometry import compressed_mask, grid_origin, local_mask, num_entries
from ckv.train.indexer import IndexerTraining, IndexerTrainingConfig, has_indexer
from tests.attention.helpers import expected_influence
from tests.helpers import VARIANTS, small_config, variant
from tests.kernels.helpers import assert_impls_match

LONGEST_WINDOW = 16

# one option per code path: full attention (GQA and one KV head); the learned gate at W = S, W = 2S and a stride
# that does not divide the window; the uniform mean; a tail local window; one grid per KV head; shifted grids;
# token mixing; V4's CSA (two-series maps, vector gate, tied K = V, post-norm, partial RoPE, sinks, output RoPE)
# and HCA; top-k by the lightning indexer (V4's and on a plain gate) and by the oracle; no RoPE. The options left
# out (the ablation ladder's steps, head counts, single-option w8s8 variants, group options on a second base)
# combine these paths and run in the slow set.
CODE_PATHS = (
    "full",
    "full_kv1",
    "w4s4",
    "w8s4",
    "w8s6",
    "w8s8",
    "w8s8_mean",
    "w8s8_tail",
    "w8s8_no_rope",
    "w8s8_kv2_heads",
    "w8s4+grid=stagger",
    "w8s4+mixing=conv",
    "deepseek_v4_csa",
    "deepseek_v4_hca",
    "deepseek_v4_csa_sparse",
    "deepseek_v4_csa_oracle",
    "w8s4+selection=indexer",
)


def costly(names: list[str]) -> list:
    """``names`` as parameters, those outside ``CODE_PATHS`` marked slow."""
    return [n if n in CODE_PATHS else pytest.param(n, marks=pytest.mark.slow) for n in names]


def test_every_code_path_is_an_option_of_the_matrix():
    assert set(CODE_PATHS) <= set(VARIANTS), sorted(set(CODE_PATHS) - set(VARIANTS))


def _config(name: str, **overrides) -> ModelConfig:
    """The option on a tiny model. An option with a window over ``LONGEST_WINDOW`` tokens (HCA's 128) runs with
    window and stride scaled down by the same factor, and a local window over it (V4's 128) at that length: the
    same code paths at a fraction of the cost, and local windows that the short test sequences fill."""
    att = AttentionConfig.from_dict(variant(name)).to_dict()
    if att.get("window", 0) > LONGEST_WINDOW:
        factor = att["window"] // LONGEST_WINDOW
        att.update(window=LONGEST_WINDOW, stride=max(1, att["stride"] // factor))
    if att.get("local_window", 0) != "tail" and att.get("local_window", 0) > LONGEST_WINDOW:
        att["local_window"] = LONGEST_WINDOW
    return small_config(att, **overrides)


# full attention has no window, stride or local window: its tests run at the lengths of the compressed defaults
FULL_GEOMETRY = {"window": 8, "stride": 8, "local_window": 16}


def _geometry(cfg: ModelConfig) -> tuple[int, int, Union[int, str]]:
    """``(window, stride, local_window)`` of the option (``FULL_GEOMETRY`` for full attention)."""
    window, stride, local = (getattr(cfg.attention, k, v) for k, v in FULL_GEOMETRY.items())
    return window, stride, local


def _length(cfg: ModelConfig, short: int = 22) -> int:
    """A length that closes entries with every offset present and is not a multiple of the stride."""
    window, stride, _ = _geometry(cfg)
    T = max(short, window + stride + 3)
    return T + 1 if T % stride == 0 else T


@pytest.mark.parametrize("name", costly(VARIANTS))
def test_a_token_acts_on_a_query_exactly_where_the_geometry_says(name):
    cfg = _config(name)
    T = _length(cfg)
    model = Transformer(cfg)
    for layer_idx, block in enumerate(model.layers):
        x = torch.randn(1, T, cfg.d_model)
        # (T, 1, T, d): d(sum_c y[t, c]) / dx[p], one vectorised backward per query
        layer = block.self_attn
        recorded = []  # the selection of this forward (top-k depends on the input): the rule uses the layer's own
        hook = None
        if cfg.attention.option("selection") is not None:  # the indexer's or the oracle's
            hook = layer.attend.register_forward_hook(
                lambda m, args, kwargs, out, seen=recorded: seen.append(kwargs["selected"][0]), with_kwargs=True
            )
        jac = torch.autograd.functional.jacobian(lambda h, f=layer: f(h)[0].sum(-1), x, vectorize=True)
        if hook is not None:
            hook.remove()
            S, P = cfg.attention.stride, layer.origin
            visible = compressed_mask(torch.arange(T) + P, num_entries(T + P, S), S).sum(-1)  # (T,)
            assert len(recorded) == 1 and ((recorded[0] >= 0).sum(-1) < visible).any(), "top-k does not bind"
        touched = jac[:, 0].abs().sum(-1) > 0  # (T, T)
        rule = expected_influence(cfg, layer_idx, T, recorded[0] if recorded else None)
        expected = rule | (torch.eye(T, dtype=torch.bool) & rule.any(-1, keepdim=True))  # own token, through q
        assert torch.equal(touched, expected), f"layer {layer_idx}: {(touched != expected).nonzero().tolist()[:5]}"


def _perturbed(model: Transformer) -> Transformer:
    with torch.no_grad():  # weights far from init, so a wrongly kept or missing state shows in the logits
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


COMPRESSED = [n for n in VARIANTS if check_attention(_config(n)).kind == "compressed"]


@pytest.mark.parametrize("name", costly(VARIANTS))
def test_decoding_equals_the_full_forward_token_by_token_and_in_uneven_chunks(name):
    _assert_decoding_equals_the_full_forward(_config(name))


@pytest.mark.parametrize("name", costly(COMPRESSED))
def test_decoding_equals_the_full_forward_on_the_fast_path(name):
    """The same with ``impl=torch``: the fast path for the prefill and for every decode step (``impl=auto`` at these
    lengths runs the reference, ``ckv.attention.dispatch.REFERENCE_MAX_SCORES``)."""
    att = _config(name).attention.to_dict()
    _assert_decoding_equals_the_full_forward(small_config({**att, "impl": "torch"}))


def _assert_decoding_equals_the_full_forward(cfg: ModelConfig) -> None:
    S, T = _geometry(cfg)[1], _length(cfg, short=29)
    model = _perturbed(Transformer(cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    uneven, pattern = [], [5, 3, 1, S + 1, 2, 1, 1, 9]
    while sum(uneven) < T:
        uneven.append(min(pattern[len(uneven) % len(pattern)], T - sum(uneven)))
    with torch.no_grad():
        full = model(ids)
        for chunks in ([1] * T, uneven):
            cache, parts, s = model.new_cache(2), [], 0
            for n in chunks:
                parts.append(model(ids[:, s : s + n], cache))
                s += n
            err = (torch.cat(parts, 1) - full).abs().max().item()
            assert err < 1e-5, (chunks, err)


TRITON = [n for n in VARIANTS if "triton" in check_attention(_config(n)).impls]


def _assert_impl_equals_the_reference(name: str, impl: str) -> None:
    att = _config(name).attention.to_dict()
    del att["impl"]  # assert_impls_match sets it
    # the kernels' model (tests.kernels.test_model): 4 query heads, so KV heads above 4 are capped there
    att["kv_heads"] = min(att["kv_heads"] or 1, 4)
    T = max(30, att["window"] + att["stride"] + 3)
    if att["selection"] is not None:  # the top-k kernels run one program per position: as short as still binds
        T = max(att["window"] + att["stride"] + 3, (att["selection"]["topk"] + 1) * att["stride"] + 2)
    assert_impls_match(att, T, impl)


@pytest.mark.parametrize("name", costly(TRITON))
def test_triton_equals_the_reference_in_loss_and_every_gradient(name):
    _assert_impl_equals_the_reference(name, "triton")


@pytest.mark.parametrize("name", costly(COMPRESSED))
def test_fast_path_equals_the_reference_in_loss_and_every_gradient(name):
    _assert_impl_equals_the_reference(name, "torch")


@pytest.mark.parametrize("name", VARIANTS)
def test_every_parameter_receives_a_gradient(name):
    cfg = _config(name)
    model = Transformer(cfg)
    # the indexer learns from its own loss
    indexer = IndexerTraining(model, IndexerTrainingConfig()) if has_indexer(model) else None
    if indexer is not None:
        indexer.start()
    loss = model(torch.randint(0, cfg.vocab_size, (2, _length(cfg)))).logsumexp(-1).mean()
    (loss + (indexer.finish()[0] if indexer is not None else 0)).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", VARIANTS)
def test_parameter_count_is_the_accounting(name):
    for tie in (True, False):
        cfg = _config(name, tie_embeddings=tie)
        with torch.device("meta"):
            model = Transformer(cfg)
        assert parameter_count(cfg) == model.num_parameters()
        layer = model.layers[0].self_attn
        assert check_attention(cfg).num_params(cfg) == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("name", costly(VARIANTS))
def test_kv_cache_bytes_are_the_accounting(name):
    """What the decode cache holds after t tokens (fp32: 4 bytes) is kv_bytes_per_token(t) * t, prefilled or
    decoded; once the local window is full, every 2 strides add 2 strides' worth of the long-sequence figure."""
    cfg = _config(name)
    window, stride, local_window = _geometry(cfg)
    local = stride if local_window == "tail" else local_window
    T = _length(cfg, short=local + window + stride + 1)  # past the local window and a whole window
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, T + 2 * stride))
    acct = lambda t: kv_bytes_per_token(cfg, t, bytes_per_element=4) * t  # noqa: E731
    with torch.no_grad():
        for t in (1, 5, T):
            cache = model.new_cache(1)
            model(ids[:, :t], cache)
            assert cache.nbytes()["total"] == pytest.approx(acct(t)), t
            held = cache.nbytes()
            for part, n in _parts(cfg, t).items():  # each part of the cache (rotated dims apart) priced alone
                assert held[part] == pytest.approx(n * 4 * t), (t, part)
        held = {T: cache.nbytes()["total"]}
        for t in range(T, T + 2 * stride):  # decoding, token by token
            model(ids[:, t : t + 1], cache)
            held[t + 1] = cache.nbytes()["total"]
            assert held[t + 1] == pytest.approx(acct(t + 1)), t + 1
    growth = (held[T + 2 * stride] - held[T]) / (2 * stride)
    assert growth == pytest.approx(kv_bytes_per_token(cfg, None, bytes_per_element=4))


def _parts(cfg: ModelConfig, t: int) -> dict[str, float]:
    """``kv_elements_per_token`` summed over layers, the rotated dims folded into their part (the cache's names)."""
    parts: dict[str, float] = {}
    for layer in range(cfg.n_layers):
        for part, n in check_attention(cfg).kv_elements_per_token(cfg, t, layer).items():
            parts[part.removesuffix(".rope")] = parts.get(part.removesuffix(".rope"), 0.0) + n
    return parts


def _brute_force_pairs(cfg: ModelConfig, T: int, layer_idx: int) -> int:
    """Attended (query, key) pairs summed over the query heads, from ckv.geometry's masks: per head the visible
    entries of its KV head's grid (at most top-k of them with selection) plus the local window's keys."""
    a, t = cfg.attention, torch.arange(T)
    if check_attention(cfg).phase_stride(cfg) is None:
        return cfg.n_heads * int((t[None, :] <= t[:, None]).sum())
    offsets = cfg.grid_offsets(layer_idx)
    heads_per_grid = cfg.n_heads // len(offsets)
    pairs = 0
    for o in offsets:
        P = grid_origin(o, a.stride)
        g = t + P
        visible = compressed_mask(g, num_entries(T + P, a.stride), a.stride).sum(-1)  # (T,)
        entries = (visible if a.selection is None else visible.clamp(max=a.selection.topk)).sum()
        pairs += heads_per_grid * int(entries + local_mask(g, g, a.local_window, a.stride, origin=P).sum())
    return pairs


@pytest.mark.parametrize("name", VARIANTS)
def test_attention_flops_count_the_visible_pairs(name):
    cfg = _config(name)
    for T in (1, 7, 37):
        pairs = sum(_brute_force_pairs(cfg, T, layer) for layer in range(cfg.n_layers))
        want = 4 * cfg.head_dim * pairs / T
        assert flops_per_token(cfg, T).attention == pytest.approx(want), T
