"""analysis=selection: which entries hold a record, which the query attended, and the analysis on tiny models."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ckv import Transformer
from ckv.analysis import run_analysis
from ckv.analysis.selection import (
    ImposedSelection,
    SelectionOutcome,
    blind_cover_probability,
    chosen_entries,
    imposed_selection,
    miss_odds_power,
    miss_odds_ratio,
    miss_odds_ratio_from_counts,
    odds_ratio,
    paired_differences,
    random_cover_probability,
    selection,
    selector_rows,
    simulate_miss_odds,
    simulate_straddle_excess,
    straddling_phases,
    synthetic_prompts,
    target_entries,
)
from ckv.config import ConfigError
from ckv.eval import load_ckv_model
from ckv.eval.stats import StatsOptions
from tests.helpers import small_config

from ..eval.helpers import make_run, png_ok
from .conftest import SPEC, context, options

W8S4 = dict(kind="compressed", window=8, stride=4, local_window=2, kv_heads=1)


def test_the_entries_holding_a_record_and_the_entries_a_query_attended():
    """W = 8, S = 4: entry j pools positions 4j - 4 .. 4j + 3. A record at 5, 6 lies in entries 1 and 2 (both
    tokens); one at 7, 8 straddles: 7 in entries 1, 2 and 8 in entries 2, 3."""
    layer = Transformer(small_config(W8S4, n_layers=1)).layers[0].self_attn
    holds = target_entries(layer, 5, torch.tensor([5, 7]), 2)  # (B=2, E=5, R=2)
    assert holds[0].T.tolist() == [[False, True, True, False, False]] * 2
    assert holds[1].T.tolist() == [[False, True, True, False, False], [False, False, True, True, False]]
    # the query at grid position 15 sees entries 0..3 (entry s closes at 4s + 3)
    assert chosen_entries(None, 5, 15, 4, 2).tolist() == [[True, True, True, True, False]] * 2
    chosen = chosen_entries(torch.tensor([[1, -1], [3, 4]]), 5, 15, 4, 2)  # entry 4 is not visible: not attended
    assert chosen.tolist() == [[False, True, False, False, False], [False, False, False, True, False]]
    hit = (holds.any(-1) & chosen).any(-1)
    covered = (holds & chosen[..., None]).any(1).all(-1)
    assert hit.tolist() == [True, True] and covered.tolist() == [True, False]  # 7 is in neither 3 nor 4


class _Attend(torch.nn.Module):
    """Stands in for a layer's ``attend``: an ``lse`` of 0 makes the oracle's scores the summed entry weights."""

    def forward(self, q, kc, *rest, **kwargs):
        B, T, H, _ = q.shape
        return q, torch.zeros(B, T, H)


def _selections(selector: str, k: int, E: int = 6, T: int = 24, stride: int = 4, seed: int = 0) -> torch.Tensor:
    q, kc = torch.randn(2, T, 2, 8), torch.randn(2, E, 1, 8)
    gen = torch.Generator().manual_seed(seed)
    args = (q, kc, torch.zeros_like(kc), q, q)  # a JointAttention call: queries, entries' keys and values, local k, v
    call = dict(q_start=0, stride=stride, local_window=None)
    return imposed_selection(selector, _Attend(), args, call, k, gen)  # (B, T, k)


@pytest.mark.parametrize("selector", ["oracle", "random", "recency"])
def test_every_selector_picks_visible_entries_without_repeats_and_marks_empty_slots(selector):
    """Query t (grid position) sees entries s with 4 s + 3 <= t: visible and distinct picks, -1 exactly in the
    slots beyond the visible count."""
    k, sel = 3, _selections(selector, 3)
    for t in range(sel.shape[1]):
        n_visible = min((t + 1) // 4, 6)
        for row in sel[:, t].tolist():
            picked = [s for s in row if s >= 0]
            assert len(picked) == len(set(picked)) == min(k, n_visible)
            assert all(s < n_visible for s in picked) and row.count(-1) == k - len(picked)


def test_recency_keeps_the_last_k_visible_entries_and_random_is_seeded_and_uniform():
    rec = _selections("recency", 2)
    assert rec[0, 23].tolist() == [5, 4] and rec[1, 15].tolist() == [3, 2] and rec[0, 7].tolist() == [1, 0]
    assert torch.equal(_selections("random", 2, seed=5), _selections("random", 2, seed=5))
    assert not torch.equal(_selections("random", 2, seed=5), _selections("random", 2, seed=6))
    counts = torch.zeros(6)
    for seed in range(200):  # the last query sees all 6 entries: each is picked 2/6 of the time
        counts += torch.bincount(_selections("random", 2, seed=seed)[:, -1].reshape(-1), minlength=6)
    share = counts / counts.sum()
    assert torch.all((share - 1 / 6).abs() < 0.04), share


def _brute_force(holds: np.ndarray, k: int) -> float:
    n = len(holds)
    subsets = list(itertools.combinations(range(n), min(k, n)))
    return sum(holds[list(c)].any(0).all() for c in subsets) / len(subsets)


def test_the_geometric_expectation_equals_an_enumeration_of_every_top_k():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, R, k = int(rng.integers(1, 8)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
        holds = rng.random((n, R)) < 0.35
        assert random_cover_probability(holds, k) == pytest.approx(_brute_force(holds, k))
    # W = 8, S = 4, 15 visible entries, top-2: two entries hold a record whole (phases 0-2), or one entry holds it
    # whole and one more holds each token (phase 3)
    inside = np.zeros((15, 2), dtype=bool)
    inside[[6, 7]] = True
    straddle = np.zeros((15, 2), dtype=bool)
    straddle[6, 0] = straddle[7] = straddle[8, 1] = True
    assert random_cover_probability(inside, 2) == pytest.approx(1 - 78 / 105)  # 1 - C(13, 2) / C(15, 2)
    assert random_cover_probability(straddle, 2) == pytest.approx(15 / 105)  # entry 7 with any, or entries 6 and 8


def test_the_phase_blind_selector_is_matched_to_the_coverage_per_prompt():
    """q_i = f + (1 - f) g_i with mean q = the coverage; below the random selector's coverage: the random one."""
    geometric, phases, _ = synthetic_prompts(128)
    for coverage in (0.2, 0.6, 0.95):
        q, f = blind_cover_probability(geometric, coverage)
        assert q.mean() == pytest.approx(coverage) and np.allclose(q, f + (1 - f) * geometric)
    q, f = blind_cover_probability(geometric, 0.01)
    assert f == 0 and np.array_equal(q, geometric)
    # its miss odds ratio is the null: a selector covering exactly q_i scores the null on expectation
    r = miss_odds_ratio(blind_cover_probability(geometric, 0.9)[0], geometric, phases, [3], None, StatsOptions(10))
    assert r["value"] == pytest.approx(r["null"]) and r["blind"] == pytest.approx(blind_cover_probability(
        geometric, 0.9)[1])  # fmt: skip


