"""Top-k selection (DeepSeek-V4's indexer: each position attends to the entries its row of ``selected`` lists, plus
its local window and the sinks) in ``joint_attention_reference`` and the kernels: output, log-sum-exp and every
gradient, the reference's own properties, and clear errors.

The interpreter runs the top-k kernels one program per position, slowly, so the shapes stay tiny (at most 20
positions per call)."""

from __future__ import annotations

import pytest
import torch

from ckv.attention.reference import joint_attention_reference
from ckv.geometry import num_entries
from ckv_kernels import joint_attention

from .helpers import DEVICE, TOL, attention_inputs, fp32_leaves, local_args, random_selection, rel_max, rel_rms

NAMES = ("dq", "dkc", "dvc", "dk", "dv", "dsinks")


def run_both(B, Tq, H, KV, D, stride, local, topk, q_start=0, sinks=False, dtype=torch.float32, **selection):
    """Kernel and reference, forward and backward, on the same inputs and selection. Returns the selection, the
    kernel's (out, lse, grads) and the reference's (fp32 on the same values; grads None-free)."""
    inputs = attention_inputs(B, Tq, H, KV, D, stride=stride, q_start=q_start, dtype=dtype)
    E = inputs[1].shape[1]
    selected = random_selection(B, Tq, E, topk, stride=stride, q_start=q_start, **selection)
    if sinks:
        inputs.append((2 * torch.randn(H, device=DEVICE)).requires_grad_())
    sink = inputs[5] if sinks else None
    out, lse = joint_attention(
        *inputs[:5], stride=stride, q_start=q_start, sinks=sink, selected=selected, **local_args(local, stride)
    )
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)

    ref_inputs = fp32_leaves(inputs)
    ref_out, ref_lse = joint_attention_reference(
        *ref_inputs[:5],
        stride=stride,
        local_window=local,
        q_start=q_start,
        sinks=ref_inputs[5] if sinks else None,
        selected=selected,
    )
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.float(), allow_unused=True)
    ref_grads = [torch.zeros_like(x) if g is None else g for x, g in zip(ref_inputs, ref_grads)]
    return selected, (out, lse, grads), (ref_out, ref_lse, ref_grads)


def assert_close(kernel, reference, dtype):
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = kernel, reference
    tol = TOL[dtype]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see nothing differ"
    seen = torch.isfinite(ref_lse)
    assert rel_rms(lse[seen], ref_lse[seen]) < 1e-5
    assert rel_rms(out, ref_out) < tol, f"out: {rel_rms(out, ref_out):.2e}"
    for name, g, rg in zip(NAMES, grads, ref_grads):
        assert torch.isfinite(g).all(), name
        err = rel_rms(g, rg)
        assert err < tol, f"{name}: rel RMS {err:.2e} >= {tol:.0e}"
        if dtype == torch.float32:
            assert rel_max(g, rg) < 10 * tol, f"{name}: rel max-abs {rel_max(g, rg):.2e}"


@pytest.mark.parametrize(
    "B, Tq, H, KV, D, stride, local, topk, q_start, sinks, dtype",
    [
        # binding (up to 5 visible entries, 2 kept), empty slots early on, GQA 4, sinks, int window
        (1, 20, 4, 1, 16, 4, 5, 2, 0, True, torch.float32),
        (2, 9, 3, 1, 16, 4, "tail", 1, 0, False, torch.float32),  # batch 2, GQA 3 (padded rows), tail window
        (1, 1, 4, 2, 16, 4, 16, 4, 37, True, torch.float32),  # one decoding step: 4 of 9 entries, 2 KV heads
        (1, 8, 4, 1, 32, 4, 3, 3, 21, False, torch.bfloat16),  # chunked prefill
        (1, 8, 2, 1, 16, 2, 0, 2, 0, False, torch.float32),  # no local window: position 0 sees nothing
        (1, 6, 2, 1, 16, 2, 3, 0, 0, True, torch.float32),  # K = 0: the local window and the sink only
    ],
)
def test_selection_matches_reference(B, Tq, H, KV, D, stride, local, topk, q_start, sinks, dtype):
    _, kernel, reference = run_both(B, Tq, H, KV, D, stride, local, topk, q_start, sinks, dtype, list_invisible=True)
    assert_close(kernel, reference, dtype)


def test_entries_nobody_selects_get_exact_zero_gradients():
    """Entries 1 and 4 are visible to most positions but never selected; the others are, and get gradients."""
    selected, (_, _, grads), (_, _, ref_grads) = run_both(1, 16, 4, 1, 16, 2, 3, 2, exclude=(1, 4))
    for dkc_or_dvc in (grads[1], grads[2], ref_grads[1], ref_grads[2]):
        assert (dkc_or_dvc[:, [1, 4]] == 0).all()
        assert (dkc_or_dvc[:, [0, 2, 3]] != 0).all()
    assert not ((selected == 1) | (selected == 4)).any()


