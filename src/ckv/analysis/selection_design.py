"""The design of ``make selection`` checked on synthetic selections: prompts shaped like the study's, the
positive control's power derived, and simulations of the miss odds ratio and of C2's straddling excess through the
study's own statistics (``ckv.analysis.selection_stats``; docs/selection.md).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from ckv.analysis.selection_stats import (
    blind_cover_probability,
    control_cover_probability,
    miss_odds_power,
    miss_odds_ratio,
    odds_ratio,
    paired_differences,
    random_cover_probability,
)
from ckv.eval.stats import StatsOptions
from ckv.geometry import phase


def positive_control_power(
    geometric: np.ndarray, phases: np.ndarray, straddling: list[int], coverage: float, drop: float, level: float
) -> dict:
    """What ``miss_odds_ratio`` should find for the positive control (``control_cover_probability``) over these
    prompts, derived, not simulated: its expected miss rates per side, their ``odds_ratio``, the ``null`` of the
    phase-blind selector matched to its expected overall coverage (lower than ``coverage`` by the dropped records),
    and the ``power`` to detect it (``miss_odds_power``; ``drop`` 0: the rate of intervals lying above the null by
    chance, about ``(1 - level) / 2``)."""
    side = np.isin(phases, straddling)
    q = control_cover_probability(geometric, phases, straddling, coverage, drop)
    miss = (float((1 - q[side]).mean()), float((1 - q[~side]).mean()))
    blind, _ = blind_cover_probability(geometric, float(q.mean()))
    null = float(odds_ratio((1 - blind[side]).mean(), (1 - blind[~side]).mean()))
    n = (int(side.sum()), int((~side).sum()))
    return {"miss": miss, "odds_ratio": float(odds_ratio(*miss)), "null": null,
            "power": miss_odds_power(miss, null, n, level)}  # fmt: skip


def synthetic_prompts(
    n_base: int, visible: tuple[int, int] = (14, 22), k: int = 1, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic prompts shaped like ``make selection``'s, for ``simulate_miss_odds``: ``n_base`` key->value
    mappings at 8 shifts (phase = shift mod 4), a 2-token record under W = 8, S = 4 (phases 0-2: two entries hold it
    whole; phase 3 straddles: one entry holds it whole and one more holds each token), each mapping's prompts seeing
    a number of visible entries drawn uniformly from ``visible`` (inclusive; so the phase-blind selector's probability
    differs per prompt), top-``k``. Returns ``(geometric, phases, clusters)``, each (8 n_base,):
    ``random_cover_probability`` per prompt, its phase and its mapping."""
    n_visible = np.repeat(np.random.default_rng(seed).integers(visible[0], visible[1] + 1, n_base), 8)
    phases = np.tile(np.arange(8) % 4, n_base)

    def holds(n: int, straddle: bool) -> np.ndarray:  # (n, 2): the entries holding each token of the record
        h = np.zeros((n, 2), dtype=bool)
        if straddle:
            h[6, 0] = h[7] = h[8, 1] = True
        else:
            h[[6, 7]] = True
        return h

    geometric = np.array([random_cover_probability(holds(n, r == 3), k) for n, r in zip(n_visible, phases)])
    return geometric, phases, np.repeat(np.arange(n_base), 8)


def simulate_miss_odds(
    geometric: np.ndarray,
    phases: np.ndarray,
    straddling: list[int],
    clusters: np.ndarray,
    coverage: float,
    drop: float,
    n_sims: int,
    opts: StatsOptions,
) -> dict:
    """``n_sims`` synthetic selections of the prompts (``geometric``, ``phases``, ``clusters`` (P,)) by the
    positive control (``control_cover_probability``; ``drop`` 0: the phase-blind selector matched to
    ``coverage``), each covering prompt ``i`` independently, and ``miss_odds_ratio`` of each: the share of
    intervals that contain the null (``contains_null``), lie above it (``detected``) and below it, beside the
    derived expectation (``positive_control_power``). Seeded by ``opts.seed`` (the i-th bootstrap by ``seed + i``)."""
    rng = np.random.default_rng(opts.seed)
    q = control_cover_probability(geometric, phases, straddling, coverage, drop)
    found = [
        miss_odds_ratio(
            rng.random(len(q)) < q, geometric, phases, straddling, clusters, replace(opts, seed=opts.seed + i)
        )
        for i in range(n_sims)
    ]
    lower = np.array([np.nan if r["lower"] is None else r["lower"] for r in found])
    upper = np.array([np.nan if r["upper"] is None else r["upper"] for r in found])
    null = np.array([np.nan if r["null"] is None else r["null"] for r in found])
    return {
        "contains_null": float(np.mean((lower <= null) & (null <= upper))),
        "detected": float(np.mean(lower > null)),
        "below": float(np.mean(upper < null)),
        "expected": positive_control_power(geometric, phases, straddling, coverage, drop, opts.level),
    }


