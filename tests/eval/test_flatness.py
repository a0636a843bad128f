"""Flatness with stated power, on simulated paired data with known gaps: the one-sided upper bound of the gap
(coverage), the equivalence test (type-I error at a true gap equal to the margin, power at a true gap of 0) and
the minimum detectable gap (the permutation test's power there). Each simulation is seeded; Monte-Carlo
tolerances are stated beside each assertion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ckv.eval.flatness import VERDICTS, gap_upper_bound, gap_verdict, minimum_detectable_gap, row_verdict
from ckv.eval.grouping import summarize_groups
from ckv.eval.stats import StatsOptions, best_minus_worst, bootstrap_group_accuracy, permutation_test

from .helpers import bernoulli_paired

Z95_ONE_SIDED = 1.6448536269514722


def phase_data(curve: list[float], n_clusters: int, seed: int, shifts: int = 2) -> tuple[np.ndarray, ...]:
    """Paired data as the demo's evaluation makes it: each mapping (cluster) is scored at ``shifts * S`` shifts,
    ``shifts`` per phase; returns ``(correct, phase, clusters)``."""
    correct, residue, clusters = bernoulli_paired(np.tile(curve, shifts), n_clusters, seed)
    return correct, residue % len(curve), clusters


def upper_bounds(curve: list[float], n_clusters: int, n_datasets: int, n_resamples: int = 200) -> np.ndarray:
    """(n_datasets,) one-sided 95% upper bounds of the gap of datasets drawn from ``curve``."""
    out = []
    for d in range(n_datasets):
        correct, groups, clusters = phase_data(curve, n_clusters, seed=10_000 + d)
        boot, _ = bootstrap_group_accuracy(correct, groups, len(curve), clusters, n_resamples, seed=d)
        out.append(gap_upper_bound(boot, 0.05))
    return np.array(out)


def test_one_sided_upper_bound_covers_the_true_gap_at_its_level() -> None:
    n = 200
    se = math.sqrt(0.95 * 0.05 / n)  # Monte-Carlo error of a 95% rate: 1.5 points
    # two groups far apart (the reverse pair's bound is then negative): the bound is the pair's one-sided bound
    # alone, so its coverage is the nominal 95%, not far above. (A true gap under z * sd is always covered: the
    # reverse pair's bound alone is at least z * sd.)
    two = upper_bounds([0.85, 0.70], 64, n)
    assert abs(np.mean(two >= 0.15 - 1e-12) - 0.95) < 3.5 * se
    # four groups, one weak (straddling) or spread out: at least 95%
    for curve in ([0.85, 0.85, 0.85, 0.75], [0.6, 0.7, 0.8, 0.9]):
        ub = upper_bounds(curve, 64, n)
        assert np.mean(ub >= max(curve) - min(curve) - 1e-12) >= 0.95 - 3 * se, curve


def test_equivalence_test_rarely_calls_a_gap_at_the_margin_flat() -> None:
    margin, n = 0.05, 200
    se = math.sqrt(0.05 * 0.95 / n)
    # least favourable: two groups exactly the margin apart (the level is exactly alpha there)
    flat = upper_bounds([0.85, 0.85 - margin], 256, n) < margin
    assert flat.mean() <= 0.05 + 2.5 * se
    # the straddling pattern: one weak phase of four; the other pairs must be equivalent too, so it is rarer
    flat = upper_bounds([0.85, 0.85, 0.85, 0.85 - margin], 256, n) < margin
    assert flat.mean() <= 0.05 + 2.5 * se


def normal_power(p: float, n_per_group: int, n_groups: int, margin: float, draws: int = 20_000) -> float:
    """P(max pairwise |difference| + z * sd < margin) for independent binomial group means (an independent
    normal approximation of the equivalence test on a flat curve)."""
    rng = np.random.default_rng(5)
    means = rng.binomial(n_per_group, p, (draws, n_groups)) / n_per_group
    sd = math.sqrt(2 * p * (1 - p) / n_per_group)
    return float(np.mean(best_minus_worst(means) + Z95_ONE_SIDED * sd < margin))


def test_equivalence_power_on_a_flat_curve_matches_the_normal_approximation() -> None:
    p, n_clusters, margin, n = 0.85, 128, 0.11, 200
    expected = normal_power(p, 2 * n_clusters, 4, margin)
    assert 0.4 < expected < 0.95  # a size where the power is neither 0 nor 1, so the comparison has teeth
    flat = upper_bounds([p] * 4, n_clusters, n) < margin
    assert abs(flat.mean() - expected) < 0.08  # MC error of 200 datasets: <= 3.5 points; the rest is the approx


@pytest.mark.slow
def test_flat_at_5pp_is_decidable_at_the_demo_evaluation_size() -> None:
    """make demo / make robust evaluate 1,024 mappings x 8 shifts (2,048 prompts per phase mod 4): a truly flat
    model at 77% or 85% (the worst and typical accuracy of the flat straddling fixes) is called flat at 5 pp
    in >= 80% of datasets even with independent prompts (real models answer a mapping alike across shifts,
    which narrows the bound further)."""
    for p in (0.77, 0.85):
        flat = upper_bounds([p] * 4, 1024, 150, n_resamples=400) < 0.05
        assert flat.mean() >= 0.8, p


def test_minimum_detectable_gap_of_two_groups_is_the_textbook_value() -> None:
    """Two groups: the best-minus-worst gap is |difference|, the permutation test a two-sided test of it, so the
    gap detected with 80% power at alpha 0.05 is (z_0.975 + z_0.8) * sd = 2.80 sd."""
    n_clusters, p = 2000, 0.5
    correct, groups, clusters = bernoulli_paired(np.full(2, p), n_clusters, seed=3)
    perm = permutation_test(correct, groups, 2, clusters, n_permutations=2000, seed=0)
    mde = minimum_detectable_gap(correct, groups, 2, clusters, perm, 0.8)
    sd = math.sqrt(2 * p * (1 - p) / n_clusters)
    assert mde == pytest.approx((1.959964 + 0.841621) * sd, rel=0.05)


def power_at_reported_mde(p: float, n_clusters: int, n_datasets: int, n_permutations: int) -> tuple[float, float]:
    """The median MDE of three flat datasets at accuracy ``p`` (each reported by ``summarize_groups``), and the
    share of ``n_datasets`` fresh datasets with one phase that much lower in which the permutation test, run on
    each with its own permutations, rejects at alpha 0.05."""
    mdes = []
    for seed in range(3):
        correct, groups, clusters = phase_data([p] * 4, n_clusters, seed=seed)
        gap = summarize_groups(correct, groups, 4, clusters, StatsOptions(n_bootstrap=50))["gap"]
        assert gap["mde_power"] == 0.8 and 0 < gap["noise_floor"] < gap["mde"]
        mdes.append(gap["mde"])
    mde = float(np.median(mdes))
    hits = 0
    for d in range(n_datasets):
        c, g, cl = phase_data([p, p, p, p - mde], n_clusters, seed=100 + d)
        hits += permutation_test(c, g, 4, cl, n_permutations=n_permutations, seed=d).p_value < 0.05
    return mde, hits / n_datasets


def test_minimum_detectable_gap_is_detected_with_its_power() -> None:
    """80% power at the reported gap, within 9 points: 3 Monte-Carlo errors of 300 datasets (7 points) plus the
    simulation's own optimism, measured at about 2 points (it approximates a fresh dataset by a shuffled one
    with one group thinned)."""
    mde, power = power_at_reported_mde(0.85, 64, 300, 200)
    assert 0.05 < mde < 0.2
    assert abs(power - 0.8) < 0.09


@pytest.mark.slow
@pytest.mark.parametrize("p", [0.5, 0.95])
def test_minimum_detectable_gap_is_detected_with_its_power_at_other_accuracies(p: float) -> None:
    """The same at the demo's evaluation size (1,024 mappings, 2,048 prompts per phase) and other accuracies."""
    _, power = power_at_reported_mde(p, 1024, 300, 1000)
    assert abs(power - 0.8) < 0.09


