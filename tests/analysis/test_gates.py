"""Gate concentration: the effective number of offsets on constructed gates, recording through a model, errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ckv.analysis.gates import GateAccumulator, effective_offsets, gate_statistics, peak_shifts, phase_profile
from ckv.analysis.hooks import AnalysisNotApplicable, gated_branches
from ckv.eval import build_task, load_ckv_model

from ..eval.helpers import make_run
from .conftest import SPEC, options

W = 4
GATED = dict(kind="compressed", window=W, stride=W, local_window=4)


def test_effective_offsets_of_known_distributions() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]])
    assert torch.allclose(effective_offsets(p), torch.tensor([1.0, 4.0, 2.0]))


def test_static_and_per_window_concentration_differ_for_content_dependent_gates() -> None:
    """Each window one-hot, on a different offset each time: every single gate uses 1 offset, the average uses all
    W; a window with an absent position is not counted."""
    acc = GateAccumulator()
    alpha = torch.eye(W)[None, :, :, None, None].repeat(2, 1, 1, 3, 1)  # (B=2, E=4, W, KV=3, C=1)
    acc.add(alpha, torch.ones(W, W, dtype=torch.bool))
    partial = torch.tensor([[False, True, True, True]])  # one entry whose first position is absent
    acc.add(torch.full((2, 1, W, 3, 1), 1 / 3).masked_fill(~partial[None, :, :, None, None], 0), partial)
    rows = acc.summary(W)
    assert len(rows) == 3 and all(r["windows"] == 8 for r in rows)
    for r in rows:
        assert r["static"] == pytest.approx(W) and r["per_window"] == pytest.approx(1.0)
        assert r["profile"] == pytest.approx([1.0] * W)


def test_vector_gates_are_summarised_per_channel_then_averaged() -> None:
    acc = GateAccumulator()
    alpha = torch.zeros(1, 1, W, 1, 2)
    alpha[0, 0, :, 0, 0] = 1 / W  # channel 0 uniform: W offsets
    alpha[0, 0, 1, 0, 1] = 1.0  # channel 1 one-hot: 1 offset
    acc.add(alpha, torch.ones(1, W, dtype=torch.bool))
    (row,) = acc.summary(W)
    assert row["static"] == pytest.approx((W + 1) / 2) and row["per_window"] == pytest.approx((W + 1) / 2)
    assert row["profile"] == pytest.approx([0.5, 0.5 + W / 2, 0.5, 0.5]) and row["peak_offset"] == 1


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_constructed_gates_through_a_model(tmp_path: Path, gate: str) -> None:
    """Zero gate maps: a zero bias gives uniform gates (W offsets), a large bias on offset 2 one-hot gates (1)."""
    model = load_ckv_model(make_run(tmp_path, attention=dict(GATED, gate=gate)), device="cpu")
    task = build_task(SPEC, model, 2)
    branches = gated_branches(model.module, "gates")
    with torch.no_grad():
        for b in branches:
            b.compressor.gate.weight.zero_()
    rows, _ = gate_statistics(model, task, options(tmp_path, limit=2))
    assert [(r["layer"], r["branch"]) for r in rows] == [(0, "K"), (0, "V")]
    for r in rows:
        assert r["static"] == pytest.approx(W) and r["per_window"] == pytest.approx(W)
    with torch.no_grad():
        for b in branches:
            b.compressor.gate.bias[2] = 50.0
    rows, _ = gate_statistics(model, task, options(tmp_path, limit=2))
    for r in rows:
        assert r["static"] == pytest.approx(1.0, abs=1e-5) and r["per_window"] == pytest.approx(1.0, abs=1e-5)
        assert r["peak_offset"] == 2 and r["profile"][2] == pytest.approx(W, abs=1e-5)
    assert all(not b.compressor.pooling._forward_hooks for b in branches)  # the recording hooks are gone


def test_peak_shift_is_value_peak_minus_key_peak_mod_window() -> None:
    rows = [
        {"layer": 0, "kv_head": 0, "branch": "K", "peak_offset": 3},
        {"layer": 0, "kv_head": 0, "branch": "V", "peak_offset": 0},
    ]
    assert peak_shifts(rows, W) == [{"layer": 0, "kv_head": 0, "k_peak": 3, "v_peak": 0, "shift": 1}]


@pytest.mark.parametrize(
    "attention, message",
    [
        (dict(kind="full"), "has no compressor"),
        (dict(GATED, gate=None), "uniform averaging"),
    ],
)
def test_gates_do_not_apply_without_learned_gates(tmp_path: Path, attention: dict, message: str) -> None:
    model = load_ckv_model(make_run(tmp_path, attention=attention), device="cpu")
    with pytest.raises(AnalysisNotApplicable, match=message):
        gate_statistics(model, build_task(SPEC, model, 1), options(tmp_path, limit=1))


def test_tied_kv_has_only_key_gates(tmp_path: Path) -> None:
    model = load_ckv_model(make_run(tmp_path, attention=dict(GATED, kv="tied")), device="cpu")
    assert [b.name for b in gated_branches(model.module, "gates")] == ["K"]
    assert not math.isnan(
        gate_statistics(model, build_task(SPEC, model, 1), options(tmp_path, limit=1))[0][0]["static"]
    )


def test_phase_profile_folds_offsets_to_the_phases_of_their_tokens() -> None:
    """W=8/S=4: offset i holds phase (i - 8) mod 4 = i mod 4, two offsets per phase (uniform share 2/8); W=8/S=6:
    phase (i + 4) mod 6, phases 4 and 5 have two offsets, 0..3 one (share 1/8)."""
    one_hot = [0.0, 0.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # W * E[alpha]: all mass on offset 2
    assert phase_profile(np.array(one_hot), 4).tolist() == [0.0, 0.0, 1 / (2 / 8), 0.0]
    assert phase_profile(np.array(one_hot), 6).tolist() == [1 / (1 / 8), 0.0, 0.0, 0.0, 0.0, 0.0]
    assert phase_profile(np.ones(8), 6).tolist() == [1.0] * 6  # uniform = 1 however uneven the fold
    assert phase_profile(np.array(one_hot), 4, grid_offset=1).tolist() == [0.0, 0.0, 0.0, 4.0]  # grid shifted by 1
    assert phase_profile(np.arange(4.0), 4).tolist() == [0.0, 1.0, 2.0, 3.0]  # W == S: the offset profile itself


def test_a_w8_s4_gate_through_a_model_per_offset_and_per_phase(tmp_path: Path) -> None:
    """Zero gate maps, a large bias on offset 2: every full window puts its weight on offset 2, i.e. phase 2
    (uniform share 2/8, so g = 4); the value gate's row is rolled by -1 as the paper's (g_V[r] = phase r + 1)."""
    model = load_ckv_model(make_run(tmp_path, attention=dict(GATED, window=8, stride=4)), device="cpu")
    with torch.no_grad():
        for b in gated_branches(model.module, "gates"):
            b.compressor.gate.weight.zero_()
            b.compressor.gate.bias.zero_()
            b.compressor.gate.bias[2] = 50.0
    rows, _ = gate_statistics(model, build_task(SPEC, model, 2), options(tmp_path, limit=2))
    k, v = rows
    assert (k["branch"], v["branch"], k["phase_roll"], v["phase_roll"]) == ("K", "V", 0, -1)
    assert k["profile"] == pytest.approx([0, 0, 8, 0, 0, 0, 0, 0], abs=1e-5) and k["peak_offset"] == 2
    assert k["phase_profile"] == pytest.approx([0, 0, 4, 0], abs=1e-5)
    assert v["phase_profile"] == pytest.approx([0, 4, 0, 0], abs=1e-5)
