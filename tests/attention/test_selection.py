"""What is unique to top-k selection by the lightning indexer (``attention.selection``, ``ckv.attention.indexer``):
its top-k, fake quantisation, the layer's selection and the backend's accounting of it; the config checks of the
selection, query and rope groups are tests/options/'s. The property matrix (test_properties.py) runs the standing
properties over ``deepseek_v4_csa_sparse`` and ``<base>+selection=indexer``."""

from __future__ import annotations

import pytest
import torch

from ckv import Transformer
from ckv.attention import check_attention
from ckv.attention.indexer import FP4_VALUES, fake_quant, index_scores, oracle_scores, oracle_selection, top_k
from tests.attention.helpers import expected_influence
from tests.helpers import small_config, variant

SPARSE = dict(
    kind="compressed", window=8, stride=4, local_window=3, kv_heads=1, selection=dict(topk=2, heads=2, head_dim=16)
)


def test_top_k_breaks_ties_toward_the_lower_index_and_marks_missing_entries():
    inf = float("-inf")
    scores = torch.tensor([[[0.0, 2.0, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, inf, inf], [3.0, inf, inf, inf, inf]]])
    assert top_k(scores, 3).tolist() == [[[1, 3, 4], [0, 1, 2], [0, -1, -1]]]
    assert top_k(scores, 9).shape == (1, 3, 5) and top_k(scores[..., :0], 2).shape == (1, 3, 0)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 64])
def test_top_k_equals_the_stable_sort_with_many_ties_and_missing_entries(k):
    """``top_k`` (``torch.topk`` plus a fix of the rows tied at the k-th score) lists the same entries in the same
    order as a stable descending sort of the whole row: scores from a few levels (most rows tie, at and above the
    k-th), a third ``-inf``, rows with fewer than k visible entries and with none."""
    generator = torch.Generator().manual_seed(k)
    for levels in (1, 2, 4, 100):
        scores = torch.randint(-2, levels, (3, 50, 40), generator=generator).float() / 2
        scores[torch.rand(scores.shape, generator=generator) < 0.35] = float("-inf")
        scores[:, :5, 3:] = float("-inf")  # at most 3 visible entries
        scores[:, 5] = float("-inf")  # none visible
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        expected = torch.where(scores.gather(-1, order) == float("-inf"), -1, order)
        assert torch.equal(top_k(scores, k), expected)


@pytest.mark.parametrize("q_start", [0, 6])
def test_chunked_selection_equals_the_whole_top_k_with_ties(q_start):
    """The indexer's and the oracle's selections in query chunks not dividing T (and one chunk for all) equal the
    ``top_k`` of the whole (B, T, E) scores, ties included: one index head, so a negative dot scores 0 after the
    ReLU, and every third key 0: a fifth of the rows tie at the k-th. (Equal non-zero scores are not ties a
    chunk keeps: the dots of equal keys can differ in the last bit with the product's shape, docs/attention.md.)"""
    torch.manual_seed(0)
    layer = Transformer(small_config({**SPARSE, "selection": dict(topk=3, heads=1, head_dim=16)})).layers[0]
    indexer = layer.self_attn.indexer
    B, T, E = 2, 45, (q_start + 45) // 4
    x, latent = torch.randn(B, T, 32), torch.randn(B, T, indexer.q_proj.in_features)
    keys = torch.randn(B, E, 16)
    keys[:, 1::3] = 0.0  # score 0 exactly, as after the ReLU of a negative dot
    positions = torch.arange(q_start, q_start + T)
    with torch.no_grad():
        queries, whole = indexer(x, latent, keys, positions, q_start, 4, chunk=T)
        scores = index_scores(queries, keys, q_start, 4)
        ranked = scores.sort(-1, descending=True).values
        assert ((ranked[..., 2] == ranked[..., 3]) & ranked[..., 3].isfinite()).float().mean() > 0.2  # tie at k
        assert torch.equal(whole, top_k(scores, 3)) and (whole == -1).any()
        for chunk in (1, 4, 7, 16):
            assert torch.equal(indexer(x, latent, keys, positions, q_start, 4, chunk=chunk)[1], whole), chunk
        q, kc, lse = torch.randn(B, T, 4, 8), torch.randn(B, E, 1, 8), torch.randn(B, T, 4)
        kc[:, 1::3] = 0.0  # logits 0: equal mass
        mass = oracle_scores(q, kc, lse, q_start, 4)
        for chunk in (1, 4, 7, 16, None):
            assert torch.equal(oracle_selection(q, kc, lse, q_start, 4, 3, chunk=chunk), top_k(mass, 3)), chunk


