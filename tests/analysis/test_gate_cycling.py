"""Gate cycling: exact identities (d = 0, d = W), the roll convention, restoration, R^2 and applicability."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ckv.analysis import run_analysis
from ckv.analysis.gate_cycling import cycled_gates, cycling_parameters, predicted_accuracy, prediction_r2
from ckv.analysis.hooks import AnalysisNotApplicable
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
