"""The straddling-phase statistics of analysis=selection (``ckv.analysis.selection_stats``): the geometric
expectation, the straddling phases, the miss odds ratio and its null, and the paired differences."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from ckv.analysis.selection_design import synthetic_prompts
from ckv.analysis.selection_stats import (
    blind_cover_probability,
    miss_odds_power,
    miss_odds_ratio,
    miss_odds_ratio_from_counts,
    odds_ratio,
    paired_differences,
    random_cover_probability,
    straddling_phases,
)
from ckv.eval.stats import StatsOptions

from .conftest import options


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


def test_straddling_phases_are_where_the_fewest_entries_hold_the_whole_record():
    phases = np.tile(np.arange(4), 50)
    whole = np.where(phases == 3, 1, 2)[None].repeat(2, 0)  # (layers, P)
    assert straddling_phases(whole, phases, 4) == [3] and straddling_phases(np.full((1, 200), 2), phases, 4) == []


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
