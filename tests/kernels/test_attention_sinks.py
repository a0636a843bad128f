"""Attention sinks (DeepSeek-V4: one extra logit per head in the joint softmax, probability dropped) in the
joint-attention kernels against ``joint_attention_reference``: output, log-sum-exp and every gradient, the
sinks' included."""

from __future__ import annotations

import pytest
import torch

from ckv.attention.reference import joint_attention_reference
from ckv_kernels import joint_attention

from .helpers import DEVICE, TOL, attention_inputs, fp32_leaves, local_args, rel_max, rel_rms

NAMES = ("dq", "dkc", "dvc", "dk", "dv", "dsinks")


@pytest.mark.parametrize(
    "B, Tq, H, KV, D, stride, local, q_start, dtype",
    [
        (1, 23, 4, 1, 16, 4, 5, 0, torch.float32),  # V4's CSA geometry, MQA
        (2, 70, 6, 2, 64, 8, "tail", 0, torch.float32),  # GQA 3 (padded rows), tail window
        (1, 9, 4, 4, 16, 4, 0, 0, torch.float32),  # no local window: the first queries see only the sink
        (1, 1, 8, 1, 16, 4, 3, 40, torch.float32),  # one decoding step
        (1, 40, 4, 1, 32, 4, 6, 0, torch.bfloat16),
    ],
)
def test_sinks_match_reference(B, Tq, H, KV, D, stride, local, q_start, dtype):
    torch.manual_seed(0)
    inputs = attention_inputs(B, Tq, H, KV, D, stride=stride, q_start=q_start, dtype=dtype)
    sinks = (2 * torch.randn(H, device=DEVICE)).requires_grad_()  # fp32, like V4's
    out, lse = joint_attention(*inputs, stride=stride, q_start=q_start, sinks=sinks, **local_args(local, stride))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [*inputs, sinks], grad_out)

    ref_inputs = fp32_leaves([*inputs, sinks])
    ref_out, ref_lse = joint_attention_reference(
        *ref_inputs[:5], stride=stride, local_window=local, q_start=q_start, sinks=ref_inputs[5]
    )
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.float(), allow_unused=True)

    tol = TOL[dtype]
    assert torch.isfinite(lse).all() and torch.isfinite(ref_lse).all()  # the sink is always seen
    assert rel_rms(lse, ref_lse) < 1e-5
    assert rel_rms(out, ref_out) < tol, f"out: {rel_rms(out, ref_out):.2e}"
    for name, g, rg in zip(NAMES, grads, ref_grads):
        rg = torch.zeros_like(g, dtype=torch.float32) if rg is None else rg
        assert g.dtype == (torch.float32 if name == "dsinks" else dtype), name
        err = rel_rms(g, rg)
        assert err < tol, f"{name}: rel RMS {err:.2e} >= {tol:.0e}"
        if dtype == torch.float32:
            assert rel_max(g, rg) < 10 * tol, f"{name}: rel max-abs {rel_max(g, rg):.2e}"


def test_rows_that_see_only_the_sink_output_zero_and_its_logit_as_lse():
    q, kc, vc, k, v = attention_inputs(1, 3, 2, 1, 16, stride=4)  # queries 0..2 see no entry
    sinks = torch.tensor([0.3, -0.7], device=DEVICE)
    out, lse = joint_attention(q, kc, vc, k, v, stride=4, local_span=0, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, sinks.expand_as(lse))


def test_bad_sinks_raise_a_clear_error():
    inputs = attention_inputs(1, 8, 4, 1, 16, stride=4)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\)"):
        joint_attention(*inputs, stride=4, local_span=3, sinks=torch.zeros(3, device=DEVICE))
