"""analysis=selection (``ckv.analysis.selection``): the covered/missed table and the analysis on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckv.analysis import run_analysis
from ckv.analysis.selection import SelectionOutcome, selection, selector_rows
from ckv.analysis.selection_hooks import ImposedSelection
from ckv.config import ConfigError
from ckv.eval import load_ckv_model

from ..eval.helpers import make_run, png_ok
from .conftest import SPEC, W8S4, context, options


def test_the_covered_missed_table_adds_up():
    phases = np.tile(np.arange(4), 50)
    whole = np.where(phases == 3, 1, 2)[None].repeat(2, 0)  # (layers, P)
    rng = np.random.default_rng(1)
    covered = rng.random((2, 200)) < np.where(phases == 3, 0.3, 0.7)
    correct = np.where(covered[-1], rng.random(200) < 0.9, rng.random(200) < 0.2)
    table = {"phase": phases, "base": np.arange(200) // 4}

    class _Ctx:
        options = options(Path("."))

        @staticmethod
        def report(outcome):
            return {}

    outcome = type("O", (), {"correct": correct, "table": table})
    res = SelectionOutcome(covered, covered, whole, None, chosen=np.zeros((2, 200, 1), bool), outcome=outcome)
    rows = selector_rows(res, 4, [3], _Ctx)
    for p in rows["phases"]:
        for layer in p["layers"]:
            cov, yes, no = layer["covered"], layer["accuracy_covered"], layer["accuracy_missed"]
            assert cov["n"] == p["n"] == yes["n"] + no["n"] and cov["successes"] == yes["n"]
            assert yes["successes"] + no["successes"] == round(p["accuracy"] * p["n"])
            assert cov["lower"] <= cov["rate"] <= cov["upper"]
    ratio = rows["layers"][-1]["straddle_ratio"]
    want = covered[-1][phases == 3].mean() / covered[-1][phases != 3].mean()
    assert ratio["value"] == pytest.approx(want) and ratio["lower"] < want < ratio["upper"] < 1


@pytest.mark.parametrize(
    "select, always",
    [(None, True), (dict(topk=64, by="oracle"), True), (dict(topk=1, by="oracle"), False)],
)
def test_selection_rates_on_tiny_models(tmp_path: Path, select, always):
    """Without selection, or with a top-k above the entries, the record is always covered; top-1 misses it in
    some prompts. The rates sit beside the accuracy of the task's own scoring, per phase."""
    model = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=select)), device="cpu")
    ctx = context(model, tmp_path, limit=8)
    result = selection(ctx)["selectors"]["model"]
    plain = ctx.evaluate()
    assert result["mean_accuracy"] == pytest.approx(float(np.mean(plain.correct)))
    assert len(result["phases"]) == 4 and sum(p["n"] for p in result["phases"]) == len(plain.correct)
    for p in result["phases"]:
        assert all(x["covered"]["rate"] <= x["hit"] for x in p["layers"])
    covered = [layer["covered"]["rate"] for layer in result["layers"]]
    assert all(c == 1.0 for c in covered) if always else all(c < 1.0 for c in covered)


def test_run_analysis_writes_the_record_and_the_plot(tmp_path: Path):
    model = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=dict(topk=2, by="oracle"))))
    params = {"name": "selection", "selectors": ["model", "random"]}
    env = run_analysis(params, model, SPEC, options(tmp_path, limit=4, plots=True))
    out = Path(env["analysis"]["results"]["plots"][0])
    written = next(tmp_path.rglob("selection.json"))
    assert json.loads(written.read_text())["analysis"]["results"]["topk"] == 2
    assert png_ok(written.parent / out.name)


def test_selectors_imposed_on_a_dense_model(tmp_path: Path):
    """The oracle hook serves the same weights as a model built with oracle selection; ``dense`` equals the model
    as it is; every selector misses some records at top-1; the random selector's covered rate matches the
    geometric expectation's scale; the paired differences are taken against ``dense`` on the same prompts."""
    dense = load_ckv_model(make_run(tmp_path, attention=W8S4), device="cpu")
    oracle = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=dict(topk=1, by="oracle")), name="o"))
    oracle.module.load_state_dict(dense.module.state_dict())  # strict: the same parameters
    want = context(oracle, tmp_path).evaluate()
    plain = context(dense, tmp_path).evaluate()
    params = {"selectors": ["dense", "oracle", "random", "recency"], "topk": 1}
    result = selection(context(dense, tmp_path, params=params))
    by = result["selectors"]
    assert by["oracle"]["mean_accuracy"] == pytest.approx(float(np.mean(want.correct)))
    assert by["dense"]["mean_accuracy"] == pytest.approx(float(np.mean(plain.correct)))
    assert all(x["covered"]["rate"] == 1 for x in by["dense"]["layers"])
    for name in ("oracle", "random", "recency"):
        assert all(x["covered"]["rate"] < 1 for x in by[name]["layers"]), name
        assert by[name]["report"]["headline"]["mean"] == pytest.approx(by[name]["mean_accuracy"])
        diff = result["paired"][name]
        assert diff["reference"] == "dense" and len(diff["phases"]) == 4
        assert diff["mean"]["value"] == pytest.approx(by[name]["mean_accuracy"] - by["dense"]["mean_accuracy"])
        assert diff["mean"]["lower"] <= diff["mean"]["value"] <= diff["mean"]["upper"]
    geo = result["geometric"]["layers"][0]["covered"]
    assert 0 < geo < 1 and result["topk"] == 1 and result["model_selection"] is None
    assert dense.module.config.attention.selection is None  # the loaded model itself is untouched
    with pytest.raises(ConfigError, match="set analysis.topk"):
        selection(context(dense, tmp_path, params={"selectors": ["oracle"]}))
    with pytest.raises(ConfigError, match="no lightning indexer"):
        selection(context(dense, tmp_path, params={"selectors": ["indexer"], "topk": 1}))


