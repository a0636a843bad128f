"""Statistics of phase-grouped accuracy: group accuracy, intervals (Wilson, cluster bootstrap) and the permutation
test of the best-minus-worst gap; pure functions on numpy arrays, no model, no I/O. The rest of a grouping's report
lives beside it: ``ckv.eval.flatness`` (equivalence and power), ``ckv.eval.periodicity``, and
``ckv.eval.grouping.summarize_groups`` (everything one grouping reports).

Conventions: ``correct`` (n,) is 0/1 per scored target; ``groups`` (n,) its group in ``0..n_groups-1`` (a residue
``position mod M`` or a phase ``position mod S``); ``clusters`` (n,) says which samples share a key->value mapping
(in the paired design, every shifted copy of one base example). Accuracies are fractions in [0, 1]; a group
with no samples has accuracy NaN. Randomised statistics take an explicit ``seed`` and are deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% standard-normal quantile
WILSON = "wilson"  # interval kinds, named in every output that carries an interval
CLUSTER_BOOTSTRAP = "cluster_bootstrap"
BOOTSTRAP = "bootstrap"  # over single samples (no clusters given)
_CHUNK_ELEMENTS = 4_000_000  # bounds the memory of vectorised resampling (replicates x samples)


# ---- intervals and group accuracy ------------------------------------------------------------------------------
def wilson_interval(successes: np.ndarray | int, n: np.ndarray | int, z: float = Z95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of a binomial proportion (vectorised). ``n == 0`` gives ``[0, 1]``."""
    k = np.asarray(successes, dtype=np.float64)
    m = np.asarray(n, dtype=np.float64)
    safe = np.maximum(m, 1.0)
    p = k / safe
    denom = 1.0 + z * z / safe
    centre = (p + z * z / (2 * safe)) / denom
    half = z * np.sqrt(p * (1 - p) / safe + z * z / (4 * safe * safe)) / denom
    lo = np.where((m > 0) & (k > 0), np.clip(centre - half, 0.0, 1.0), 0.0)  # exact ends at 0/n and n/n
    hi = np.where((m > 0) & (k < m), np.clip(centre + half, 0.0, 1.0), 1.0)
    return lo, hi


@dataclass(frozen=True)
class GroupAccuracy:
    """Per-group accuracy with 95% intervals; arrays of shape (n_groups,). ``interval`` names their kind:
    ``wilson`` (prompts independent) or ``cluster_bootstrap`` (see ``with_cluster_intervals``)."""

    n: np.ndarray
    correct: np.ndarray
    accuracy: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    interval: str = WILSON

    @property
    def n_groups(self) -> int:
        return len(self.n)


