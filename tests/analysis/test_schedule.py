"""The mechanism analyses on a layer-scheduled model (``model.layers``): a sliding layer, a W4/S4 and a W2/S2
compressed layer, each read with its own attention (gates, knock-outs, gate cycling, the joint view)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ckv.analysis import run_analysis
from ckv.analysis.hooks import AnalysisNotApplicable, gated_branches
from ckv.config import ConfigError
from ckv.eval import LoadedModel, load_ckv_model
from tests.helpers import assert_documented

from ..eval.helpers import make_run, png_ok
from .conftest import SPEC, options

W4S4 = dict(kind="compressed", window=4, stride=4, local_window=4)
SCHEDULE = [
    {"count": 1, "attention": {"kind": "sliding", "sliding_window": 3}},
    {"count": 1},  # the run's attention: W4/S4
    {"count": 1, "attention": dict(W4S4, window=2, stride=2)},
]
KINDS = "1x sliding + 1x compressed + 1x compressed"


def scheduled(tmp_path: Path, layers: list = SCHEDULE) -> LoadedModel:
    overrides = {"n_layers": len(layers), "layers": layers, "n_heads": 4, "n_kv_heads": 2}
    return load_ckv_model(make_run(tmp_path, attention=W4S4, preset_overrides=overrides), device="cpu")


def one_hot_gates(model: LoadedModel, peaks: dict[tuple[int, str], int]) -> None:
    """Zero gate maps and a large bias on one offset per (layer, branch): every full window picks that offset."""
    with torch.no_grad():
        for b in gated_branches(model.module, "gates"):
            b.compressor.gate.weight.zero_()
            b.compressor.gate.bias.zero_()
            b.compressor.gate.bias[peaks[(b.layer, b.name)]] = 50.0


def test_the_gates_of_each_layer_are_read_with_its_own_window_and_stride(tmp_path: Path) -> None:
    model = scheduled(tmp_path)
    assert [(b.layer, b.name) for b in gated_branches(model.module, "gates")] == [
        (1, "K"),
        (1, "V"),
        (2, "K"),
        (2, "V"),
    ]
    one_hot_gates(model, {(1, "K"): 2, (1, "V"): 3, (2, "K"): 1, (2, "V"): 0})
    env = run_analysis({"name": "gates", "checkpoints": "none"}, model, SPEC, options(tmp_path, limit=2, plots=True))
    result = env["analysis"]["results"]
    assert result["window"] == 4 and result["stride"] == 4  # the largest window; the model's phase stride
    k1, k2 = ([r for r in result["gates"] if (r["layer"], r["branch"], r["kv_head"]) == (i, "K", 0)][0] for i in (1, 2))
    assert k1["profile"] == pytest.approx([0, 0, 4, 0], abs=1e-4) and k1["phase_profile"] == pytest.approx(
        k1["profile"]
    )
    assert k2["profile"] == pytest.approx([0, 2], abs=1e-4) and k2["phase_profile"] == pytest.approx([0, 2], abs=1e-4)
    shifts = {(s["layer"], s["kv_head"]): s["shift"] for s in result["peak_shifts"]}
    assert shifts == {(1, 0): 1, (1, 1): 1, (2, 0): 1, (2, 1): 1}  # V peak - K peak mod each layer's own window
    assert png_ok(tmp_path / "gates" / "gate_profiles.png")  # the rows of the W2 layer end at offset 1


def test_gate_layers_are_the_gated_ones(tmp_path: Path) -> None:
    model = scheduled(tmp_path / "a")
    with pytest.raises(ConfigError) as e:
        gated_branches(model.module, "gate_cycling", layers=[0])
    assert str(e.value) == f"layers [0] have no learned gates (layers {KINDS}): choose among layers [1, 2]"
    assert_documented(f"ckv: error: {e.value}")  # analysis.layers=[0] through eval.py
    plain = scheduled(tmp_path / "b", [SCHEDULE[0], {"count": 1, "attention": {"kind": "full"}}])
    with pytest.raises(AnalysisNotApplicable, match=r"has no compressor \(layers 1x sliding \+ 1x full\)"):
        gated_branches(plain.module, "gates")


def test_knock_outs_cover_every_layer_of_the_schedule(tmp_path: Path) -> None:
    model = scheduled(tmp_path)
    env = run_analysis({"name": "knockout", "calibration": 2}, model, SPEC, options(tmp_path / "out", limit=4))
    result = env["analysis"]["results"]
    assert result["stride"] == 4
    labels = [u["label"] for u in result["units"]]
    assert labels == [f"L{i}{kv}" for i in range(3) for kv in ("", " kv0", " kv1")]
    assert all(len(u["phases"]) == 4 for u in result["units"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # S = 2 leaves no interior phase for the paper's fit
def test_gate_cycling_cycles_the_layers_of_one_stride(tmp_path: Path) -> None:
    model = scheduled(tmp_path)
    with pytest.raises(ConfigError) as e:
        run_analysis({"name": "gate_cycling", "deltas": [1]}, model, SPEC, options(tmp_path / "all", limit=2))
    assert str(e.value) == (
        "analysis=gate_cycling: layers [2] have stride [2], not task.stride=4; the prediction needs offset = phase: "
        "cycle the layers of one stride (analysis.layers) with task.stride set to it"
    )
    assert_documented(f"ckv: error: {e.value}")
    env = run_analysis(
        {"name": "gate_cycling", "deltas": [1], "layers": [1]}, model, SPEC, options(tmp_path / "l1", limit=2)
    )
    assert (env["analysis"]["results"]["stride"], env["analysis"]["results"]["layers"]) == (4, [1])
    s2 = dataclasses.replace(SPEC, stride=2)
    env = run_analysis(
        {"name": "gate_cycling", "deltas": [1], "layers": [2]}, model, s2, options(tmp_path / "l2", limit=2)
    )
    assert (env["analysis"]["results"]["stride"], env["analysis"]["results"]["layers"]) == (2, [2])


def test_the_joint_view_repeats_a_layers_phase_profile_to_the_model_stride(tmp_path: Path) -> None:
    model = scheduled(tmp_path)
    one_hot_gates(model, {(1, "K"): 2, (1, "V"): 3, (2, "K"): 1, (2, "V"): 0})
    env = run_analysis({"name": "joint", "calibration": 2}, model, SPEC, options(tmp_path, limit=2, plots=True))
    result = env["analysis"]["results"]
    assert result["window"] == 4 and result["stride"] == 4
    rows = {(r["layer"], r["kv_head"]): r for r in result["rows"]}
    assert rows[(0, 0)]["k_phase_profile"] is None and rows[(0, 0)]["loss_vs_k"] is None  # the sliding layer
    assert rows[(1, 0)]["k_phase_profile"] == pytest.approx([0, 0, 4, 0], abs=1e-4)
    assert rows[(2, 0)]["k_phase_profile"] == pytest.approx([0, 2, 0, 2], abs=1e-4)  # S = 2 repeated to 4
    assert png_ok(tmp_path / "joint" / "joint.png")  # the sliding layer's gate cells empty


def test_a_kv_sharing_models_gates_are_its_sources_and_every_layer_is_analysed(tmp_path: Path) -> None:
    """Cross-layer KV sharing: a consumer (``kv: shared``) owns no compressor, so the gate analyses read the
    source's gates only; knock-outs and the joint view cover every layer, the consumer among them."""
    layers = [
        SCHEDULE[0],
        {"count": 1, "kv": "source"},
        {"count": 1, "kv": "shared", "attention": SCHEDULE[0]["attention"]},
    ]
    model = scheduled(tmp_path, layers)
    assert [(b.layer, b.name) for b in gated_branches(model.module, "gates")] == [(1, "K"), (1, "V")]
    one_hot_gates(model, {(1, "K"): 2, (1, "V"): 3})
    env = run_analysis({"name": "gates", "checkpoints": "none"}, model, SPEC, options(tmp_path / "g", limit=2))
    result = env["analysis"]["results"]
    assert result["stride"] == 4 and {r["layer"] for r in result["gates"]} == {1}
    env = run_analysis({"name": "knockout", "calibration": 2}, model, SPEC, options(tmp_path / "k", limit=4))
    assert [u["label"] for u in env["analysis"]["results"]["units"]][:3] == ["L0", "L0 kv0", "L0 kv1"]
    assert len(env["analysis"]["results"]["units"]) == 9  # each of the 3 layers, and each of its 2 KV heads
    env = run_analysis({"name": "joint", "calibration": 2}, model, SPEC, options(tmp_path / "j", limit=2))
    rows = {(r["layer"], r["kv_head"]): r for r in env["analysis"]["results"]["rows"]}
    assert rows[(2, 0)]["k_phase_profile"] is None and rows[(1, 0)]["k_phase_profile"] is not None
