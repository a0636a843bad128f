"""The joint-attention kernels against ``joint_attention_reference``: output, log-sum-exp and every gradient.

Inputs are drawn in the tested dtype; the reference runs in fp32 on the same values, so the error measured is
the kernel's own (fp32 accumulation, rounding of inputs to dots and of the stored results)."""

from __future__ import annotations

import pytest
import torch

import ckv_kernels
from ckv.attention.reference import joint_attention_reference
from ckv_kernels import joint_attention

from .helpers import TOL, attention_inputs, fp32_leaves, local_args, rel_max, rel_rms

NAMES = ("dq", "dkc", "dvc", "dk", "dv")


def check_against_reference(B, Tq, H, KV, D, stride, local_window, dtype=torch.float32, q_start=0, extra_entries=0):
    """Run kernel and reference forward and backward on the same inputs and assert every error is in TOL.
    Returns the kernel's outputs and gradients."""
    inputs = attention_inputs(B, Tq, H, KV, D, stride=stride, q_start=q_start, extra_entries=extra_entries, dtype=dtype)
    out, lse = joint_attention(*inputs, stride=stride, q_start=q_start, **local_args(local_window, stride))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)

    ref_inputs = fp32_leaves(inputs)
    ref_out, ref_lse = joint_attention_reference(*ref_inputs, stride=stride, local_window=local_window, q_start=q_start)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.float(), allow_unused=True)

    tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == ref_out.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see nothing differ"
    seen = torch.isfinite(ref_lse)
    assert rel_rms(lse[seen], ref_lse[seen]) < 1e-5  # lse is computed in fp32 from the same scores
    assert rel_rms(out, ref_out) < tol, f"out: {rel_rms(out, ref_out):.2e}"
    for name, g, rg in zip(NAMES, grads, ref_grads):
        assert torch.isfinite(g).all(), name
        err = rel_rms(g, rg)
        assert err < tol, f"{name}: rel RMS {err:.2e} >= {tol:.0e}"
        if dtype == torch.float32:
            assert rel_max(g, rg) < 10 * tol, f"{name}: rel max-abs {rel_max(g, rg):.2e}"
    return out, lse, grads


# Every axis the kernels support is covered here, without the full cartesian product:
# lengths 1, 5, 63, 130, 250 (not multiples of stride or of the tiles), strides 1, 4, 6, 8, local 0 / 16 / tail,
# GQA ratio 1, 2, 3, 8, head dim 64 and 128, fp32, fp16, bf16, batch 2, chunked prefill and decoding (q_start).
FAST = [
    # B, Tq, H, KV, D, stride, local, dtype
    (1, 1, 2, 1, 64, 1, 16, torch.float32),  # stride 1: the one query sees entry 0 and its own key
    (1, 5, 4, 4, 64, 4, 0, torch.float32),  # queries 0..2 see nothing at all
    (1, 63, 8, 1, 64, 8, "tail", torch.float32),
    (1, 130, 4, 2, 128, 8, 16, torch.float32),
    (2, 250, 2, 2, 64, 4, 16, torch.float32),
    (1, 77, 6, 2, 64, 6, 5, torch.float32),  # GQA ratio 3: padded head rows
    (1, 130, 4, 2, 64, 4, "tail", torch.float16),
    (1, 63, 8, 1, 128, 8, 16, torch.bfloat16),
    (1, 250, 2, 1, 64, 8, 0, torch.bfloat16),
]


@pytest.mark.parametrize("B, Tq, H, KV, D, stride, local, dtype", FAST)
def test_matches_reference(B, Tq, H, KV, D, stride, local, dtype):
    check_against_reference(B, Tq, H, KV, D, stride, local, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    "B, Tq, H, KV, D, stride, local, dtype",
    [
        (2, 250, 16, 2, 128, 8, 16, torch.float16),
        (1, 250, 16, 1, 128, 4, "tail", torch.bfloat16),
        (1, 250, 8, 1, 64, 6, 16, torch.float32),
        (2, 130, 4, 4, 128, 8, 0, torch.float16),
    ],
)
def test_matches_reference_larger(B, Tq, H, KV, D, stride, local, dtype):
    check_against_reference(B, Tq, H, KV, D, stride, local, dtype)