def test_the_positive_control_drops_the_straddling_record_with_its_probability(tmp_path: Path):
    """``oracle_drop`` at ``drop`` 1 misses every straddling record in every layer and is the oracle at the other
    phases; at ``drop`` 0 it is the oracle everywhere; listed alone it fails with one line."""
    dense = load_ckv_model(make_run(tmp_path, attention=W8S4), device="cpu")

    def serve(drop: float) -> dict:
        params = {"selectors": ["oracle", "oracle_drop"], "topk": 1, "drop": drop}
        return selection(context(dense, tmp_path, params=params))

    result = serve(1.0)
    straddling = result["straddling_phases"]
    assert straddling and result["drop"] == 1.0
    oracle, control = (result["selectors"][n] for n in ("oracle", "oracle_drop"))
    for p_oracle, p_control in zip(oracle["phases"], control["phases"]):
        for a, b in zip(p_oracle["layers"], p_control["layers"]):
            if p_oracle["phase"] in straddling:  # no selected entry holds a token of the record
                assert b["covered"]["successes"] == 0 and b["hit"] == 0
            else:
                assert b["covered"] == a["covered"]
    odds = control["layers"][0]["miss_odds_ratio"]  # every straddling record missed: infinite odds
    assert odds["value"] is None and 1 < odds["null"] < 3
    unchanged = serve(0.0)["selectors"]
    assert unchanged["oracle_drop"]["phases"] == unchanged["oracle"]["phases"]
    with pytest.raises(ConfigError, match="oracle_drop.* alone"):
        selection(context(dense, tmp_path, params={"selectors": ["oracle_drop"], "topk": 1}))


def test_the_indexer_selector_serves_its_own_top_k(tmp_path: Path):
    """``indexer`` at the model's own k is the model as it is; at another k it keeps that many."""
    model = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=dict(topk=2, heads=2, head_dim=8))))
    as_is = selection(context(model, tmp_path, params={"selectors": ["model", "indexer"]}))["selectors"]
    assert as_is["indexer"]["mean_accuracy"] == as_is["model"]["mean_accuracy"]
    layers = [m for m in model.module.modules() if hasattr(m, "attend") and getattr(m, "indexer", None) is not None]
    seen = []
    hook = layers[0].attend.register_forward_hook(lambda m, a, kw, o: seen.append(kw["selected"]), with_kwargs=True)
    with ImposedSelection(layers, "indexer", 1):
        context(model, tmp_path).evaluate()
    hook.remove()
    assert seen and all(s.shape[-1] == 1 for s in seen)


def test_quantised_indexer_selectors_count_the_selections_they_change(tmp_path: Path):
    """``indexer_fp8``/``indexer_fp4`` serve the model's indexer fake-quantised (its ``quant`` restored after);
    ``quantisation`` counts the prompts whose final-query selection differs from the fp32 indexer's, per layer and
    phase, and fp4 (coarser) changes at least as many as fp8 here; without an fp32 reference listed: one line."""
    model = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=dict(topk=2, heads=2, head_dim=8))))
    params = {"selectors": ["indexer", "indexer_fp8", "indexer_fp4"]}
    result = selection(context(model, tmp_path, params=params))
    q = result["quantisation"]
    assert set(q) == {"indexer_fp8", "indexer_fp4"} and q["indexer_fp8"]["against"] == "indexer"
    n = len(context(model, tmp_path).task.prompts)
    for name, rows in q.items():
        layer = rows["layers"][0]
        assert layer["n"] == n and 0 <= layer["successes"] <= n and layer["lower"] <= layer["rate"] <= layer["upper"]
        assert sum(p["layers"][0]["successes"] for p in rows["phases"]) == layer["successes"], name
    assert q["indexer_fp4"]["layers"][0]["successes"] >= q["indexer_fp8"]["layers"][0]["successes"] > 0
    assert all(m.indexer.quant == "none" for m in model.module.modules() if getattr(m, "indexer", None) is not None)
    same = selection(context(model, tmp_path, params={"selectors": ["indexer", "model"]}))
    assert same["quantisation"] is None
    with pytest.raises(ConfigError, match="compared with the selection of an indexer in fp32"):
        selection(context(model, tmp_path, params={"selectors": ["indexer_fp8"]}))


def test_models_without_compressed_layers_and_parameters_fail_with_one_line(tmp_path: Path):
    full = load_ckv_model(make_run(tmp_path, attention=dict(kind="full"), name="full"), device="cpu")
    with pytest.raises(ConfigError, match="no compressed attention layer"):
        selection(context(full, tmp_path, params={}))
    model = load_ckv_model(make_run(tmp_path, attention=W8S4, name="w8s4"), device="cpu")
    with pytest.raises(ConfigError, match="unknown analysis=selection parameter"):
        selection(context(model, tmp_path, params={"layers": [0]}))
    with pytest.raises(ConfigError, match="analysis.topk=0 must be an integer >= 1"):
        selection(context(model, tmp_path, params={"topk": 0}))
    with pytest.raises(ConfigError, match="analysis.selectors='best' is not allowed"):
        selection(context(model, tmp_path, params={"selectors": ["best"]}))
    with pytest.raises(ConfigError, match="lists a selector twice"):
        selection(context(model, tmp_path, params={"selectors": ["dense", "dense"]}))
