"""The pooling kernel against ``pool_reference``: pooled entries, weights, and gradients to payloads and logits."""

from __future__ import annotations

import pytest
import torch

from ckv.attention.reference import pool_reference
from ckv.geometry import window_positions
from ckv_kernels import pool

from .helpers import DEVICE, fp32_leaves, rel_max, rel_rms

# Relative RMS error allowed per payload dtype; observed under the interpreter: fp32 ~1e-7, fp16 ~2e-4,
# bf16 ~3e-3 (the kernel accumulates in fp32; the error is the rounding of its stored results).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def pool_inputs(B, E, W, KV, D, gate, dtype, stride, first_entry=0):
    """payload (B, E, W, KV, D), logits (B, E, W, KV, 1 | D) or None, present (E, W) from the geometry."""
    _, present = window_positions(first_entry, E, W, stride, device=DEVICE)
    payload = torch.randn(B, E, W, KV, D, device=DEVICE).to(dtype).requires_grad_()
    G = {"scalar": 1, "vector": D}.get(gate)
    logits = None if G is None else (2 * torch.randn(B, E, W, KV, G, device=DEVICE)).to(dtype).requires_grad_()
    return payload, logits, present


@pytest.mark.parametrize(
    "W, S, gate, dtype, D, E, first_entry",
    [
        (8, 8, "scalar", torch.float32, 64, 9, 0),  # W == S
        (8, 4, "vector", torch.float32, 128, 9, 0),  # W > S: entry 0 starts at -4 and pools 4 present tokens
        (12, 8, "scalar", torch.float16, 64, 7, 0),  # W not a multiple of S
        (6, 4, "mean", torch.float32, 64, 9, 0),
        (12, 8, "vector", torch.bfloat16, 64, 5, 0),
        (8, 4, "mean", torch.bfloat16, 128, 4, 0),
        (8, 4, "scalar", torch.float32, 64, 5, 3),  # later entries (decoding cache): every offset present
        (5, 2, "vector", torch.float16, 24, 11, 0),  # odd window, head dim not a power of two
    ],
)
def test_matches_reference(W, S, gate, dtype, D, E, first_entry):
    payload, logits, present = pool_inputs(2, E, W, 2, D, gate, dtype, S, first_entry)
    pooled, alpha = pool(payload, logits, present)
    leaves = [payload] + ([logits] if logits is not None else [])
    grad_out = torch.randn_like(pooled)
    grads = torch.autograd.grad(pooled, leaves, grad_out)

    ref_leaves = fp32_leaves(leaves)
    ref_pooled, ref_alpha = pool_reference(ref_leaves[0], ref_leaves[1] if logits is not None else None, present)
    ref_grads = torch.autograd.grad(ref_pooled, ref_leaves, grad_out.float())

    tol = TOL[dtype]
    assert pooled.dtype == dtype and alpha.dtype == dtype and alpha.shape == ref_alpha.shape
    assert rel_rms(pooled, ref_pooled) < tol
    assert rel_rms(alpha, ref_alpha) < tol
    assert (alpha[:, ~present] == 0).all()  # absent offsets get no weight
    for name, g, rg in zip(("d payload", "d logits"), grads, ref_grads):
        assert rel_rms(g, rg) < tol, f"{name}: {rel_rms(g, rg):.2e}"
        if dtype == torch.float32:
            assert rel_max(g, rg) < 10 * tol, name


@pytest.mark.parametrize("gate", ["scalar", "vector", "mean"])
def test_window_with_nothing_present_pools_to_zero(gate):
    payload, logits, present = pool_inputs(1, 3, 4, 1, 16, gate, torch.float32, 4)
    present = present.clone()
    present[1] = False
    pooled, _ = pool(payload, logits, present)
    assert torch.isfinite(pooled).all() and (pooled[:, 1] == 0).all()


def test_repeat_runs_are_bitwise_identical():
    payload, logits, present = pool_inputs(2, 9, 8, 2, 64, "vector", torch.float16, 4)
    runs = []
    for _ in range(2):
        pooled, alpha = pool(payload, logits, present)
        runs.append([pooled, alpha, *torch.autograd.grad(pooled, [payload, logits], torch.ones_like(pooled))])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_unsupported_inputs_raise_clear_errors():
    payload, logits, present = pool_inputs(1, 3, 4, 2, 16, "scalar", torch.float32, 4)
    with pytest.raises(ValueError, match="present must be"):
        pool(payload, logits, present[:, :2])
    with pytest.raises(ValueError, match="logits must be"):
        pool(payload, logits.expand(-1, -1, -1, -1, 3), present)
    with pytest.raises(ValueError, match="payload must be"):
        pool(payload[0], logits, present)
    with pytest.raises(TypeError, match="payload must be float32"):
        pool(payload.int(), logits, present)