def simulate_straddle_excess(
    n_base: int,
    shifts: int,
    accuracy: float,
    icc: float,
    independent: float,
    excess: float,
    n_sims: int,
    opts: StatsOptions,
    margin: float = 0.05,
    stride: int = 4,
    straddling: tuple[int, ...] = (3,),
) -> dict:
    """C2's power, by simulation: ``n_sims`` synthetic paired evaluations shaped like ``make selection``'s
    (``n_base`` key->value mappings, each at ``shifts`` shifts, phase = shift mod ``stride``), served dense (the
    reference) and by a selector, and ``paired_differences``' straddling excess of each, its interval from the
    study's own paired cluster bootstrap. Returns the share of intervals under 0 (``cost``: C2 holds), within
    +-``margin`` (``equivalent``: C2 fails, no cost), their mean half-width (``half_width``) and the mean estimate.

    Each mapping answers with its own accuracy ``p_b``, Beta-distributed with mean ``accuracy`` and intra-mapping
    correlation ``icc`` (how alike a mapping's shifts are answered). Dense serving answers prompt ``i`` right when
    ``u_i < p_b``. The selector answers like it (``v_i = u_i``) except in a share ``independent`` of the (mapping,
    phase) cells, where it answers with an accuracy of its own, drawn from the same distribution, and fresh
    uniforms ``v_i``: a selector that keeps or misses a mapping's record at one shift of a phase does so at its
    other shifts of that phase (the conservative case: more shifts then add little). At the ``straddling`` phases
    its accuracy is lowered by ``-excess`` (``excess`` < 0: a selector that costs the straddling phase accuracy).
    Seeded by ``opts.seed`` (the i-th bootstrap by ``seed + i``)."""
    rng = np.random.default_rng(opts.seed)
    a, b = accuracy * (1 - icc) / icc, (1 - accuracy) * (1 - icc) / icc
    phases = np.tile(phase(np.arange(shifts), stride), n_base)  # (P,)
    mapping = np.repeat(np.arange(n_base), shifts)  # (P,)
    table = {"phase": phases, "base": mapping}
    shift = np.where(np.isin(phases, straddling), excess, 0.0)
    found = []
    for i in range(n_sims):
        p = rng.beta(a, b, n_base)[mapping]  # (P,) each prompt's mapping's accuracy
        apart = (rng.random((n_base, stride)) < independent)[mapping, phases]  # (P,) the selector's own cells
        q = np.where(apart, rng.beta(a, b, (n_base, stride))[mapping, phases], p)
        u = rng.random(len(p))
        v = np.where(apart, rng.random(len(p)), u)
        served = {
            "dense": SimpleNamespace(correct=(u < p).astype(np.int64), table=table),
            "selector": SimpleNamespace(correct=(v < q + shift).astype(np.int64), table=table),
        }
        diff = paired_differences(served, "dense", stride, list(straddling), replace(opts, seed=opts.seed + i))
        found.append(diff["selector"]["straddle_excess"])
    lower, upper, value = (np.array([f[k] for f in found], dtype=np.float64) for k in ("lower", "upper", "value"))
    return {
        "cost": float(np.mean(upper < 0)),
        "equivalent": float(np.mean((lower > -margin) & (upper < margin))),
        "half_width": float(np.mean((upper - lower) / 2)),
        "value": float(np.mean(value)),
    }
