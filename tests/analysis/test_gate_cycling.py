"""Gate cycling: exact identities (d = 0, d = W), the roll convention, restoration, R^2 and applicability."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ckv.analysis import run_analysis
from ckv.analysis.gate_cycling import (
    PAPER_DELTAS,
    CyclingSettings,
    boundary_phases,
    cycled_gates,
    cycling_parameters,
    predicted_accuracy,
    prediction_r2,
    shift_statistics,
)
from ckv.analysis.hooks import AnalysisNotApplicable
from ckv.config import ConfigError
from ckv.eval import LoadedModel, load_ckv_model

from ..eval.helpers import make_run
from .conftest import SPEC, context, options

W = 4
GATED = dict(kind="compressed", window=W, stride=W, local_window=4)


def _gate_params(model: LoadedModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in cycling_parameters(model.module)[0]]


def test_cycling_by_zero_reproduces_the_clean_outcome_and_by_w_is_the_identity(
    trained: LoadedModel, tmp_path: Path
) -> None:
    ctx = context(trained, tmp_path)
    clean = ctx.evaluate()
    before = _gate_params(trained)
    for delta in (0, W, -W):
        with cycled_gates(trained.module, delta):
            assert all(torch.equal(a, b) for a, b in zip(_gate_params(trained), before))
            shifted = ctx.evaluate()
        np.testing.assert_array_equal(shifted.predicted, clean.predicted)
        np.testing.assert_array_equal(shifted.p_answer, clean.p_answer)
    with cycled_gates(trained.module, 1):
        moved = ctx.evaluate()
    assert not np.array_equal(moved.p_answer, clean.p_answer)
    assert all(torch.equal(a, b) for a, b in zip(_gate_params(trained), before))


def test_roll_convention_and_restoration_after_an_error(trained: LoadedModel) -> None:
    """``Z'_i = Z_{(i - d) mod W}``: offset i takes the parameters offset i - d had; payload maps stay."""
    k = trained.module.layers[0].self_attn.compressors()["K"]
    gate = k.gate
    weight, bias, payload = gate.weight.detach().clone(), gate.bias.detach().clone(), k.payload.detach().clone()
    with pytest.raises(RuntimeError, match="boom"):
        with cycled_gates(trained.module, 1) as what:
            assert what == "gate maps and biases (offset-specific)"
            for i in range(W):
                assert torch.equal(gate.weight[i], weight[(i - 1) % W]) and torch.equal(gate.bias[i], bias[(i - 1) % W])
            assert torch.equal(k.payload, payload)
            raise RuntimeError("boom")
    assert torch.equal(gate.weight, weight) and torch.equal(gate.bias, bias)


def test_shared_maps_shift_only_the_offset_bias(tmp_path: Path) -> None:
    model = load_ckv_model(make_run(tmp_path, attention=dict(GATED, offset_maps="shared")), device="cpu")
    gate = model.module.layers[0].self_attn.compressors()["K"].gate
    with torch.no_grad():
        gate.bias.copy_(torch.arange(W, dtype=torch.float32)[:, None].expand_as(gate.bias))
    weight = gate.weight.detach().clone()
    with cycled_gates(model.module, 1) as what:
        assert "gate biases only" in what
        assert torch.equal(gate.weight, weight) and gate.bias[:, 0].tolist() == [3.0, 0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "attention, message",
    [
        (dict(GATED, gate=None), "uniform averaging"),
        (dict(kind="full"), "has no compressor"),
        (dict(GATED, window=8), "needs W == S"),
        (dict(GATED, offset_maps="shared", gate=dict(bias=False)), "no gate parameter is offset-specific"),
    ],
)
def test_gate_cycling_does_not_apply(tmp_path: Path, attention: dict, message: str) -> None:
    model = load_ckv_model(make_run(tmp_path, attention=attention), device="cpu")
    with pytest.raises(AnalysisNotApplicable, match=message):
        run_analysis({"name": "gate_cycling"}, model, SPEC, options(tmp_path / "out", limit=1))


def test_prediction_and_r2_known_answers() -> None:
    clean = np.array([1.0, 0.5, 0.5, 0.5])
    assert predicted_accuracy(clean, 1).tolist() == [0.5, 1.0, 0.5, 0.5]  # A_0((r - 1) mod 4)
    perfect = np.stack([predicted_accuracy(clean, d) for d in (1, 2)])
    assert prediction_r2(clean, perfect, [1, 2], boundary=3) == pytest.approx((1.0, 1.0))
    perfect[:, 3] = 0.0  # the boundary phase does not count
    assert prediction_r2(clean, perfect, [1, 2], boundary=3) == pytest.approx((1.0, 1.0))
    # d=1, observed [.5,.5,.5,.5]: x = [-.5, .5, 0], y = [-.5, 0, 0] over r = 0..2 -> R^2 = 1 - .25 / (1/6), corr^2 =
    # .75
    r2, corr2 = prediction_r2(clean, np.full((1, 4), 0.5), [1], boundary=3)
    assert (r2, corr2) == (pytest.approx(-0.5), pytest.approx(0.75))
    assert all(np.isnan(prediction_r2(clean, clean[None], [1], boundary=3)))  # no change observed: undefined
    assert all(np.isnan(prediction_r2(clean, clean[None], [0], boundary=3)))  # d = 0 mod S carries no prediction


