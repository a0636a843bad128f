"""The fast path (``ckv.attention.blocked``) equals the oracle (``reference.joint_attention_reference``): output,
log-sum-exp and the gradients of q, kc, vc, k, v and the sinks, over the geometry's cases (strides, int and tail
local windows, GQA, shifted grids, decode and chunked prefill, top-k with empty slots, no entries yet) and block
sizes (1, not dividing T, larger than T, chosen); and its working memory is bounded by the block, not T * E."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from ckv import AttentionConfig
from ckv.attention.blocked import choose_block, joint_attention_blocked, working_bytes
from ckv.attention.reference import joint_attention_reference
from ckv.config import ConfigError
from ckv.geometry import LocalWindow, local_keep, local_span, num_entries
from tests.helpers import LargestTensor
from tests.kernels.helpers import assert_impls_match

RTOL = 1e-5


def _inputs(
    B: int,
    Tq: int,
    H: int,
    KV: int,
    D: int,
    stride: int,
    local_window: LocalWindow,
    q_start: int = 0,
    origin: int = 0,
    sinks: bool = False,
    topk: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict, dict]:
    """Random inputs of one call: tensors (requiring gradients) and the keyword arguments. The exact keys reach
    back exactly as far as the local window needs (a decode cache's keep); the entries are every finished one."""
    n = q_start + Tq
    E = num_entries(n, stride)
    Tk = Tq + local_keep(q_start, local_window, stride, origin=origin) if q_start else Tq
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()  # noqa: E731
    tensors = dict(q=rand(B, Tq, H, D), kc=rand(B, E, KV, D), vc=rand(B, E, KV, D), k=rand(B, Tk, KV, D))
    tensors["v"] = rand(B, Tk, KV, D)
    if sinks:
        tensors["sinks"] = rand(H)
    kwargs = dict(stride=stride, local_window=local_window, q_start=q_start, origin=origin)
    if topk is not None:  # a random listing per query: visible and invisible entries, and empty slots (-1)
        rows = torch.stack([torch.randperm(E + topk, generator=g)[:topk] for _ in range(B * Tq)]).view(B, Tq, topk)
        kwargs["selected"] = torch.where(rows < E, rows, -1)
    return tensors, kwargs


def _run(fn, tensors: dict, kwargs: dict, d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    t = {name: x.detach().clone().requires_grad_() for name, x in tensors.items()}
    out, lse = fn(**t, **kwargs)
    if not out.requires_grad:  # the reference when nothing can ever be visible: zeros, not a function of inputs
        return out, lse, dict.fromkeys(t)
    grads = torch.autograd.grad(out, list(t.values()), d_out, allow_unused=True)
    return out, lse, {name: gr for name, gr in zip(t, grads)}


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a)) and torch.equal(a[~finite], b[~finite]), what
    scale = b[finite].abs().max().item() if finite.any() else 0.0
    err = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= RTOL * max(scale, 1e-30), f"{what}: {err} vs scale {scale}"


def assert_matches_reference(tensors: dict, kwargs: dict, block: Optional[int]) -> None:
    ref_out, ref_lse, ref_grads = _run(joint_attention_reference, tensors, kwargs, _d_out(tensors))
    out, lse, grads = _run(lambda **kw: joint_attention_blocked(**kw, block=block), tensors, kwargs, _d_out(tensors))
    assert out.dtype == tensors["q"].dtype and lse.dtype == torch.float32 and not lse.requires_grad
    assert_close_rel(out.float(), ref_out.float(), "out")
    assert_close_rel(lse, ref_lse, "lse")
    for name, g in ref_grads.items():
        if g is None:  # the reference never touched it (no entries, no band key): the fast path gives zeros
            assert grads[name] is None or not grads[name].any(), name
        else:
            assert_close_rel(grads[name].float(), g.float(), f"d{name}")


def _d_out(tensors: dict) -> torch.Tensor:
    q = tensors["q"]
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)


GEOMETRIES = [  # (stride, local_window)
    (4, 5),
    (8, 16),
    (4, "tail"),
    (3, 0),
    (8, "tail"),
    (2, 1),
]


@pytest.mark.parametrize("stride, local_window", GEOMETRIES)
@pytest.mark.parametrize("block", [1, 5, 16, 64, None])
def test_prefill_matches_the_reference(stride, local_window, block):
    tensors, kwargs = _inputs(2, 37, 4, 2, 8, stride, local_window, sinks=block in (5, None))
    assert_matches_reference(tensors, kwargs, block)


