"""The two gaps (residue mod M, phase mod S) and the interval kinds: the paper's V4 row, full attention judged
on the compressed models' yardstick, and the coverage of per-group intervals on clustered prompts."""

from __future__ import annotations

import numpy as np
import pytest

from ckv.config import ConfigError
from ckv.eval.codec import TokenCodec
from ckv.eval.grouping import summarize_groups
from ckv.eval.lookup import LookupSpec, LookupTask
from ckv.eval.stats import (
    CLUSTER_BOOTSTRAP,
    WILSON,
    StatsOptions,
    bootstrap_group_accuracy,
    group_accuracy,
    with_cluster_intervals,
)

from .helpers import ReadingOracle

FAST = StatsOptions(n_bootstrap=200, n_permutations=200)
CODEC = TokenCodec(key_ids=tuple(range(10, 40)), value_ids=tuple(range(50, 90)), pad_id=1, prefix=[3], separator=[2])
# the paper's DeepSeek-V4-Flash-Base row: per-residue accuracy (%) of t_K mod 8, gap 40.2 pp
V4_FLASH_BASE = [43.8, 69.5, 66.0, 29.7, 44.9, 69.9, 64.5, 32.8]


def test_residue_gap_of_the_papers_v4_flash_base_row() -> None:
    n = 1000  # prompts per residue: 43.8% of 1000 is a whole number of hits
    groups = np.repeat(np.arange(8), n)
    correct = np.concatenate([np.arange(n) < round(10 * a) for a in V4_FLASH_BASE]).astype(np.int64)
    rep = summarize_groups(correct, groups, 8, None, FAST)  # what LookupTask.report writes as "residue"
    assert rep["gap"]["value"] == pytest.approx(0.402)
    assert (rep["gap"]["best_group"], rep["gap"]["worst_group"]) == (5, 3)
    assert rep["mean"]["value"] == pytest.approx(np.mean(V4_FLASH_BASE) / 100)  # 52.6% in the paper's table


def _report(model_stride: int | None, task_stride: int | None, wrong=None) -> dict:
    task = LookupTask(
        LookupSpec(n_records=12, n_demos=3, n_base=16, modulus=8, stride=task_stride),
        CODEC,
        max_len=512,
        model_stride=model_stride,
    )
    return task.report(task.evaluate(ReadingOracle(100, wrong), progress=False), FAST)


def test_full_attention_gets_no_phase_gap_without_a_stride_and_the_comparisons_with_one() -> None:
    alone = _report(None, None)
    assert alone["stride"] is None and alone["phase"] is None
    h = alone["headline"]
    assert h["phase_gap"] is None and h["residue_gap"] == 0.0 and h["modulus"] == 8
    control = _report(None, 4)  # the control at the compressed models' stride: 4 phase groups, not 8 residues
    assert control["stride"] == 4 and len(control["phase"]["groups"]) == 4
    compressed = _report(4, None, wrong=lambda pos: pos % 4 == 3)
    assert len(compressed["phase"]["groups"]) == 4 and len(compressed["residue"]["groups"]) == 8
    for rep in (control, compressed):
        h = rep["headline"]
        for prefix in ("residue", "phase"):
            assert (
                h[f"{prefix}_gap_interval"] == CLUSTER_BOOTSTRAP and h[f"{prefix}_group_interval"] == CLUSTER_BOOTSTRAP
            )
            assert h[f"{prefix}_p_value"] is not None and h[f"{prefix}_noise_floor"] is not None
    assert compressed["headline"]["phase_gap"] == compressed["headline"]["residue_gap"] == 1.0
    assert compressed["headline"]["worst_phase"] == 3 and control["headline"]["phase_gap"] == 0.0


def test_a_phase_analysis_of_a_model_without_stride_asks_for_one() -> None:
    task = LookupTask(LookupSpec(n_records=12, n_demos=3, n_base=4, modulus=8), CODEC, max_len=512)
    with pytest.raises(ConfigError, match="set task.stride"):
        task.require_stride("analysis=knockout")