def test_exact_cycling_gives_the_papers_statistics_their_extremes() -> None:
    """A gate whose cycling is exact (A_d(r) = A_0((r - d) mod S) at every phase): every R^2 is 1, both MAEs 0,
    and the mean accuracy does not change (a rotation of the curve)."""
    clean = np.array([0.9, 0.6, 0.7, 0.2, 0.5, 0.4])
    stats = shift_statistics(clean, predicted_accuracy(clean, 1), 1)
    assert stats["corr2_excl_boundary"] == pytest.approx(1.0) and stats["corr2_interior"] == pytest.approx(1.0)
    assert stats["corr2_all_phases"] == pytest.approx(1.0) and stats["r2_identity_excl_boundary"] == pytest.approx(1.0)
    assert stats["mae_all_phases_pp"] == pytest.approx(0.0) and stats["mae_interior_pp"] == pytest.approx(0.0)
    assert stats["accuracy_change_pp"] == pytest.approx(0.0)
    # the boundary keeps failing (observed 0 there): the excl-boundary and interior fits do not see it, all phases does
    broken = predicted_accuracy(clean, 1)
    broken[5] = 0.0
    stats = shift_statistics(clean, broken, 1)
    assert stats["corr2_excl_boundary"] == pytest.approx(1.0) and stats["corr2_all_phases"] < 1.0
    assert stats["mae_all_phases_pp"] == pytest.approx(100 * 0.5 / 6)  # |0 - A_0(4)| at r = 5, over 6 phases
    assert boundary_phases(4, 1) == [0, 3] and boundary_phases(12, -3) == [8, 11]  # the paper's pairs
    # S = 4 leaves 2 interior phases: their correlation would be 1 whatever the data, so it is undefined
    assert np.isnan(shift_statistics(clean[:4], clean[[1, 0, 3, 2]], 1)["corr2_interior"])


# The paper's W8/S8 1-KV seed-42 run (project-page data, figure 5): clean and shifted accuracy per phase (percent)
# and the statistics it reports per shift (R^2 excl. boundary, interior, all phases, MAE all / interior, accuracy
# change; 3 and 2 decimals)
PAPER_CLEAN = [66.7, 71.57, 78.73, 45.0, 47.27, 24.3, 64.7, 6.2]
PAPER_ROWS = {
    -3: ([20.13, 49.2, 22.6, 64.43, 5.2, 61.87, 44.2, 1.17], (0.878, 0.873, 0.614, 17.44, 10.16, -16.96)),
    -2: ([67.97, 44.0, 44.6, 22.47, 64.87, 5.17, 69.37, 1.1], (0.954, 0.953, 0.423, 11.33, 3.18, -10.62)),
    -1: ([65.37, 75.6, 39.53, 45.1, 23.17, 61.4, 5.6, 1.5], (0.996, 0.995, 0.679, 10.9, 3.57, -10.9)),
    1: ([5.87, 65.33, 68.83, 72.0, 43.37, 39.47, 22.1, 1.23], (0.997, 0.995, 0.702, 10.78, 3.74, -10.78)),
    2: ([44.6, 6.37, 66.27, 70.7, 77.27, 43.77, 34.5, 1.03], (0.948, 0.929, 0.911, 7.54, 6.14, -7.5)),
    3: ([18.13, 64.07, 5.93, 63.57, 67.83, 73.8, 44.87, 1.2], (0.997, 0.995, 0.874, 8.13, 3.12, -8.13)),
}
PAPER_NAMES = (
    "corr2_excl_boundary",
    "corr2_interior",
    "corr2_all_phases",
    "mae_all_phases_pp",
    "mae_interior_pp",
    "accuracy_change_pp",
)


def test_shift_statistics_reproduce_the_papers_published_numbers() -> None:
    clean = np.array(PAPER_CLEAN) / 100
    assert sorted(PAPER_ROWS) == list(PAPER_DELTAS)
    for d, (observed, reported) in PAPER_ROWS.items():
        stats = shift_statistics(clean, np.array(observed) / 100, d)
        for name, value in zip(PAPER_NAMES, reported):
            tolerance = 1e-3 if name.startswith("corr2") else 1e-2  # the last digit the paper reports
            assert float(stats[name]) == pytest.approx(value, abs=tolerance), (d, name)


def test_the_papers_shifts_by_name() -> None:
    assert CyclingSettings(deltas="paper").deltas == (-3, -2, -1, 1, 2, 3)
    with pytest.raises(ConfigError, match="'paper'"):
        CyclingSettings(deltas="all")