def check_groups(correct: np.ndarray, groups: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """``correct`` (n,) as float64 and ``groups`` (n,) as int64, checked (same length, groups in ``0..n_groups-1``)."""
    c = np.asarray(correct, dtype=np.float64).reshape(-1)
    g = np.asarray(groups, dtype=np.int64).reshape(-1)
    if c.shape != g.shape:
        raise ValueError(f"correct {c.shape} and groups {g.shape} must have the same length")
    if n_groups < 1:
        raise ValueError(f"n_groups={n_groups} must be >= 1")
    if len(g) and (g.min() < 0 or g.max() >= n_groups):
        raise ValueError(f"groups must lie in [0, {n_groups}); got [{g.min()}, {g.max()}]")
    return c, g


def group_accuracy(correct: np.ndarray, groups: np.ndarray, n_groups: int, z: float = Z95) -> GroupAccuracy:
    """Accuracy of each group with its Wilson interval."""
    c, g = check_groups(correct, groups, n_groups)
    n = np.bincount(g, minlength=n_groups)
    k = np.bincount(g, weights=c, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(n > 0, k / np.maximum(n, 1), np.nan)
    lo, hi = wilson_interval(k, n, z)
    return GroupAccuracy(n=n, correct=k.round().astype(np.int64), accuracy=acc, lower=lo, upper=hi)


def with_cluster_intervals(acc: GroupAccuracy, replicates: np.ndarray, level: float = 0.95) -> GroupAccuracy:
    """``acc`` with each group's interval replaced by the percentile interval of its cluster-bootstrap
    ``replicates`` (R, n_groups) (``bootstrap_group_accuracy`` with the key->value mappings as clusters).

    Wilson intervals treat prompts as independent; a mapping scored at several shifts of one group gives
    correlated prompts, and the Wilson interval is then too narrow (by the square root of the design effect).
    """
    r = np.asarray(replicates, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != acc.n_groups:
        raise ValueError(f"replicates must be (R, {acc.n_groups}), got {r.shape}")
    ivs = [percentile_interval(r[:, i], float(acc.accuracy[i]), level) for i in range(acc.n_groups)]
    lo = np.array([iv.lower if acc.n[i] else 0.0 for i, iv in enumerate(ivs)])
    hi = np.array([iv.upper if acc.n[i] else 1.0 for i, iv in enumerate(ivs)])
    return dataclasses.replace(acc, lower=lo, upper=hi, interval=CLUSTER_BOOTSTRAP)


def best_minus_worst(accuracy: np.ndarray) -> np.ndarray:
    """Best-minus-worst gap over the last axis, ignoring empty (NaN) groups. (..., G) -> (...)."""
    a = np.asarray(accuracy, dtype=np.float64)
    with np.errstate(all="ignore"):
        return np.nanmax(a, axis=-1) - np.nanmin(a, axis=-1)


# ---- bootstrap over clusters -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval."""

    value: float
    lower: float
    upper: float


def cluster_index(clusters: Optional[np.ndarray], n: int) -> tuple[np.ndarray, int]:
    """``(idx, n_clusters)``: each of the ``n`` samples' cluster in ``0..n_clusters-1`` (none given: its own)."""
    if clusters is None:
        return np.arange(n), n
    cl = np.asarray(clusters).reshape(-1)
    if len(cl) != n:
        raise ValueError(f"clusters has {len(cl)} entries, expected {n}")
    _, idx = np.unique(cl, return_inverse=True)
    return idx.reshape(-1), int(idx.max()) + 1 if n else 0


def bootstrap_group_accuracy(
    correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    clusters: Optional[np.ndarray] = None,
    n_resamples: int = 2000,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster bootstrap: resample whole clusters (key->value mappings) with replacement.

    Returns ``(group_acc, mean_acc)``: (n_resamples, n_groups) per-group accuracies and (n_resamples,) overall
    accuracies of the replicates. ``clusters=None`` resamples single samples.
    """
    c, g = check_groups(correct, groups, n_groups)
    if n_resamples < 1:
        raise ValueError(f"n_resamples={n_resamples} must be >= 1")
    idx, n_clusters = cluster_index(clusters, len(c))
    if n_clusters == 0:
        raise ValueError("cannot bootstrap an empty sample")
    hits = np.zeros((n_clusters, n_groups))
    counts = np.zeros((n_clusters, n_groups))
    np.add.at(hits, (idx, g), c)
    np.add.at(counts, (idx, g), 1.0)
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_ELEMENTS // n_clusters)
    group_acc, mean_acc = [], []
    for start in range(0, n_resamples, chunk):
        b = min(chunk, n_resamples - start)
        weights = rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=b)  # (b, C)
        h, m = weights @ hits, weights @ counts  # (b, G)
        with np.errstate(invalid="ignore", divide="ignore"):
            group_acc.append(np.where(m > 0, h / m, np.nan))
        mean_acc.append(h.sum(1) / m.sum(1))
    return np.concatenate(group_acc), np.concatenate(mean_acc)


def percentile_interval(replicates: np.ndarray, value: float, level: float = 0.95) -> Interval:
    """Percentile interval of bootstrap ``replicates`` around the point estimate ``value``."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must lie in (0, 1)")
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if not len(r):
        return Interval(float(value), math.nan, math.nan)
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(value), float(lo), float(hi))


# ---- permutation test ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PermutationResult:
    """Permutation test of "accuracy does not depend on the group".

    ``p_value``: share of label permutations whose gap is at least the observed gap (with the +1 correction);
    ``noise_floor``: the ``quantile`` (95th percentile) of the gap under no group effect, i.e. the gap that
    sampling noise alone produces; ``observed_gap``: the data's best-minus-worst gap.
    """

    p_value: float
    noise_floor: float
    observed_gap: float
    n_permutations: int
    # (n_permutations, n_groups) group accuracies of the permuted replicates: the null distribution the
    # minimum detectable gap shifts (``minimum_detectable_gap``)
    null_accuracy: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False, compare=False)


def permutation_test(
    correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    clusters: Optional[np.ndarray] = None,
    n_permutations: int = 2000,
    quantile: float = 0.95,
    seed: int = 0,
) -> PermutationResult:
    """Shuffle group labels within each cluster (a paired test when each cluster holds one sample per group;
    ``clusters=None`` shuffles over all samples) and compare the best-minus-worst gap with the observed one."""
    c, g = check_groups(correct, groups, n_groups)
    if n_permutations < 1:
        raise ValueError(f"n_permutations={n_permutations} must be >= 1")
    idx, _ = cluster_index(clusters, len(c))
    order = np.argsort(idx, kind="stable")
    c, g, idx = c[order], g[order], idx[order].astype(np.float64)
    observed = float(best_minus_worst(group_accuracy(c, g, n_groups).accuracy))
    rng = np.random.default_rng(seed)
    n = len(c)
    chunk = max(1, _CHUNK_ELEMENTS // max(n, 1))
    null_acc = []
    for start in range(0, n_permutations, chunk):
        b = min(chunk, n_permutations - start)
        # cluster index + U[0, 1) sorts clusters as blocks and shuffles inside each block
        perm = np.argsort(idx[None, :] + rng.random((b, n)), axis=1)  # (b, n)
        shuffled = g[perm] + n_groups * np.arange(b)[:, None]  # (b, n) group ids offset per replicate
        hits = np.bincount(shuffled.ravel(), weights=np.broadcast_to(c, (b, n)).ravel(), minlength=b * n_groups)
        counts = np.bincount(shuffled.ravel(), minlength=b * n_groups)
        with np.errstate(invalid="ignore", divide="ignore"):
            null_acc.append(np.where(counts > 0, hits / np.maximum(counts, 1), np.nan).reshape(b, n_groups))
    acc = np.concatenate(null_acc)  # (n_permutations, n_groups)
    null = best_minus_worst(acc)
    p = (1 + int(np.sum(null >= observed - 1e-12))) / (1 + n_permutations)
    return PermutationResult(
        p_value=p,
        noise_floor=float(np.quantile(null, quantile)),
        observed_gap=observed,
        n_permutations=n_permutations,
        null_accuracy=acc,
    )


def gap_is_real(
    p_value: Optional[float], gap_lower: Optional[float], noise_floor: Optional[float], alpha: float = 0.05
) -> bool:
    """A phase gap counts as an effect when the permutation test rejects "no phase effect" (``p < alpha``) and the
    gap's interval lies above the noise floor. A statistic that was not computed (None) does not veto."""
    return (p_value is None or p_value < alpha) and (
        gap_lower is None or noise_floor is None or gap_lower > noise_floor
    )


# ---- the resampling settings of a report ------------------------------------------------------------------------
@dataclass(frozen=True)
class StatsOptions:
    """Resampling settings shared by every statistic of a report."""

    n_bootstrap: int = 2000
    n_permutations: int = 2000
    level: float = 0.95
    alpha: float = 0.05
    seed: int = 0
    equivalence_margin: float = 0.05  # "flat": the gap's one-sided 1 - alpha upper bound is under this margin
    mde_power: float = 0.80  # the minimum detectable gap is the gap detected with this power at alpha

    def __post_init__(self) -> None:
        for name in ("n_bootstrap", "n_permutations"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"stats.{name}={v!r} must be an integer >= 1")
        for name in ("level", "alpha", "equivalence_margin", "mde_power"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise ValueError(f"stats.{name}={v!r} must be a number in (0, 1)")