@pytest.mark.parametrize("q_start, Tq, local", [(37, 100, 16), (200, 1, 16), (45, 20, "tail"), (203, 1, "tail")])
def test_chunked_prefill_and_decoding_positions(q_start, Tq, local):
    """Queries that start later (cache continuation): exact keys from position 0, entries of the whole prefix."""
    check_against_reference(1, Tq, 4, 2, 64, 8, local, q_start=q_start)


def test_unreachable_keys_and_entries_get_exact_zero_gradients():
    """Keys outside every local window and entries no query sees are still written: gradient exactly 0."""
    q_start, Tq, stride = 60, 20, 8
    _, _, (dq, dkc, dvc, dk, dv) = check_against_reference(
        1, Tq, 4, 2, 64, stride, 16, q_start=q_start, extra_entries=3
    )
    first_local = q_start - 16 + 1
    assert (dk[:, :first_local] == 0).all() and (dv[:, :first_local] == 0).all()
    visible = (q_start + Tq) // stride
    assert (dkc[:, visible:] == 0).all() and (dvc[:, visible:] == 0).all()


def test_repeat_runs_are_bitwise_identical():
    """No atomics: every output element is written by one program in a fixed order, so reruns are identical."""
    inputs = attention_inputs(2, 70, 4, 2, 64, stride=4, dtype=torch.float16)
    grad_out = None
    results = []
    for _ in range(2):
        out, lse = joint_attention(*inputs, stride=4, local_span=16)
        grad_out = torch.randn_like(out) if grad_out is None else grad_out
        results.append([out, lse, *torch.autograd.grad(out, inputs, grad_out)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_explicit_scale():
    inputs = attention_inputs(1, 40, 4, 2, 64, stride=4)
    out, lse = joint_attention(*inputs, stride=4, local_span=16, scale=0.3)
    ref_out, ref_lse = joint_attention_reference(*fp32_leaves(inputs), stride=4, local_window=16, scale=0.3)
    assert rel_rms(out, ref_out) < TOL[torch.float32] and rel_rms(lse, ref_lse) < 1e-5


def test_lse_is_not_differentiable():
    inputs = attention_inputs(1, 10, 2, 1, 64, stride=4)
    _, lse = joint_attention(*inputs, stride=4, local_span=4)
    assert not lse.requires_grad


def _inputs(**shape):
    dims = dict(B=1, Tq=20, H=4, KV=2, D=64)
    dims.update(shape)
    return attention_inputs(dims["B"], dims["Tq"], dims["H"], dims["KV"], dims["D"], stride=4)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x: _inputs(D=48), "head_dim=48 is not supported"),
        (lambda x: _inputs(H=6, KV=4), "multiple of KV heads"),
        (lambda x: [x[0].half(), *x[1:]], "share one dtype"),
        (lambda x: [x[0].int(), *x[1:]], "float32, float16 or bfloat16"),
        (lambda x: [x[0], x[1], x[2][:, :-1], x[3], x[4]], "must match vc"),
        (lambda x: [x[0][0], *x[1:]], "must be 4-d"),
        (lambda x: [x[0], x[1], x[2], x[3][:, -3:], x[4][:, -3:]], "local window reaches back"),
    ],
)
def test_unsupported_inputs_raise_clear_errors(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        joint_attention(*change(_inputs()), stride=4, local_span=16)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(local_span=-1), "local_span=-1 must be an integer >= 0"),
        (dict(local_span=2.0), "must be an integer"),
        (dict(local_span=2, tail=True), "tail mode keeps at most stride - 1 = 3"),
        (dict(local_span=3, tail="tail"), "must be a bool"),
        (dict(local_span=3, q_start=-1), "q_start=-1 must be an integer >= 0"),
    ],
)
def test_bad_window_arguments_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        joint_attention(*_inputs(), stride=4, **kw)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(ckv_kernels._common, "INTERPRET", False)
    inputs = [t.detach().cpu() for t in _inputs()]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        joint_attention(*inputs, stride=4, local_span=16)