def test_the_miss_odds_ratio_of_counts_and_its_power():
    """From counts: the odds of a miss at the straddling side over the others' ((256 - 126) / 126 over
    (768 - 446) / 446), an interval around it, the null above 1; the power at the null itself is the one-sided
    level, (1 - 0.95) / 2."""
    r = miss_odds_ratio_from_counts((126, 446), (256, 768), (1 / 18, 2 / 18), StatsOptions(400))
    assert r["value"] == pytest.approx((130 / 126) / (322 / 446)) and r["lower"] < r["value"] < r["upper"]
    assert 1 < r["null"] < r["value"] and 0 < r["blind"] < 1
    assert miss_odds_power((0.3, 0.2), float(odds_ratio(0.3, 0.2)), (256, 768)) == pytest.approx(0.025)


@pytest.mark.parametrize("coverage", [0.90, 0.97, 0.99])
def test_a_phase_blind_selector_at_high_coverage_lands_on_the_null(coverage):
    """200 synthetic selections of 1,024 prompts shaped like the study's (``synthetic_prompts``: 14 to 22 visible
    entries per mapping, top-1) by the phase-blind selector: the 95% interval of the
    miss odds ratio contains the coverage-matched null at about the nominal rate (within 3 binomial standard
    errors of 0.95: 0.95 +- 0.046), where the covered-rate ratio against the random top-1's 0.50 would call every
    one of them even."""
    geometric, phases, clusters = synthetic_prompts(128)
    sim = simulate_miss_odds(geometric, phases, [3], clusters, coverage, 0.0, 200, StatsOptions(400, seed=0))
    tolerance = 3 * (0.95 * 0.05 / 200) ** 0.5
    assert abs(sim["contains_null"] - 0.95) <= tolerance, sim
    assert sim["expected"]["power"] < 0.05  # drop 0: the null holds; "detected" is the one-sided false positive