def test_per_group_intervals_name_their_kind() -> None:
    rng = np.random.default_rng(0)
    correct, groups = rng.integers(0, 2, 64), np.tile(np.arange(4), 16)
    assert summarize_groups(correct, groups, 4, None, FAST)["interval"] == WILSON
    clustered = summarize_groups(correct, groups, 4, np.repeat(np.arange(16), 4), FAST)
    assert clustered["interval"] == CLUSTER_BOOTSTRAP and clustered["gap"]["interval"] == CLUSTER_BOOTSTRAP


def test_cluster_bootstrap_covers_clustered_accuracy_at_its_nominal_rate_where_wilson_does_not() -> None:
    """Random-effects model: each of C mappings has its own success probability p_c ~ Beta(1.5, 1.5) (intra-cluster
    correlation 1 / (a + b + 1) = 0.25) and contributes m = 6 prompts to the group (M / S = 24 / 4 shifts per phase);
    the truth is E[p_c] = 0.5. Design effect 1 + (m - 1) * 0.25 = 2.25: Wilson is 1.5x too narrow and covers about
    P(|Z| < 1.96 / 1.5) = 81%."""
    a, b, n_clusters, m, n_datasets = 1.5, 1.5, 80, 6, 400
    truth = a / (a + b)
    rng = np.random.default_rng(12)
    p = rng.beta(a, b, (n_datasets, n_clusters))  # (D, C)
    correct = (rng.random((n_datasets, n_clusters, m)) < p[..., None]).astype(np.int64).reshape(n_datasets, -1)
    clusters = np.repeat(np.arange(n_clusters), m)
    groups = np.zeros(n_clusters * m, dtype=np.int64)
    covered = {WILSON: 0, CLUSTER_BOOTSTRAP: 0}
    for d in range(n_datasets):
        wilson = group_accuracy(correct[d], groups, 1)
        reps, _ = bootstrap_group_accuracy(correct[d], groups, 1, clusters, n_resamples=400, seed=d)
        boot = with_cluster_intervals(wilson, reps)
        for acc in (wilson, boot):
            covered[acc.interval] += int(acc.lower[0] <= truth <= acc.upper[0])
    mc_error = np.sqrt(0.95 * 0.05 / n_datasets)  # 1.1 points
    assert abs(covered[CLUSTER_BOOTSTRAP] / n_datasets - 0.95) < 3.5 * mc_error
    assert covered[WILSON] / n_datasets < 0.95 - 6 * mc_error


def test_a_model_without_stride_plots_residues_only_and_summaries_refuse_mixed_moduli(tmp_path) -> None:
    from ckv.eval.plots import plot_lookup
    from ckv.eval.summary import check_comparable, summary_row

    from .helpers import png_ok

    alone = _report(None, None)
    assert png_ok(plot_lookup(alone, tmp_path / "full.png", "full"))
    results = {"model": {"attention": {"kind": "full"}, "seed": 0}, "results": alone}
    row = summary_row("full", results)
    assert row["phase_gap"] is None and row["residue_gap"] == 0.0 and row["residue_gap_interval"] == CLUSTER_BOOTSTRAP
    check_comparable([row, {**row, "run": "other"}])
    with pytest.raises(ConfigError, match="different task.modulus"):
        check_comparable([row, {**row, "modulus": 24}])


def test_summaries_refuse_runs_evaluated_on_different_numbers_of_prompts() -> None:
    """A run evaluated with limit= (fewer prompts) is not averaged into a grid cell of full evaluations."""
    from ckv.eval.summary import check_comparable, summary_row

    row = summary_row(
        "w4s4,seed=0", {"model": {"attention": {"kind": "full"}, "seed": 0}, "results": _report(None, None)}
    )
    check_comparable([row, {**row, "run": "w4s4,seed=1"}])
    with pytest.raises(ConfigError, match="different numbers of prompts"):
        check_comparable([row, {**row, "run": "w4s4,seed=1", "n_prompts": 2 * row["n_prompts"]}])
