"""Statistics on constructed data whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ckv.eval.flatness import noninferiority_bounds, se_from_interval
from ckv.eval.grouping import summarize_groups
from ckv.eval.periodicity import (
    DominantPeriod,
    dominant_period,
    f_survival,
    period_pvalue,
    periodicity_chance,
    periodicity_score,
)
from ckv.eval.stats import (
    StatsOptions,
    best_minus_worst,
    bootstrap_group_accuracy,
    gap_is_real,
    group_accuracy,
    permutation_test,
    wilson_interval,
)

from .helpers import bernoulli_paired


def test_wilson_textbook_values() -> None:
    # Wilson 95% intervals: 5/10 -> [0.2366, 0.7634]; 0/10 -> [0, 0.2775]; 10/10 -> [0.7225, 1]
    lo, hi = wilson_interval(np.array([5, 0, 10]), np.array([10, 10, 10]))
    np.testing.assert_allclose(lo, [0.2366, 0.0, 0.7225], atol=1e-4)
    np.testing.assert_allclose(hi, [0.7634, 0.2775, 1.0], atol=1e-4)
    lo, hi = wilson_interval(0, 0)
    assert (float(lo), float(hi)) == (0.0, 1.0)


def test_group_accuracy_counts() -> None:
    correct = np.array([1, 0, 1, 1, 0, 0])
    groups = np.array([0, 0, 1, 1, 2, 2])
    acc = group_accuracy(correct, groups, 4)
    np.testing.assert_array_equal(acc.n, [2, 2, 2, 0])
    np.testing.assert_array_equal(acc.correct, [1, 2, 0, 0])
    np.testing.assert_allclose(acc.accuracy[:3], [0.5, 1.0, 0.0])
    assert math.isnan(acc.accuracy[3])
    assert best_minus_worst(acc.accuracy) == 1.0  # the empty group is ignored


def test_group_accuracy_rejects_bad_groups() -> None:
    with pytest.raises(ValueError, match="groups must lie"):
        group_accuracy(np.array([1, 0]), np.array([0, 5]), 4)


def test_flat_curve_gap_inside_noise_floor_and_no_dominant_period() -> None:
    correct, groups, clusters = bernoulli_paired(np.full(24, 0.6), n_clusters=300, seed=1)
    perm = permutation_test(correct, groups, 24, clusters, n_permutations=500, seed=0)
    assert perm.observed_gap <= perm.noise_floor
    assert perm.p_value > 0.05
    # the 95th percentile of the range of 24 group means, each with sd sqrt(p(1-p)/n), is about 5 sd
    sd = math.sqrt(0.6 * 0.4 / 300)
    assert 4 * sd < perm.noise_floor < 6 * sd
    curve = group_accuracy(correct, groups, 24).accuracy
    assert dominant_period(curve).period is None
    assert dominant_period(np.full(24, 0.5)) == DominantPeriod(None, None, None)


def test_period_four_curve_gives_period_four() -> None:
    phase_acc = np.array([0.9, 0.6, 0.95, 0.2])
    curve = np.tile(phase_acc, 6)  # 24 residues
    dom = dominant_period(curve)
    assert dom.period == 4 and dom.score == pytest.approx(1.0)
    assert periodicity_score(curve, 4) == pytest.approx(1.0)
    # sampled from that curve, the gap is far above the noise floor
    correct, groups, clusters = bernoulli_paired(curve, n_clusters=200, seed=2)
    perm = permutation_test(correct, groups, 24, clusters, n_permutations=300, seed=0)
    assert perm.p_value == pytest.approx(1 / 301)
    assert perm.observed_gap > 3 * perm.noise_floor


def test_periodicity_score_of_other_period_is_zero() -> None:
    x = np.sin(2 * np.pi * np.arange(24) / 6)  # period 6 has no power at frequency 1/4 or its harmonics
    assert periodicity_score(x, 4) == pytest.approx(0.0, abs=1e-12)
    assert periodicity_score(x, 6) == pytest.approx(1.0)
    assert periodicity_score(np.ones(24), 4) is None
    assert periodicity_chance(24, 4) == pytest.approx(3 / 23)


def test_f_survival_known_values() -> None:
    # d1 = 2 has a closed form: P(F > f) = (1 + 2 f / d2) ** (-d2 / 2)
    for f, d2 in ((0.5, 5), (3.0, 20), (10.0, 7)):
        assert f_survival(f, 2, d2) == pytest.approx((1 + 2 * f / d2) ** (-d2 / 2), rel=1e-9)
    # F(1, d2) = t(d2)^2; t(10) two-sided 5% point is 2.2281
    assert f_survival(2.2281389**2, 1, 10) == pytest.approx(0.05, abs=1e-6)
    assert f_survival(0.0, 3, 4) == 1.0


def test_period_pvalue_and_second_harmonic() -> None:
    curve = np.tile([0.9, 0.6, 0.95, 0.2], 6)  # period 4, but the period-2 component is the strongest
    assert period_pvalue(curve, 4) == 0.0 and period_pvalue(curve, 2) > 0.0
    assert dominant_period(curve).period == 4
    assert dominant_period(np.tile([0.5, 0.7, 0.1, 0.9, 0.3, 0.6], 4)).period == 6


def test_bootstrap_interval_of_known_gap() -> None:
    correct, groups, clusters = bernoulli_paired(np.array([0.9, 0.3]), n_clusters=2000, seed=3)
    boot, mean = bootstrap_group_accuracy(correct, groups, 2, clusters, n_resamples=400, seed=0)
    assert boot.shape == (400, 2) and mean.shape == (400,)
    lo, hi = np.quantile(best_minus_worst(boot), [0.025, 0.975])
    assert lo < 0.6 < hi and hi - lo < 0.1
    all_right = np.ones_like(correct)
    boot, _ = bootstrap_group_accuracy(all_right, groups, 2, clusters, n_resamples=50)
    assert np.all(best_minus_worst(boot) == 0)


def test_permutation_of_identical_outcomes() -> None:
    perm = permutation_test(np.ones(40), np.arange(40) % 4, 4, np.arange(40) // 4, n_permutations=100)
    assert perm.observed_gap == 0 and perm.noise_floor == 0 and perm.p_value == 1.0


def test_permutation_stays_within_clusters() -> None:
    # each cluster is all-correct or all-wrong: shuffling inside clusters can never create a gap
    clusters = np.repeat(np.arange(50), 4)
    correct = (clusters % 2).astype(np.int64)
    groups = np.tile(np.arange(4), 50)
    perm = permutation_test(correct, groups, 4, clusters, n_permutations=200)
    assert perm.noise_floor == 0


def test_summarize_groups_report() -> None:
    curve = np.tile([1.0, 1.0, 1.0, 0.0], 6)
    correct, groups, clusters = bernoulli_paired(curve, n_clusters=100, seed=0)
    rep = summarize_groups(correct, groups, 24, clusters, StatsOptions(n_bootstrap=200, n_permutations=200), period=4)
    assert rep["mean"]["value"] == pytest.approx(0.75)
    assert rep["gap"]["value"] == 1.0 and rep["gap"]["lower"] == 1.0
    assert rep["gap"]["worst_group"] == 3 and rep["gap"]["worst_accuracy"] == 0.0
    assert [g["n"] for g in rep["groups"]] == [100] * 24
    assert rep["periodicity"]["score"] == pytest.approx(1.0)
    assert rep["periodicity"]["dominant_period"] == 4


def test_stats_options_validate() -> None:
    with pytest.raises(ValueError, match="n_bootstrap"):
        StatsOptions(n_bootstrap=0)


def test_a_gap_is_real_only_when_significant_and_above_the_noise_floor():
    assert gap_is_real(0.0005, 0.20, 0.05)
    assert not gap_is_real(0.2, 0.20, 0.05)  # not significant
    assert not gap_is_real(0.0005, 0.04, 0.05)  # interval reaches down into the noise floor
    assert not gap_is_real(0.05, 0.20, 0.05)  # p must be below alpha, not equal
    assert gap_is_real(None, 0.20, 0.05) and gap_is_real(0.001, None, None)  # uncomputed statistics do not veto


def test_noninferiority_bound_is_each_estimate_minus_the_reference_less_the_one_sided_normal_margin() -> None:
    # 95% intervals of half-width 1.96 * 0.02: standard error 0.02 each, so the difference's is 0.02 * sqrt(2)
    half = 1.959963984540054 * 0.02
    assert se_from_interval(0.5 - half, 0.5 + half) == pytest.approx(0.02)
    got = noninferiority_bounds(
        [0.86, 0.84], [0.86 - half, 0.84 - half], [0.86 + half, 0.84 + half], 0.88, 0.88 - half, 0.88 + half
    )
    se = 0.02 * 2**0.5
    assert got == pytest.approx([0.86 - 0.88 - 1.6449 * se, 0.84 - 0.88 - 1.6449 * se], abs=1e-4)
    # a point estimate equal to the reference is still inferior at margin 0: the bound is below zero by its noise
    (tied,) = noninferiority_bounds([0.88], [0.88 - half], [0.88 + half], 0.88, 0.88 - half, 0.88 + half)
    assert tied < 0 and noninferiority_bounds([0.9], [0.9], [0.9], 0.8, 0.8, 0.8) == pytest.approx([0.1])