@pytest.mark.parametrize("stride, local_window", GEOMETRIES)
@pytest.mark.parametrize("H, KV", [(4, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("sinks", [False, True])
def test_heads_and_sinks_match_the_reference(stride, local_window, H, KV, sinks):
    tensors, kwargs = _inputs(1, 29, H, KV, 8, stride, local_window, sinks=sinks)
    assert_matches_reference(tensors, kwargs, 8)


@pytest.mark.parametrize("stride, local_window", GEOMETRIES)
@pytest.mark.parametrize("q_start, Tq", [(40, 1), (43, 1), (20, 7), (17, 13)])
def test_decode_and_chunks_match_the_reference(stride, local_window, q_start, Tq):
    tensors, kwargs = _inputs(2, Tq, 4, 1, 8, stride, local_window, q_start=q_start, sinks=True)
    assert_matches_reference(tensors, kwargs, 4)


@pytest.mark.parametrize("stride, local_window", [(4, 5), (4, "tail"), (8, 16)])
@pytest.mark.parametrize("origin, q_start", [(3, 3), (1, 1), (3, 22)])
def test_shifted_grids_match_the_reference(stride, local_window, origin, q_start):
    Tq = 31 if q_start == origin else 6
    tensors, kwargs = _inputs(2, Tq, 4, 2, 8, stride, local_window, q_start=q_start, origin=origin, sinks=True)
    assert_matches_reference(tensors, kwargs, 8)


@pytest.mark.parametrize("stride, local_window", GEOMETRIES)
@pytest.mark.parametrize("topk", [1, 3, 20])  # 20: more slots than most queries see
@pytest.mark.parametrize("block", [1, 6, None])
def test_top_k_selection_matches_the_reference(stride, local_window, topk, block):
    tensors, kwargs = _inputs(2, 33, 4, 1, 8, stride, local_window, sinks=True, topk=topk)
    assert (kwargs["selected"] < 0).any()
    assert_matches_reference(tensors, kwargs, block)


def test_decoded_top_k_matches_the_reference():
    tensors, kwargs = _inputs(2, 1, 4, 1, 8, 4, 5, q_start=37, sinks=True, topk=6)
    assert_matches_reference(tensors, kwargs, None)


@pytest.mark.parametrize("local_window", [0, 3, "tail"])
@pytest.mark.parametrize("sinks", [False, True])
def test_no_entries_yet_matches_the_reference(local_window, sinks):
    """T < stride: no entry exists; with no local window either, every query sees nothing (out 0; lse -inf, or
    the sink's logit)."""
    tensors, kwargs = _inputs(2, 7, 4, 2, 8, 8, local_window, sinks=sinks)
    assert tensors["kc"].shape[1] == 0
    assert_matches_reference(tensors, kwargs, 3)


def test_bf16_inputs_compute_in_fp32_like_the_reference():
    tensors, kwargs = _inputs(1, 25, 4, 2, 8, 4, 5, sinks=True, dtype=torch.bfloat16)
    ref, ref_lse = joint_attention_reference(**tensors, **kwargs)
    out, lse = joint_attention_blocked(**tensors, **kwargs, block=7)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max()  # one bf16 rounding
    assert_close_rel(lse, ref_lse, "lse")


def test_missing_local_keys_are_a_clear_error():
    tensors, kwargs = _inputs(1, 1, 4, 1, 8, 4, 5, q_start=20)
    tensors["k"], tensors["v"] = tensors["k"][:, 2:], tensors["v"][:, 2:]
    with pytest.raises(ValueError, match="local window reaches further back"):
        joint_attention_blocked(**tensors, **kwargs)


def test_working_memory_is_bounded_by_the_block_not_t_times_entries():
    """T = 512, stride 4 (E = 128), block 16: no op of the forward or the backward creates a tensor beyond the
    inputs' size or one block's (heads x block x (entries + band + sink)) scores, far below the reference's
    (heads x T x entries); saved for backward: nothing larger than an input."""
    B, T, H, KV, D, stride, local_window, block = 1, 512, 4, 1, 16, 4, 8, 16
    tensors, kwargs = _inputs(B, T, H, KV, D, stride, local_window, sinks=True)
    E = tensors["kc"].shape[1]
    inputs = max(x.numel() for x in tensors.values())
    per_block = B * H * block * (E + block + local_span(local_window, stride))
    assert inputs < H * T * E // 4 and per_block < H * T * E // 4  # the bound separates the two

    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel())
        return x

    with LargestTensor() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out, _ = joint_attention_blocked(**tensors, **kwargs, block=block)
        out.backward(torch.ones_like(out))
    assert max(saved) <= inputs
    assert mode.largest <= max(inputs, per_block), (mode.largest, inputs, per_block)
    assert working_bytes(block, E, local_span(local_window, stride), H, D) >= 4 * per_block


def test_choose_block_fits_the_budget_and_grows_with_it():
    args = dict(n_queries=16384, n_entries=2048, local_span=16, heads=4, head_dim=64)
    small, large = choose_block(**args, budget=2**23), choose_block(**args, budget=2**30)
    assert 1 <= small < large
    assert working_bytes(small, 2048, 16, 4, 64) <= 2**23 < working_bytes(2 * small, 2048, 16, 4, 64)
    assert choose_block(**{**args, "n_queries": 1}) == 1  # decode: one query


@pytest.mark.parametrize("topk", [None, 3])
def test_tied_keys_and_values_match_the_reference(topk):
    """V = K (the same tensor for entries and for exact keys, DeepSeek-V4's tied K/V): one gradient, the sum."""
    tensors, kwargs = _inputs(2, 30, 4, 1, 8, 4, 6, sinks=True, topk=topk)
    grads = []
    for fn in (joint_attention_reference, joint_attention_blocked):
        q, kc, k = (tensors[n].detach().clone().requires_grad_() for n in ("q", "kc", "k"))
        out, _ = fn(q, kc, kc, k, k, sinks=tensors["sinks"], **kwargs)
        grads.append(torch.autograd.grad(out, (q, kc, k), _d_out(tensors)))
    for name, g, ref in zip(("q", "kc", "k"), *reversed(grads)):
        assert_close_rel(g, ref, f"d{name}")


def test_the_configured_block_reaches_the_fast_path(monkeypatch):
    """``attention.block`` is the block every compressed layer's fast path runs with; a bad one is a ConfigError."""
    from ckv.attention import blocked

    seen = []
    original = blocked._JointAttention.apply
    monkeypatch.setattr(blocked._JointAttention, "apply", lambda *a: seen.append(a[-1].block) or original(*a))
    assert_impls_match(dict(block=3), 30, "torch")  # the reference ignores it
    assert seen and set(seen) == {3}
    with pytest.raises(ConfigError, match="attention.block"):
        AttentionConfig.from_dict(dict(kind="compressed", block=0))
