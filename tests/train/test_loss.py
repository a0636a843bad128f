"""ckv.train.loss: the chunked, fused cross-entropy gives today's loss and gradients (hidden states and head weight)."""

import pytest
import torch
import torch.nn.functional as F

from ckv.data import IGNORE
from ckv.train.loss import DEFAULT_IGNORE_INDEX, chunked_cross_entropy


def _reference(h, w, labels):
    return F.cross_entropy((h @ w.T).float().reshape(-1, w.shape[0]), labels.reshape(-1), ignore_index=IGNORE)


def _case(dtype, B=3, T=37, D=24, V=101):
    h = torch.randn(B, T, D, dtype=torch.float32).to(dtype).requires_grad_()
    w = (torch.randn(V, D) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T))
    labels[0, :5] = IGNORE
    labels[2, 30:] = IGNORE
    return h, w, labels


def test_ignore_index_is_the_data_layers():
    assert DEFAULT_IGNORE_INDEX == IGNORE


@pytest.mark.parametrize("chunk", [1, 7, 37, 64, 1000])  # uneven, one row, exactly T, larger than all tokens
def test_same_loss_and_gradients_fp32(chunk):
    h, w, labels = _case(torch.float32)
    ref = _reference(h, w, labels)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    got = chunked_cross_entropy(h, w, labels, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float32
    assert (got - ref).abs().item() < 1e-5
    assert (gh - gh_ref).abs().max().item() < 1e-5 and (gw - gw_ref).abs().max().item() < 1e-5


def test_bf16_inputs_give_an_fp32_loss_close_to_todays():
    h, w, labels = _case(torch.bfloat16)
    ref = _reference(h, w, labels)  # today's path: bf16 logits, fp32 cross-entropy
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    got = chunked_cross_entropy(h, w, labels, chunk_tokens=16)
    gh, gw = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    assert (got - ref).abs().item() < 1e-5  # same bf16 logits row by row, same fp32 reduction
    # gradients: both round fp32 d(logits) to bf16 before the matmuls; the weight gradient sums chunks in fp32
    for a, b in ((gh, gh_ref), (gw, gw_ref)):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_only_ignored_labels_give_zero_and_zero_gradients():
    h, w, labels = _case(torch.float32)
    labels.fill_(IGNORE)
    got = chunked_cross_entropy(h, w, labels, chunk_tokens=8)
    gh, gw = torch.autograd.grad(got, (h, w))
    assert got.item() == 0.0 and not gh.any() and not gw.any()
    assert _reference(h, w, labels).isnan()  # torch's mean over no labels: ckv's lm_loss returns 0 instead


def test_no_grad_and_frozen_weight():
    h, w, labels = _case(torch.float32)
    with torch.no_grad():
        assert (chunked_cross_entropy(h, w, labels, chunk_tokens=5) - _reference(h, w, labels)).abs().item() < 1e-5
    w_frozen = w.detach()
    got = chunked_cross_entropy(h, w_frozen, labels, chunk_tokens=5)
    (gh,) = torch.autograd.grad(got, (h,))
    (gh_ref,) = torch.autograd.grad(_reference(h, w_frozen, labels), (h,))
    assert (gh - gh_ref).abs().max().item() < 1e-5


def test_scaled_upstream_gradient():
    h, w, labels = _case(torch.float32)
    (gh,) = torch.autograd.grad(3.0 * chunked_cross_entropy(h, w, labels, chunk_tokens=9), (h,))
    (gh_ref,) = torch.autograd.grad(3.0 * _reference(h, w, labels), (h,))
    assert (gh - gh_ref).abs().max().item() < 1e-5


def test_bad_arguments():
    h, w, labels = _case(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(h, w, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="head weight"):
        chunked_cross_entropy(h, w[:, :5], labels)
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(h, w, labels[:, :5])
