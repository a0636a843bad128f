"""Gate cycling, the causal test of gate specialisation (``eval.py analysis=gate_cycling``).

With W == S the offset of a token in its window equals its phase. Circularly shifting every offset-specific gate
parameter by ``d`` (``Z'_i = Z_{(i-d) mod W}``, ``b'_i = b_{(i-d) mod W}``: ``torch.roll(..., d, dims=0)`` of
each compressor's ``gate.weight`` (W, d, G) and ``gate.bias`` (W, G); payload maps untouched) moves what each gate
prefers by ``d`` offsets, so if the gates cause the phase profile the accuracy at phase ``r`` becomes
``A_d(r) ~= A_0((r - d) mod S)``. Each shifted model re-scores the same prompts; the predicted and observed
changes ``A_d(r) - A_0(r)`` are compared by ``R^2`` (boundary phase ``S - 1`` and shifts ``d = 0 mod S``
excluded), with a paired cluster-bootstrap interval.

Models with shared gate maps (DeepSeek style) have only an offset-specific bias: shifting the bias alone is the
analogue and is what happens there (the result says so). Mean pooling, full attention, W != S and shared maps
without a bias raise ``AnalysisNotApplicable``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from ckv.analysis.hooks import AnalysisNotApplicable, gated_branches, settings_from_params
from ckv.analysis.paired import interval, paired_replicates
from ckv.analysis.plots import plot_gate_cycling
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.config import ConfigError
from ckv.eval.stats import group_accuracy, with_cluster_intervals

log = logging.getLogger(__name__)


def cycling_parameters(
    module: nn.Module, model_name: str = "this model", layers: Optional[Sequence[int]] = None
) -> tuple[list[nn.Parameter], str]:
    """The offset-first gate parameters gate cycling rolls (in ``layers``, default all) and a description of
    what is shifted. Raises ``AnalysisNotApplicable`` when the model has nothing to cycle."""
    branches = gated_branches(module, "gate_cycling", model_name, layers)
    a = module.config.attention
    if a.window != a.stride:
        raise AnalysisNotApplicable(
            f"analysis=gate_cycling needs W == S (then a token's offset in its window is its phase); {model_name} "
            f"has attention.window={a.window}, attention.stride={a.stride}"
        )
    if a.offset_maps == "specific":
        gates = [b.compressor.gate for b in branches]
        params = [p for g in gates for p in (g.weight, g.bias) if p is not None]
        return params, "gate maps" + (" and biases" if a.gate.bias else "") + " (offset-specific)"
    if not a.gate.bias:
        raise AnalysisNotApplicable(
            f"analysis=gate_cycling: {model_name} shares its gate map across offsets (attention.offset_maps=shared) "
            "and has no gate bias (attention.gate.bias=false): no gate parameter is offset-specific"
        )
    return (
        [b.compressor.gate.bias for b in branches],
        "gate biases only (shared gate maps: the offset bias is the only offset-specific gate parameter)",
    )


@contextmanager
def cycled_gates(module: nn.Module, delta: int, layers: Optional[Sequence[int]] = None) -> Iterator[str]:
    """Inside the block the gate parameters are rolled by ``delta`` along the offset axis (``Z'_i = Z_{(i-d)
    mod W}``); they are restored on exit, also after an error. Yields what is shifted."""
    params, what = cycling_parameters(module, layers=layers)
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.copy_(torch.roll(p, shifts=delta, dims=0))
        yield what
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def predicted_accuracy(clean: np.ndarray, delta: int) -> np.ndarray:
    """``A_0((r - d) mod S)`` for every phase ``r`` (the last axis)."""
    return np.roll(np.asarray(clean, dtype=np.float64), delta, axis=-1)


def prediction_r2(
    clean: np.ndarray, observed: np.ndarray, deltas: Sequence[int], boundary: int
) -> tuple[np.ndarray, np.ndarray]:
    """How well ``A_0((r - d) mod S)`` predicts the observed accuracy change, pooled over ``deltas``.

    ``clean`` (..., S): ``A_0``; ``observed`` (..., K, S): ``A_d`` for each of the K ``deltas``. Points: phases
    ``r != boundary`` of shifts ``d != 0 mod S``; x = predicted change ``A_0((r-d) mod S) - A_0(r)``, y = observed
    change ``A_d(r) - A_0(r)``. Returns ``(r2, r2_corr)`` (...): ``r2 = 1 - SS_res / SS_tot`` (the prediction
    taken as is, so bias and scale count against it; can be negative) and the squared Pearson correlation.
    NaN when no point is left or the observed change does not vary.
    """
    a0, obs = np.asarray(clean, dtype=np.float64), np.asarray(observed, dtype=np.float64)
    S = a0.shape[-1]
    use_k = [k for k, d in enumerate(deltas) if d % S]
    use_r = [r for r in range(S) if r != boundary]
    if not use_k or not use_r:
        nan = np.full(a0.shape[:-1], np.nan)
        return nan, nan
    pred = np.stack([predicted_accuracy(a0, deltas[k]) for k in use_k], axis=-2) - a0[..., None, :]  # (..., K', S)
    y = (obs[..., use_k, :] - a0[..., None, :])[..., use_r].reshape(*a0.shape[:-1], -1)  # (..., N)
    x = pred[..., use_r].reshape(y.shape)
    yc, xc = y - y.mean(-1, keepdims=True), x - x.mean(-1, keepdims=True)
    ss_tot, sxx = (yc**2).sum(-1), (xc**2).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        r2 = 1 - ((y - x) ** 2).sum(-1) / ss_tot
        corr2 = (xc * yc).sum(-1) ** 2 / (sxx * ss_tot)
    varies = ss_tot > 1e-12
    return np.where(varies, r2, np.nan), np.where(varies & (sxx > 1e-12), corr2, np.nan)


@dataclass(frozen=True)
class CyclingSettings:
    """``deltas``: shifts to apply (default ``0..S-1``); ``layers``: compressed layers whose gates are shifted
    (default all)."""

    deltas: Optional[tuple[int, ...]] = None
    layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        for name in ("deltas", "layers"):
            v = getattr(self, name)
            ints = isinstance(v, tuple) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            if v is not None and not ints:
                raise ConfigError(f"analysis.{name}={v!r} must be null or a non-empty list of integers")


def _r2_dict(
    reps: np.ndarray, clean: np.ndarray, observed: np.ndarray, deltas: Sequence[int], boundary: int, level: float
) -> dict:
    """``r2`` and ``r2_corr`` with paired bootstrap intervals; ``reps`` (R, 1 + K, S) holds clean then shifts."""
    point = prediction_r2(clean, observed, deltas, boundary)
    boot = prediction_r2(reps[:, 0], reps[:, 1:], deltas, boundary)
    return {"r2": interval(boot[0], float(point[0]), level), "r2_corr": interval(boot[1], float(point[1]), level)}


def run_gate_cycling(ctx: AnalysisContext, settings: CyclingSettings) -> dict:
    """Shift the gates by every delta, re-score the prompts and compare with the prediction."""
    module = ctx.model.module
    _, shifted = cycling_parameters(module, ctx.model.name, settings.layers)
    S = ctx.task.stride
    if S != module.config.attention.stride:
        raise ConfigError(
            f"analysis=gate_cycling: task.stride={S} differs from the model's stride "
            f"{module.config.attention.stride}; phases must be positions mod the model's stride"
        )
    deltas = list(settings.deltas) if settings.deltas is not None else list(range(S))
    clean = ctx.evaluate()
    observed = []
    for d in deltas:
        log.info("gate cycling: shift %d", d)
        with cycled_gates(module, d, settings.layers):
            observed.append(ctx.evaluate().correct)
    t, opts, boundary = clean.table, ctx.options.stats, S - 1
    reps = paired_replicates([clean.correct, *observed], t["phase"], S, t["base"], opts)  # (R, 1 + K, S)
    a0, *acc = [
        with_cluster_intervals(group_accuracy(o, t["phase"], S), reps[:, i], opts.level)
        for i, o in enumerate([clean.correct, *observed])
    ]
    obs = np.stack([a.accuracy for a in acc])  # (K, S)
    per_delta = []
    for k, (d, a) in enumerate(zip(deltas, acc)):
        fit = _r2_dict(reps[:, [0, 1 + k]], a0.accuracy, obs[[k]], [d], boundary, opts.level) if d % S else None
        per_delta.append(
            {
                "delta": d,
                "mean": float(np.mean(observed[k])),
                "identical_to_clean": bool(np.array_equal(observed[k], clean.correct)),
                "observed": a.accuracy.tolist(),
                "lower": a.lower.tolist(),
                "upper": a.upper.tolist(),
                "interval": a.interval,
                "predicted": predicted_accuracy(a0.accuracy, d).tolist(),
                **(fit or {"r2": None, "r2_corr": None}),
            }
        )
    return {
        "stride": S,
        "boundary_phase": boundary,
        "shifted": shifted,
        "layers": list(settings.layers) if settings.layers is not None else "all",
        "clean": {
            "mean": float(np.mean(clean.correct)),
            "accuracy": a0.accuracy.tolist(),
            "lower": a0.lower.tolist(),
            "upper": a0.upper.tolist(),
            "interval": a0.interval,
        },
        "deltas": per_delta,
        "pooled": _r2_dict(reps, a0.accuracy, obs, deltas, boundary, opts.level),
    }


@register_analysis("gate_cycling")
def gate_cycling(ctx: AnalysisContext) -> dict:
    """``eval.py analysis=gate_cycling``: the result and a plot of predicted vs observed accuracy per shift."""
    result = run_gate_cycling(ctx, settings_from_params(CyclingSettings, ctx.params, "gate_cycling"))
    if ctx.options.plots:
        result["plots"] = [plot_gate_cycling(result, ctx.out_dir / "gate_cycling.png", ctx.model.name).name]
    return result