@pytest.mark.parametrize("coverage, drop", [(0.9, 0.1), (0.6, 0.2)])
def test_the_positive_control_is_detected_at_its_derived_power(coverage, drop):
    """The positive control (the phase-blind selector that also drops the straddling record with probability
    ``drop``) is detected (interval above the null) at the rate derived by ``positive_control_power`` (normal
    approximation of the log odds ratio), within 3 binomial standard errors of 200 simulations."""
    geometric, phases, clusters = synthetic_prompts(128)
    sim = simulate_miss_odds(geometric, phases, [3], clusters, coverage, drop, 200, StatsOptions(400, seed=1))
    power = sim["expected"]["power"]
    assert power > 0.8 and abs(sim["detected"] - power) <= 3 * (power * (1 - power) / 200) ** 0.5, sim
    assert sim["below"] == 0


def test_straddling_phases_and_the_covered_missed_table_add_up():
    phases = np.tile(np.arange(4), 50)
    whole = np.where(phases == 3, 1, 2)[None].repeat(2, 0)  # (layers, P)
    assert straddling_phases(whole, phases, 4) == [3] and straddling_phases(np.full((1, 200), 2), phases, 4) == []
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


def test_paired_differences_on_a_constructed_example():
    """The selector loses 20 of the reference's 50 correct answers at phase 3 and none elsewhere: the paired
    difference is -0.4 at phase 3, 0 at the others, and its excess at the straddling phase excludes 0."""
    phases = np.tile(np.arange(4), 50)  # 50 prompts per phase, 50 base examples of 4
    table = {"phase": phases, "base": np.repeat(np.arange(50), 4)}
    ref = np.ones(200)
    sel = ref.copy()
    sel[np.flatnonzero(phases == 3)[:20]] = 0
    outcomes = {name: type("O", (), {"correct": c, "table": table}) for name, c in (("dense", ref), ("sel", sel))}

    class _Ctx:
        options = options(Path("."))

    diff = paired_differences(outcomes, "dense", 4, [3], _Ctx.options.stats)["sel"]
    assert [p["value"] for p in diff["phases"]] == pytest.approx([0, 0, 0, -0.4])
    assert diff["mean"]["value"] == pytest.approx(-0.1)
    excess = diff["straddle_excess"]
    assert excess["value"] == pytest.approx(-0.4) and excess["lower"] < -0.4 < excess["upper"] < 0
    assert paired_differences(outcomes, "dense", 4, [], _Ctx.options.stats)["sel"]["straddle_excess"]["value"] is None


def test_c2_s_power_simulation_finds_a_cost_and_calls_no_cost_equivalent():
    """``simulate_straddle_excess``: a selector answering like dense serving everywhere has a zero-width interval,
    within +-5 pp in every run; one answering apart in half the (mapping, phase) cells but costing nothing is
    called costly at about the interval's lower tail rate (2.5%) with its estimate near 0; one costing the
    straddling phase 20 pp is found in nearly every run; more mappings narrow the interval."""
    opts = StatsOptions(200, seed=0)
    same = simulate_straddle_excess(32, 8, 0.7, 0.3, 0.0, 0.0, 10, opts)
    assert same["equivalent"] == 1 and same["half_width"] == 0 and same["cost"] == 0
    null = simulate_straddle_excess(32, 8, 0.7, 0.3, 0.5, 0.0, 40, opts)
    assert null["cost"] <= 0.1 and abs(null["value"]) < 0.03 and null["equivalent"] < 1
    costly = simulate_straddle_excess(64, 8, 0.7, 0.3, 0.5, -0.2, 20, opts)
    assert costly["cost"] >= 0.9 and costly["value"] == pytest.approx(-0.2, abs=0.04)
    more = simulate_straddle_excess(128, 8, 0.7, 0.3, 0.5, 0.0, 20, opts)
    assert more["half_width"] < 0.7 * null["half_width"]  # 4x the mappings: about half the width


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