def test_kernel_ignores_the_order_within_a_row_bitwise():
    """The kernels sort each row and reduce every entry's gradient over its positions in a fixed order: a shuffled
    selection gives bitwise the same output and gradients, run after run (no atomics)."""
    B, Tq, H, KV, D, S = 1, 8, 4, 1, 16, 2
    inputs = attention_inputs(B, Tq, H, KV, D, stride=S)
    selected = random_selection(B, Tq, inputs[1].shape[1], 2, stride=S)
    shuffled = selected.gather(-1, torch.rand(selected.shape, device=DEVICE).argsort(-1))
    assert not torch.equal(shuffled, selected)
    grad_out = None
    runs = []
    for sel in (selected, shuffled):
        out, lse = joint_attention(*inputs, stride=S, local_span=5, selected=sel)
        grad_out = torch.randn_like(out) if grad_out is None else grad_out
        runs.append([out, lse, *torch.autograd.grad(out, inputs, grad_out)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# --- the reference's own properties (no kernels: fast) -----------------------------------------------------------


def reference_run(inputs, selected, local=5, stride=4, q_start=0, sinks=None):
    out, lse = joint_attention_reference(
        *inputs, stride=stride, local_window=local, q_start=q_start, sinks=sinks, selected=selected
    )
    leaves = inputs + ([sinks] if sinks is not None else [])
    return [out, lse, *torch.autograd.grad(out, leaves, torch.ones_like(out))]


@pytest.mark.parametrize("local, q_start, sinks", [(5, 0, False), ("tail", 0, True), (3, 29, True)])
def test_reference_selecting_every_visible_entry_is_the_dense_reference(local, q_start, sinks):
    """Bitwise: the selection only masks, and selecting everything visible masks what the dense path masks."""
    B, Tq, S = 2, 20, 4
    inputs = attention_inputs(B, Tq, 4, 2, 16, stride=S, q_start=q_start, extra_entries=2)
    sink = torch.randn(4, device=DEVICE, requires_grad=True) if sinks else None
    E = inputs[1].shape[1]
    every = random_selection(B, Tq, E, E, stride=S, q_start=q_start, list_invisible=True)  # also invisible ones
    assert (every >= num_entries(q_start + Tq, S)).any()
    dense = reference_run(inputs, None, local, S, q_start, sink)
    for a, b in zip(dense, reference_run(inputs, every, local, S, q_start, sink)):
        assert torch.equal(a, b)


def test_reference_ignores_the_order_within_a_row():
    inputs = attention_inputs(2, 30, 4, 1, 16, stride=4)
    selected = random_selection(2, 30, inputs[1].shape[1], 3, stride=4)
    shuffled = selected.gather(-1, torch.rand(selected.shape, device=DEVICE).argsort(-1))
    assert not torch.equal(shuffled, selected)
    for a, b in zip(reference_run(inputs, selected), reference_run(inputs, shuffled)):
        assert torch.equal(a, b)


def test_reference_selection_binds():
    """A binding selection changes the output of the positions whose visible entries outnumber K, and only those."""
    inputs = attention_inputs(1, 30, 4, 1, 16, stride=4)
    selected = random_selection(1, 30, inputs[1].shape[1], 2, stride=4)
    dense, sparse = reference_run(inputs, None)[0], reference_run(inputs, selected)[0]
    binds = torch.arange(30, device=DEVICE) + 1 >= 3 * 4  # three or more visible entries
    assert torch.equal(dense[:, ~binds], sparse[:, ~binds])
    assert ((dense[:, binds] - sparse[:, binds]).abs().amax(dim=(0, 2, 3)) > 1e-3).all()


# --- errors ------------------------------------------------------------------------------------------------------


def _bad(change):
    """A valid selection for 1 x 8 positions, 2 entries, K = 2 (stride 4), changed by ``change``."""
    selected = torch.tensor([[-1, -1]] * 3 + [[0, -1]] * 4 + [[1, 0]], device=DEVICE)[None]
    return change(selected)


BAD_SELECTIONS = [
    (lambda s: s.clone().index_put_((torch.tensor(0), torch.tensor(7)), torch.tensor([1, 1])), "repeats an entry"),
    (lambda s: s.clone().fill_(2), r"indices 2 \.\. 2; allowed: -1 \(empty slot\) \.\. E-1 = 1"),
    (lambda s: s.clone().fill_(-2), r"indices -2 \.\. -2"),
    (lambda s: s.float(), "int64 or int32"),
    (lambda s: s[:, :5], r"\(B, Tq, K\) = \(1, 8, K\)"),
    (lambda s: s[0], r"\(B, Tq, K\) = \(1, 8, K\)"),
]


@pytest.mark.parametrize("change, match", BAD_SELECTIONS)
def test_bad_selection_raises_a_clear_error(change, match):
    inputs = attention_inputs(1, 8, 2, 1, 16, stride=4)
    with pytest.raises(ValueError, match=match):
        joint_attention_reference(*inputs, stride=4, local_window=3, selected=_bad(change))
    with pytest.raises(ValueError, match=match):
        joint_attention(*inputs, stride=4, local_span=3, selected=_bad(change))
