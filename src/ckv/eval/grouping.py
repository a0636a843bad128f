"""Everything one grouping of a lookup evaluation reports (``summarize_groups``): per-group accuracy with intervals,
the mean, the best-minus-worst gap with its interval, permutation test, flatness and power, and its periodicity, as
plain JSON-ready values; and the report in words: its headline fields (``gap_headline``) and printed lines
(``gap_lines``)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ckv.eval.flatness import gap_upper_bound, gap_verdict, is_flat, is_learned, minimum_detectable_gap
from ckv.eval.periodicity import dominant_period, periodicity_chance, periodicity_score
from ckv.eval.stats import (
    BOOTSTRAP,
    CLUSTER_BOOTSTRAP,
    StatsOptions,
    best_minus_worst,
    bootstrap_group_accuracy,
    gap_is_real,
    group_accuracy,
    percentile_interval,
    permutation_test,
    with_cluster_intervals,
)


def _finite(x: float) -> Optional[float]:
    return float(x) if x is not None and math.isfinite(x) else None


def summarize_groups(
    correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    clusters: Optional[np.ndarray] = None,
    options: StatsOptions = StatsOptions(),
    period: Optional[int] = None,
) -> dict:
    """The full report of one grouping, as plain JSON-ready values (NaN becomes ``None``).

    Keys: ``groups`` (per group: n, correct, accuracy and its interval), ``interval`` (the per-group interval
    kind: ``cluster_bootstrap`` over ``clusters`` when given, else ``wilson``), ``mean`` (overall accuracy with a
    bootstrap interval), ``gap`` (best minus worst group with a bootstrap interval, its ``interval`` kind, the
    best and worst groups, the permutation p-value and noise floor; ``real`` (``gap_is_real``); the equivalence
    test: ``upper_one_sided`` (``gap_upper_bound`` at ``1 - alpha``), ``margin`` and ``flat``; ``verdict``
    (``gap_verdict``); and ``mde``, the gap detected with power ``mde_power`` (``minimum_detectable_gap``)) and,
    when ``period`` is given,
    ``periodicity`` (score at ``period`` with its chance level, and the dominant period of the group curve;
    only for ``2 <= period < n_groups``).
    """
    acc = group_accuracy(correct, groups, n_groups)
    boot_groups, boot_mean = bootstrap_group_accuracy(
        correct, groups, n_groups, clusters, options.n_bootstrap, options.seed
    )
    if clusters is not None:
        acc = with_cluster_intervals(acc, boot_groups, options.level)
    perm = permutation_test(
        correct, groups, n_groups, clusters, options.n_permutations, 1 - options.alpha, options.seed
    )
    c = np.asarray(correct, dtype=np.float64)
    gap = percentile_interval(best_minus_worst(boot_groups), perm.observed_gap, options.level)
    mean = percentile_interval(boot_mean, float(c.mean()) if len(c) else math.nan, options.level)
    filled = np.where(np.isnan(acc.accuracy), np.inf, acc.accuracy)
    worst = int(np.argmin(filled))
    best = int(np.argmax(np.where(np.isnan(acc.accuracy), -np.inf, acc.accuracy)))
    boot_kind = CLUSTER_BOOTSTRAP if clusters is not None else BOOTSTRAP
    real = gap_is_real(perm.p_value, _finite(gap.lower), perm.noise_floor, options.alpha)
    upper_one_sided = gap_upper_bound(boot_groups, options.alpha)
    learned = is_learned(_finite(mean.upper), options.equivalence_margin)
    flat = learned and is_flat(upper_one_sided, options.equivalence_margin)
    mde = minimum_detectable_gap(correct, groups, n_groups, clusters, perm, options.mde_power, options.seed)
    out: dict = {
        "groups": [
            {
                "group": i,
                "n": int(acc.n[i]),
                "correct": int(acc.correct[i]),
                "accuracy": _finite(acc.accuracy[i]),
                "lower": _finite(acc.lower[i]),
                "upper": _finite(acc.upper[i]),
            }
            for i in range(n_groups)
        ],
        "interval": acc.interval,
        "mean": {
            "value": _finite(mean.value),
            "lower": _finite(mean.lower),
            "upper": _finite(mean.upper),
            "n": len(c),
            "interval": boot_kind,
        },
        "gap": {
            "value": _finite(gap.value),
            "lower": _finite(gap.lower),
            "upper": _finite(gap.upper),
            "interval": boot_kind,
            "best_group": best,
            "worst_group": worst,
            "best_accuracy": _finite(acc.accuracy[best]),
            "worst_accuracy": _finite(acc.accuracy[worst]),
            "worst_lower": _finite(acc.lower[worst]),
            "worst_upper": _finite(acc.upper[worst]),
            "p_value": perm.p_value,
            "noise_floor": perm.noise_floor,
            "n_permutations": perm.n_permutations,
            "n_bootstrap": options.n_bootstrap,
            "level": options.level,
            "real": real,
            "upper_one_sided": upper_one_sided,
            "upper_one_sided_level": 1 - options.alpha,
            "margin": options.equivalence_margin,
            "flat": flat,
            "verdict": gap_verdict(real, flat, learned),
            "mde": mde,
            "mde_power": options.mde_power,
            "alpha": options.alpha,
        },
    }
    curve = acc.accuracy
    if period is not None and 2 <= period < n_groups and np.all(np.isfinite(curve)):
        dom = dominant_period(curve, options.alpha)
        out["periodicity"] = {
            "period": period,
            "score": periodicity_score(curve, period),
            "chance": periodicity_chance(n_groups, period),
            "dominant_period": dom.period,
            "dominant_p_value": dom.p_value,
            "dominant_score": dom.score,
        }
    return out


def gap_headline(report: Optional[dict], prefix: str) -> dict:
    """The headline fields of one grouping's gap (``summarize_groups``): ``<prefix>_gap`` with its interval,
    interval kind, permutation p and noise floor, and the worst group with its accuracy and interval; all
    ``None`` when the grouping was not made (a phase gap without a stride)."""
    g = (report or {}).get("gap", {})
    return {
        f"{prefix}_gap": g.get("value"),
        f"{prefix}_gap_lower": g.get("lower"),
        f"{prefix}_gap_upper": g.get("upper"),
        f"{prefix}_gap_interval": g.get("interval"),
        f"{prefix}_p_value": g.get("p_value"),
        f"{prefix}_noise_floor": g.get("noise_floor"),
        f"worst_{prefix}": g.get("worst_group"),
        f"worst_{prefix}_accuracy": g.get("worst_accuracy"),
        f"worst_{prefix}_lower": g.get("worst_lower"),
        f"worst_{prefix}_upper": g.get("worst_upper"),
        f"{prefix}_group_interval": (report or {}).get("interval"),
    }


# the gap report's fields the summary prints in its own words; any other field (e.g. a verdict) is printed as is
SUMMARY_GAP_KEYS = {
    "value",
    "lower",
    "upper",
    "interval",
    "best_group",
    "worst_group",
    "best_accuracy",
    "worst_accuracy",
    "worst_lower",
    "worst_upper",
    "p_value",
    "noise_floor",
    "n_permutations",
    "n_bootstrap",
    "level",
    "real",
    "upper_one_sided",
    "upper_one_sided_level",
    "margin",
    "flat",
    "verdict",
    "mde",
    "mde_power",
    "alpha",
}


def percent(x: Optional[float]) -> str:
    """A fraction in % with one decimal, ``n/a`` when not computed."""
    return "n/a" if x is None else f"{100 * x:.1f}"


def percent_interval(lower: Optional[float], upper: Optional[float]) -> str:
    """An interval in %: ``[lower, upper]``."""
    return f"[{percent(lower)}, {percent(upper)}]"


def gap_lines(grouping: dict, label: str, alpha: float = 0.05) -> list[str]:
    """Summary lines of one grouping's gap (``summarize_groups``): the gap with its interval, noise floor, p-value
    and what they say, the worst group, and every further field of the gap report."""
    g = grouping["gap"]
    real = gap_is_real(g["p_value"], g["lower"], g["noise_floor"], alpha)
    verdict = "above the noise floor" if real else "not above the noise floor: no evidence of a phase effect"
    p = "n/a" if g["p_value"] is None else f"{g['p_value']:.2g}"
    lines = [
        f"{label} gap {percent(g['value'])} pp {percent_interval(g['lower'], g['upper'])}, noise floor "
        f"{percent(g['noise_floor'])}, p={p}: {verdict}",
        f"worst {label} {g['worst_group']}: {percent(g['worst_accuracy'])}% "
        f"{percent_interval(g['worst_lower'], g['worst_upper'])}; best {g['best_group']}: "
        f"{percent(g['best_accuracy'])}%",
    ]
    if "verdict" in g:  # the equivalence test and the evaluation's power
        level = round(100 * g["upper_one_sided_level"])
        lines.append(
            f"{label} flatness: {g['verdict']} (one-sided {level}% upper bound {percent(g['upper_one_sided'])} pp vs "
            f"margin {percent(g['margin'])} pp); smallest gap detected with {round(100 * g['mde_power'])}% power: "
            f"{percent(g['mde'])} pp"
        )
    lines += [f"{label} gap {k}: {v}" for k, v in g.items() if k not in SUMMARY_GAP_KEYS]
    return lines