def test_fake_quantisation_keeps_each_block_on_its_format_grid():
    """fp8 / fp4 with one scale per block (128 / 32 dims, the whole vector when shorter): each block's largest
    magnitude is kept, every value is a scaled e4m3 / e2m1 number, and the error is within half a grid step."""
    torch.manual_seed(0)
    x = torch.randn(6, 256) * torch.logspace(-3, 3, 6)[:, None]  # rows of very different magnitudes
    assert torch.equal(fake_quant(x, "none"), x)
    for fmt, block, top in (("fp8", 128, 448.0), ("fp4", 32, 6.0)):
        y = fake_quant(x, fmt).reshape(6, 256 // block, block)
        blocks = x.reshape(6, 256 // block, block)
        amax = blocks.abs().amax(-1, keepdim=True)
        assert torch.allclose(y.abs().amax(-1, keepdim=True), amax, rtol=1e-6)
        scaled = y / (amax / top)
        on_grid = scaled.to(torch.float8_e4m3fn).float() if fmt == "fp8" else scaled.abs()
        if fmt == "fp8":
            assert torch.allclose(on_grid, scaled, rtol=1e-5, atol=0)
            assert ((y - blocks).abs() <= blocks.abs() * 2**-4 + amax / top * 2**-9).all()  # 3 mantissa bits
        else:
            grid = torch.tensor(FP4_VALUES)
            assert ((on_grid[..., None] - grid).abs().amin(-1) < 1e-5).all()
            assert ((y - blocks).abs() <= amax / top).all()  # the widest step of e2m1 is 2, half of it 1
    short = torch.randn(3, 16)
    assert fake_quant(short, "fp4").abs().amax(-1).tolist() == pytest.approx(short.abs().amax(-1).tolist())


def test_fp8_index_queries_and_keys_change_few_selections():
    """With ``selection.quant`` the scores that select read fake-quantised index queries and keys: on random
    inputs fp8 changes under 10% of the selected entries against fp32, fp4 more than fp8; the returned queries
    (the training loss's) stay fp32."""
    torch.manual_seed(0)
    att = {**SPARSE, "selection": dict(topk=8, heads=4, head_dim=32)}
    indexer = Transformer(small_config(att, n_layers=1)).layers[0].self_attn.indexer
    B, T, E = 4, 256, 64
    x, latent, keys = torch.randn(B, T, 32), torch.randn(B, T, indexer.q_proj.in_features), torch.randn(B, E, 32)
    picked, queries = {}, {}
    for fmt in ("none", "fp8", "fp4"):
        indexer.quant = fmt
        with torch.no_grad():
            queries[fmt], picked[fmt] = indexer(x, latent, keys, torch.arange(T), 0, 4)
    listed = picked["none"] >= 0
    changed = {
        fmt: 1 - ((picked["none"][..., None] == picked[fmt][..., None, :]).any(-1) & listed).sum() / listed.sum()
        for fmt in ("fp8", "fp4")
    }
    assert 0 < changed["fp8"] < 0.1 and changed["fp4"] > changed["fp8"], changed
    assert torch.equal(queries["fp8"].q, queries["none"].q)


def test_tied_scores_select_the_earliest_entries_alike_in_prefill_and_decoding():
    """Index queries of 0 give every visible entry the score 0: each query keeps its first two entries, whether the
    layer runs one forward or decodes token by token."""
    torch.manual_seed(0)
    model = Transformer(small_config(SPARSE, n_layers=1)).eval()
    layer = model.layers[0].self_attn
    with torch.no_grad():
        layer.indexer.q_proj.weight.zero_()
    seen = []
    layer.indexer.register_forward_hook(lambda m, args, out: seen.append(out[1]))
    ids = torch.randint(0, 64, (1, 23))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1)
        steps = torch.cat([model(ids[:, t : t + 1], cache) for t in range(23)], dim=1)
    assert (steps - full).abs().max() < 1e-5
    first_two = [[j if j < (t + 1) // 4 else -1 for j in (0, 1)] for t in range(23)]
    assert seen[0][0].tolist() == first_two  # the prefill's (T, 2) selection
    decoded = [s[0, 0].tolist() for s in seen[1:]]  # one row per step, min(2, entries so far) wide
    assert [row + [-1] * (2 - len(row)) for row in decoded] == first_two


def test_selecting_every_entry_is_the_dense_layer():
    """A top-k at least the number of entries attends to every visible entry: the output is the same layer's
    without selection (its other weights loaded), and a binding top-k changes it."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 29))
    dense = Transformer(small_config({k: v for k, v in SPARSE.items() if k != "selection"})).eval()
    outs = []
    for topk in (64, 2):
        sparse = Transformer(small_config({**SPARSE, "selection": dict(topk=topk, heads=2, head_dim=16)})).eval()
        missing, unexpected = sparse.load_state_dict(dense.state_dict(), strict=False)
        assert not unexpected and all(".indexer." in k for k in missing)
        with torch.no_grad():
            outs.append(sparse(ids))
    with torch.no_grad():
        plain = dense(ids)
    assert torch.equal(outs[0], plain)
    assert (outs[1] - plain).abs().max() > 1e-3


@pytest.mark.parametrize("grid", [None, {"offsets": [1, 3]}])
def test_selection_with_mixing_a_tail_window_and_shifted_grids(grid):
    """Selection composes with token mixing, a tail window and staggered grids: decoding equals the full forward
    and each token acts exactly through the entries the layer selected (or the tail)."""
    att = {**SPARSE, "local_window": "tail", "mixing": {"kernel": 2}, "grid": grid}
    cfg = small_config(att)
    torch.manual_seed(1)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 64, (1, 26))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1)
        parts = [model(ids[:, s : s + n], cache) for s, n in ((0, 5), (5, 1), (6, 9), (15, 11))]
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-5
    for layer_idx, block in enumerate(model.layers):
        layer, seen = block.self_attn, []
        hook = layer.attend.register_forward_hook(
            lambda m, a, kw, out, seen=seen: seen.append(kw["selected"][0]), with_kwargs=True
        )
        x = torch.randn(1, 26, cfg.d_model)
        jac = torch.autograd.functional.jacobian(lambda h, f=layer: f(h)[0].sum(-1), x, vectorize=True)
        hook.remove()
        touched = jac[:, 0].abs().sum(-1) > 0
        rule = expected_influence(cfg, layer_idx, 26, seen[0])
        expected = rule | (torch.eye(26, dtype=torch.bool) & rule.any(-1, keepdim=True))
        assert torch.equal(touched, expected), layer_idx


def test_the_indexer_and_the_query_path_declare_their_parameters():
    base = small_config(variant("deepseek_v4_csa"))
    sparse = small_config(variant("deepseek_v4_csa_sparse"))
    backend = check_attention(sparse)
    layer = Transformer(sparse).layers[0].self_attn
    indexer = sum(p.numel() for p in layer.indexer.parameters())
    latent = sum(p.numel() for p in layer.q_latent.parameters()) + layer.q_proj.weight.numel()
    full_rank_q = base.d_model * base.n_heads * base.head_dim
    assert backend.num_params(sparse) - backend.num_params(base) == indexer + latent - full_rank_q


def test_top_k_bounds_the_attended_entries_and_scoring_costs_every_visible_one():
    """Attention FLOPs per token fall with top-k binding (each query attends to at most top-k entries), while the
    indexer's line counts its scoring of every visible entry; the compressor's line is the dense model's."""
    dense = small_config({k: v for k, v in SPARSE.items() if k != "selection"})
    sparse = small_config(SPARSE)
    backend = check_attention(sparse)
    T = 64
    visible = sum((t + 1) // 4 for t in range(T))
    attended = sum(min((t + 1) // 4, 2) for t in range(T))
    H = sparse.n_heads  # entry_pairs sums over the query heads
    assert backend.entry_pairs(sparse, T) == (H * (attended + sum(min(t + 1, 3) for t in range(T))), H * visible)
    f_dense, f_sparse = backend.flops_per_token(dense, T), backend.flops_per_token(sparse, T)
    per_pair = 4 * sparse.head_dim * sparse.n_heads
    assert f_dense.attention - f_sparse.attention == pytest.approx(per_pair * (visible - attended) / T)
    scoring = 2 * 2 * (16 + 1) * visible / T  # 2 heads x (16-dim dot + weight) per visible entry, per token
    assert f_sparse.indexer > scoring and f_dense.indexer == 0
    assert f_sparse.compressor == pytest.approx(f_dense.compressor)
