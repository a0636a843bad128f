"""The design of make selection on synthetic selections (``ckv.analysis.selection_design``): the miss odds
ratio's simulations against the derived power, and C2's power simulation."""

from __future__ import annotations

import pytest

from ckv.analysis.selection_design import simulate_miss_odds, simulate_straddle_excess, synthetic_prompts
from ckv.eval.stats import StatsOptions


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