def test_the_gap_report_says_gap_flat_undecided_or_not_learned() -> None:
    fast = StatsOptions(n_bootstrap=300, n_permutations=300)
    cases = {
        "gap": ([0.9, 0.9, 0.9, 0.6], 256),  # a 30 pp weak phase
        "flat": ([0.97] * 4, 1024),  # flat, and enough prompts to bound the gap under 5 pp
        "undecided": ([0.8] * 4, 32),  # flat, but too few prompts to say so
        "not learned": ([0.0] * 4, 1024),  # flat at 0%: no phase could show a gap of the margin
    }
    for verdict, (curve, n_clusters) in cases.items():
        correct, groups, clusters = phase_data(curve, n_clusters, seed=1)
        gap = summarize_groups(correct, groups, 4, clusters, fast)["gap"]
        assert gap["verdict"] == verdict, (verdict, gap)
        assert gap["margin"] == 0.05 and gap["upper_one_sided_level"] == pytest.approx(0.95)
        assert gap["upper_one_sided"] >= gap["value"] - 1e-12  # the bound is never under the observed gap
        assert gap["real"] == (verdict == "gap") and gap["flat"] == (verdict == "flat")
    assert set(cases) == set(VERDICTS)
    # every mapping answered alike at every shift (here: all right): no null spread, so no MDE, but flat
    perfect = summarize_groups(np.ones(256, dtype=np.int64), np.arange(256) % 4, 4, np.arange(256) // 8, fast)["gap"]
    assert perfect["mde"] is None and perfect["verdict"] == "flat" and perfect["upper_one_sided"] == 0.0
    wide = StatsOptions(n_bootstrap=300, n_permutations=300, equivalence_margin=0.3)
    correct, groups, clusters = phase_data([0.8] * 4, 32, seed=1)
    assert summarize_groups(correct, groups, 4, clusters, wide)["gap"]["verdict"] == "flat"


def test_significance_decides_before_flatness() -> None:
    """The one rule (``gap_verdict``): a significant gap is a gap even where the equivalence test bounds it under
    the margin; flat needs a gap the evaluation does not detect. On data: a real 3 pp weak phase over 1,024
    mappings is significant and its one-sided upper bound is under 5 pp, and the report calls it a gap."""
    expected = {  # (real, flat, learned) -> verdict
        (True, True, True): "gap",
        (True, False, True): "gap",
        (False, True, True): "flat",
        (False, False, True): "undecided",
    }
    for (real, flat, learned), verdict in expected.items():
        assert gap_verdict(real, flat, learned) == verdict
        assert gap_verdict(real, flat, learned=False) == "not learned"
    fast = StatsOptions(n_bootstrap=300, n_permutations=300)
    correct, groups, clusters = phase_data([0.98, 0.98, 0.98, 0.95], 1024, seed=1)
    gap = summarize_groups(correct, groups, 4, clusters, fast)["gap"]
    assert gap["real"] and gap["flat"] and gap["upper_one_sided"] < gap["margin"] and gap["verdict"] == "gap"


def report_row(gap: dict, mean_upper: float, prefix: str = "phase") -> dict:
    """A studies' row (``ckv.apps.study_results.result_row``) of one grouping's gap report: the headline's gap
    fields, the flatness fields and the mean's upper bound."""
    keys = {"p_value": "p_value", "gap_lower": "lower", "noise_floor": "noise_floor"}
    keys |= {"upper_one_sided": "upper_one_sided", "margin": "margin"}
    return {**{f"{prefix}_{k}": gap[v] for k, v in keys.items()}, "mean_upper": mean_upper}


def test_a_rows_verdict_is_the_reports_rule_recomputed() -> None:
    """``row_verdict`` gives what ``summarize_groups`` gave on the same numbers, for every verdict, and at a margin
    passed in (50 pp: every undetected gap is bounded under it, a model at 0% still has not learned); a row whose
    report predates the margin is never flat."""
    fast = StatsOptions(n_bootstrap=300, n_permutations=300)
    cases = (  # curve, mappings, verdict at the report's 5 pp, verdict at 50 pp
        ([0.9, 0.9, 0.9, 0.6], 256, "gap", "gap"),
        ([0.97] * 4, 1024, "flat", "flat"),
        ([0.8] * 4, 32, "undecided", "flat"),
        ([0.0] * 4, 1024, "not learned", "not learned"),
    )
    for curve, n_clusters, verdict, wide in cases:
        correct, groups, clusters = phase_data(curve, n_clusters, seed=1)
        report = summarize_groups(correct, groups, 4, clusters, fast)
        r = report_row(report["gap"], report["mean"]["upper"])
        assert row_verdict(r, "phase") == report["gap"]["verdict"] == verdict
        assert row_verdict(r, "phase", margin=0.5) == wide
        assert row_verdict({**r, "phase_margin": None}, "phase") == ("gap" if verdict == "gap" else "undecided")


def test_stats_options_check_the_margin_and_power() -> None:
    for bad in ({"equivalence_margin": 0.0}, {"mde_power": 1.0}, {"equivalence_margin": "5pp"}):
        with pytest.raises(ValueError, match=f"stats.{next(iter(bad))}"):
            StatsOptions(**bad)
