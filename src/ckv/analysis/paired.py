"""Paired statistics of several evaluations of the SAME lookup prompts (a clean model and modified versions).

Every analysis variant scores the same prompts, so their differences are paired: the cluster bootstrap of
``ckv.eval.stats`` resamples whole base examples (key->value mappings) once per replicate and applies the same
resample to every variant. Implemented by stacking the variants as extra groups of one bootstrap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import numpy as np

from ckv.eval.stats import StatsOptions, bootstrap_group_accuracy, percentile_interval


def paired_replicates(
    outcomes: Sequence[np.ndarray],
    groups: np.ndarray,
    n_groups: int,
    clusters: np.ndarray,
    options: StatsOptions,
) -> np.ndarray:
    """Bootstrap replicates of the per-group accuracy of K evaluations of the same prompts, all resampled with the
    same clusters in each replicate.

    ``outcomes``: K arrays (P,) of 0/1 correctness, in the same prompt order; ``groups``/``clusters`` (P,).
    Returns (n_bootstrap, K, n_groups).
    """
    k = len(outcomes)
    if not k:
        raise ValueError("no outcomes to compare")
    n = len(groups)
    if any(len(o) != n for o in outcomes):
        raise ValueError(f"every outcome must score the same {n} prompts")
    correct = np.concatenate([np.asarray(o, dtype=np.float64) for o in outcomes])
    stacked = np.concatenate([np.asarray(groups, dtype=np.int64) + i * n_groups for i in range(k)])
    acc, _ = bootstrap_group_accuracy(
        correct, stacked, k * n_groups, np.tile(clusters, k), options.n_bootstrap, options.seed
    )
    return acc.reshape(-1, k, n_groups)


def relative_change(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``100 * (other - base) / base`` elementwise; NaN where ``base`` is 0 (no accuracy to lose)."""
    b = np.asarray(base, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(b > 0, 100.0 * (np.asarray(other, dtype=np.float64) - b) / b, np.nan)


def _finite(x: float) -> Optional[float]:
    return float(x) if math.isfinite(x) else None


def interval(replicates: np.ndarray, value: float, level: float) -> dict:
    """``{"value", "lower", "upper"}`` of a statistic from its bootstrap replicates (percentile interval; NaN
    replicates are dropped; undefined values become ``None``)."""
    iv = percentile_interval(np.asarray(replicates).reshape(-1), float(value), level)
    return {"value": _finite(iv.value), "lower": _finite(iv.lower), "upper": _finite(iv.upper)}


def paired_group_differences(
    a: np.ndarray, b: np.ndarray, groups: np.ndarray, n_groups: int, clusters: np.ndarray, options: StatsOptions
) -> dict[str, dict]:
    """The differences ``a - b`` of two evaluations of the same prompt design (0/1 correctness (P,) each, in the
    same prompt order: the same groups and clusters) in mean accuracy, worst group and best-minus-worst gap, each
    ``{"value", "lower", "upper"}`` with its paired cluster-bootstrap interval (``paired_replicates``)."""
    reps = paired_replicates([a, b], groups, n_groups, clusters, options)  # (n_bootstrap, 2, n_groups)
    present = np.bincount(np.asarray(groups, dtype=np.int64), minlength=n_groups) > 0

    def stats(acc: np.ndarray) -> dict[str, np.ndarray]:
        acc = acc[..., present]
        return {"mean": acc.mean(-1), "worst": acc.min(-1), "gap": acc.max(-1) - acc.min(-1)}

    point = np.stack(
        [np.bincount(groups, weights=np.asarray(o, dtype=np.float64), minlength=n_groups) for o in (a, b)]
    ) / np.maximum(np.bincount(groups, minlength=n_groups), 1)  # (2, n_groups)
    at, boot = stats(point), stats(reps)
    return {k: interval(boot[k][:, 0] - boot[k][:, 1], float(at[k][0] - at[k][1]), options.level) for k in at}
