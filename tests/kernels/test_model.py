"""The compressed backend's ``impl`` switch: dispatch rules, and the whole model's loss and gradients equal
between ``impl=reference`` (the oracle) and ``impl=triton`` (the kernels) or ``impl=torch`` (the fast path)."""

from __future__ import annotations

import pytest
import torch

import ckv_kernels
from ckv import Transformer
from ckv.attention import dispatch
from ckv.attention.reference import pool_reference
from ckv.geometry import window_positions

from .helpers import DEVICE, assert_impls_match, model_config, rel_rms


@pytest.mark.parametrize(
    "attention",
    [
        dict(),  # paper default: W8/S8, 1 KV head (GQA 4), scalar gate, separate K/V, 16-token local window
        dict(window=8, stride=4, gate=dict(kind="vector"), kv="tied", kv_heads=2, local_window="tail"),
        dict(window=12, stride=8, gate=None, kv_heads=4, local_window=0),  # W not a multiple of S, no GQA
        # DeepSeek-V4 CSA (conf/attention/deepseek_v4_csa.yaml at this size): per-series maps, sinks, trailing RoPE
        dict(
            window=8,
            stride=4,
            gate=dict(kind="vector"),
            offset_maps="series",
            kv="tied",
            compressed_norm="post",
            rope=dict(mode="partial", dims=8, side="trailing", pairing="interleaved", theta=160000.0),
            sink=True,
            output_rope="inverse",
            local_window=5,
        ),
    ],
)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_model_loss_and_gradients_match_between_impls(attention, impl):
    torch.manual_seed(0)
    assert_impls_match(attention, 46, impl)


def test_decoding_with_kernels_matches_the_full_forward():
    """Cache continuation (q_start > 0, exact keys trimmed to the local window) through the kernels."""
    torch.manual_seed(0)
    model = Transformer(model_config("triton", window=8, stride=4)).to(DEVICE).eval()
    ids = torch.randint(0, 64, (1, 30), device=DEVICE)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1)
        steps = [model(ids[:, :21], cache)] + [model(ids[:, t : t + 1], cache) for t in range(21, 30)]
    assert rel_rms(torch.cat(steps, dim=1), full) < 1e-5


def test_auto_takes_the_fast_path_off_cuda_and_triton_on_cuda():
    """Off CUDA ``auto`` runs the fast path, or the reference for a call whose scores are small (the studies' exact
    numbers); an explicit ``torch`` or ``reference`` is kept whatever the size."""
    cpu, small, large = torch.device("cpu"), dispatch.REFERENCE_MAX_SCORES, dispatch.REFERENCE_MAX_SCORES + 1
    assert dispatch.resolve_impl("auto", cpu) == "torch"
    assert dispatch.resolve_impl("auto", cpu, small) == "reference"
    assert dispatch.resolve_impl("auto", cpu, large) == "torch"
    assert dispatch.resolve_impl("torch", cpu, small) == "torch"
    assert dispatch.resolve_impl("reference", cpu, large) == "reference"
    assert dispatch.resolve_impl("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="not one of"):
        dispatch.resolve_impl("fast", cpu)


@pytest.mark.skipif(not ckv_kernels.INTERPRET, reason="the interpreter is off (GPU run)")
def test_triton_on_cpu_says_it_runs_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(dispatch, "_interpreter_announced", False)
    with pytest.warns(RuntimeWarning, match="interpreter"):
        assert dispatch.resolve_impl("triton", torch.device("cpu")) == "triton"
    monkeypatch.setattr(ckv_kernels, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.resolve_impl("triton", torch.device("cpu"))


@pytest.mark.parametrize("logit_dim", [None, 1, 16])
def test_pool_dispatch_returns_the_reference_weights(logit_dim):
    _, present = window_positions(0, 6, 8, 4, device=DEVICE)
    payload = torch.randn(2, 6, 8, 2, 16, device=DEVICE)
    logits = None if logit_dim is None else torch.randn(2, 6, 8, 2, logit_dim, device=DEVICE)
    pooled, alpha = dispatch.pool(payload, logits, present, impl="triton")
    ref_pooled, ref_alpha = pool_reference(payload, logits, present)
    assert alpha.shape == ref_alpha.shape
    assert rel_rms(pooled, ref_pooled) < 1e-5 and rel_rms(alpha, ref_alpha) < 1e-5
