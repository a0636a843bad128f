"""The straddling-phase statistics of ``analysis=selection``: how a selection covers the target record, and what
it costs, at the phases where the record straddles a stride boundary against the other phases.

``random_cover_probability`` (the exact geometric expectation of a uniformly random top-k), ``straddling_phases``,
``straddle_ratio``, the miss odds ratio beside its coverage-matched phase-blind null (``miss_odds_ratio``,
``blind_cover_probability``, ``miss_odds_ratio_from_counts``, ``miss_odds_power``), the positive control's cover
probability (``control_cover_probability``) and the paired accuracy differences with their straddling excess
(``paired_differences``). docs/selection.md derives them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any, Optional

import numpy as np

from ckv.analysis.paired import interval, paired_replicates
from ckv.eval.stats import StatsOptions, bootstrap_group_accuracy, group_accuracy


def random_cover_probability(holds: np.ndarray, k: int) -> float:
    """The probability that ``k`` entries drawn uniformly without replacement from ``n`` visible entries cover a
    record: ``holds`` (n, R) bool says which visible entry holds which of its ``R`` tokens. Exact, by
    inclusion-exclusion over the sets of tokens left out: ``sum_J (-1)^|J| C(n - |U_J|, k) / C(n, k)`` with
    ``U_J`` the entries holding a token of ``J``."""
    n, R = holds.shape
    k = min(k, n)
    if n == 0:
        return 0.0
    total = 0.0
    for J in itertools.chain.from_iterable(itertools.combinations(range(R), m) for m in range(R + 1)):
        held = int(holds[:, list(J)].any(1).sum()) if J else 0
        total += (-1) ** len(J) * math.comb(n - held, k)
    return total / math.comb(n, k)


def straddling_phases(whole: np.ndarray, phases: np.ndarray, stride: int) -> list[int]:
    """The phases at which the fewest visible entries hold the whole target record (mean over prompts, the last
    layer's grid): where the record straddles a stride boundary. Empty when every phase has as many."""
    mean = np.array([whole[-1][phases == r].mean() if (phases == r).any() else np.nan for r in range(stride)])
    low = np.nanmin(mean)
    return [] if np.allclose(mean[np.isfinite(mean)], low) else [int(r) for r in np.flatnonzero(mean == low)]


def _straddle_statistic(
    rate: np.ndarray,
    phases: np.ndarray,
    straddling: list[int],
    clusters: Optional[np.ndarray],
    opts: StatsOptions,
    statistic: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> dict:
    """``{"value", "lower", "upper"}`` of ``statistic(straddling mean, others' mean)`` of ``rate`` (P,) (0/1 or a
    probability), with a cluster-bootstrap interval (``bootstrap_group_accuracy`` with ``opts``' resamples, seed and
    level, the task's statistics' own; ``clusters`` None resamples single prompts); None values without straddling
    phases."""
    if not straddling:
        return {"value": None, "lower": None, "upper": None}
    group = np.isin(phases, straddling).astype(np.int64)  # 1: straddling
    means = np.array([rate[group == g].mean() if (group == g).any() else np.nan for g in (0, 1)])
    reps, _ = bootstrap_group_accuracy(rate, group, 2, clusters, opts.n_bootstrap, opts.seed)  # (n_boot, 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return interval(statistic(reps[:, 1], reps[:, 0]), float(statistic(means[1], means[0])), opts.level)


def _ratio(straddle: np.ndarray, others: np.ndarray) -> np.ndarray:
    return np.where(others > 0, straddle / np.where(others > 0, others, 1.0), np.nan)


def straddle_ratio(
    rate: np.ndarray, phases: np.ndarray, straddling: list[int], clusters: np.ndarray, opts: StatsOptions
) -> dict:
    """``{"value", "lower", "upper"}``: the mean of ``rate`` (P,) (0/1 or a probability) at the ``straddling``
    phases over its mean at the other phases, with a cluster-bootstrap interval (the same clusters and seed as
    the task's statistics); None values without straddling phases or without a rate at the others."""
    return _straddle_statistic(rate, phases, straddling, clusters, opts, _ratio)


def odds_ratio(straddle: np.ndarray | float, others: np.ndarray | float) -> np.ndarray:
    """The odds of ``straddle`` (a miss rate) over the odds of ``others``: ``(a / (1 - a)) / (b / (1 - b))``
    (elementwise; inf where ``b`` is 0 or ``a`` is 1, NaN where both odds are 0 or infinite)."""
    a, b = np.asarray(straddle, dtype=np.float64), np.asarray(others, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (a / (1 - a)) / (b / (1 - b))


def blind_cover_probability(geometric: np.ndarray, coverage: float) -> tuple[np.ndarray, float]:
    """``(q, f)``: the phase-blind selector matched to ``coverage``. It finds the target record with one
    probability ``f`` whatever the phase, and otherwise picks uniformly at random among the prompt's visible
    entries, covering the record with that prompt's ``geometric`` (P,) probability ``g_i``
    (``random_cover_probability``: it differs where the prompts see different numbers of entries). So prompt ``i``
    is covered with ``q_i = f + (1 - f) g_i``, and ``f = (c - mean g) / (1 - mean g)`` makes the mean of ``q`` the
    tested selector's overall ``coverage`` ``c`` (clipped to [0, 1]: a selector covering less than a random one is
    matched by the random one, ``f = 0``; one covering everything by ``f = 1``)."""
    g = np.asarray(geometric, dtype=np.float64)
    mean = float(g.mean())
    f = 1.0 if mean >= 1 else float(np.clip((coverage - mean) / (1 - mean), 0.0, 1.0))
    return f + (1 - f) * g, f


def miss_odds_ratio(
    covered: np.ndarray,
    geometric: np.ndarray,
    phases: np.ndarray,
    straddling: list[int],
    clusters: Optional[np.ndarray],
    opts: StatsOptions,
) -> dict:
    """The statistic that is fair at any coverage: the odds ratio of a MISS at the ``straddling`` phases against
    the other phases, ``{"value", "lower", "upper"}`` with a cluster-bootstrap interval (``_straddle_statistic`` of
    the miss indicator ``1 - covered`` (P,)), and its ``null``: the same odds ratio expected of the phase-blind
    selector matched to the tested selector's overall coverage (``blind_cover_probability`` of the prompts'
    ``geometric`` (P,) probabilities: its miss rate per side is the mean of ``1 - q_i``), with ``blind``, that
    selector's ``f``. A selector that misses the straddling record no more often than its coverage and the geometry
    imply has an interval containing ``null``; one whose lower bound exceeds it misses the straddling record
    relatively more. (A uniformly random top-k: ``f = 0``; at ``f`` near 1 the null tends to the ratio of the
    random selector's miss rates, about 1.06 for top-1 of 18.) None values without straddling phases."""
    miss = 1.0 - np.asarray(covered, dtype=np.float64)
    out = _straddle_statistic(miss, phases, straddling, clusters, opts, odds_ratio)
    if not straddling:
        return {**out, "null": None, "blind": None}
    q, f = blind_cover_probability(geometric, float(1.0 - miss.mean()))
    side = np.isin(phases, straddling)
    null = float(odds_ratio((1 - q[side]).mean(), (1 - q[~side]).mean()))
    return {**out, "null": null if math.isfinite(null) else None, "blind": f}


def miss_odds_ratio_from_counts(
    covered: tuple[int, int], n: tuple[int, int], geometric: tuple[float, float], opts: StatsOptions = StatsOptions()
) -> dict:
    """``miss_odds_ratio`` of a selector known only by its counts: ``covered`` and ``n`` prompts at the straddling
    phases and at the others, every prompt of a side with the side's ``geometric`` probability. Without the
    prompts' key->value mappings the bootstrap resamples single prompts (``clusters`` None), so its interval is
    narrower than the study's cluster bootstrap wherever the shifted copies of one mapping are correlated."""
    phases = np.repeat([1, 0], n)  # phase 1 stands for the straddling side
    cov = np.concatenate([np.arange(m) < c for c, m in zip(covered, n)]).astype(np.float64)
    geo = np.repeat(np.asarray(geometric, dtype=np.float64), n)
    return miss_odds_ratio(cov, geo, phases, [1], None, opts)


def miss_odds_power(miss: tuple[float, float], null: float, n: tuple[int, int], level: float = 0.95) -> float:
    """The probability that ``miss_odds_ratio``'s interval lies above ``null`` for a selector whose expected miss
    rates are ``miss`` (straddling, others) over ``n`` independent prompts per side: the normal approximation of
    the log odds ratio with Woolf's standard error, ``Phi((log OR - log null) / se - z)``, ``z`` the two-sided
    ``level`` quantile (the bootstrap percentile interval approximates the same interval)."""
    (a, b), (n_s, n_o) = miss, n
    se = math.sqrt(1 / (n_s * a) + 1 / (n_s * (1 - a)) + 1 / (n_o * b) + 1 / (n_o * (1 - b)))
    z = NormalDist().inv_cdf((1 + level) / 2)
    return NormalDist().cdf((math.log(float(odds_ratio(a, b))) - math.log(null)) / se - z)


def control_cover_probability(
    geometric: np.ndarray, phases: np.ndarray, straddling: list[int], coverage: float, drop: float
) -> np.ndarray:
    """(P,) the probability that the positive control covers each prompt's record: the phase-blind selector
    matched to ``coverage`` (``blind_cover_probability``), which at the ``straddling`` phases additionally drops the
    record with probability ``drop`` (``q_i (1 - drop)`` there, ``q_i`` elsewhere)."""
    q, _ = blind_cover_probability(geometric, coverage)
    return np.where(np.isin(phases, straddling), (1 - drop) * q, q)


def paired_differences(
    outcomes: dict[str, Any], reference: str, stride: int, straddling: list[int], opts: StatsOptions
) -> dict[str, dict]:
    """Per selector other than ``reference``: its accuracy minus the reference's on the same prompts, per phase
    and overall, and ``straddle_excess``, the difference at the ``straddling`` phases minus the difference at the
    others (how much more the selector costs the straddling phases; None values without straddling phases), each
    ``{"value", "lower", "upper"}`` with a paired cluster-bootstrap interval (one resample of the key->value
    mappings applied to every selector: ``ckv.analysis.paired``), ``opts`` the task's statistics options.
    ``outcomes``: per selector its ``correct`` (P,) and ``table`` (``phase``, ``base``: the mapping) on the same
    prompts."""
    names = [reference, *(n for n in outcomes if n != reference)]
    correct = [outcomes[n].correct for n in names]
    t = outcomes[reference].table
    reps = paired_replicates(correct, t["phase"], stride, t["base"], opts)  # (R, K, S)
    reps_all = paired_replicates(correct, np.zeros_like(t["phase"]), 1, t["base"], opts)[..., 0]  # (R, K)
    acc = [group_accuracy(c, t["phase"], stride).accuracy for c in correct]
    side = np.isin(t["phase"], straddling).astype(np.int64)  # 1: a straddling phase
    reps_side = paired_replicates(correct, side, 2, t["base"], opts)  # (R, K, 2)
    acc_side = [group_accuracy(c, side, 2).accuracy for c in correct]
    out = {}
    for j, name in enumerate(names[1:], start=1):
        excess = (reps_side[:, j, 1] - reps_side[:, 0, 1]) - (reps_side[:, j, 0] - reps_side[:, 0, 0])
        point = (acc_side[j][1] - acc_side[0][1]) - (acc_side[j][0] - acc_side[0][0])
        none = {"value": None, "lower": None, "upper": None}
        out[name] = {
            "straddle_excess": interval(excess, float(point), opts.level) if straddling else none,
            "reference": reference,
            "mean": interval(reps_all[:, j] - reps_all[:, 0], float(correct[j].mean() - correct[0].mean()), opts.level),
            "phases": [
                interval(reps[:, j, r] - reps[:, 0, r], float(acc[j][r] - acc[0][r]), opts.level) for r in range(stride)
            ],
        }
    return out
