"""Gate cycling, the causal test of gate specialisation (``eval.py analysis=gate_cycling``).

With W == S the offset of a token in its window equals its phase. Circularly shifting every offset-specific gate
parameter by ``d`` (``Z'_i = Z_{(i-d) mod W}``, ``b'_i = b_{(i-d) mod W}``: ``torch.roll(..., d, dims=0)`` of
each compressor's ``gate.weight`` (W, d, G) and ``gate.bias`` (W, G); payload maps untouched) moves what each gate
prefers by ``d`` offsets, so if the gates cause the phase profile the accuracy at phase ``r`` becomes
``A_d(r) ~= A_0((r - d) mod S)``. Each shifted model re-scores the same prompts; per shift, the predicted and
observed changes ``A_d(r) - A_0(r)`` are compared with the paper's statistics (``shift_statistics``: its headline
R^2 is the squared correlation over the phases other than the boundary ``S - 1``; also interior, all phases, MAEs,
the accuracy change), each with a paired cluster-bootstrap interval; ckv adds ``1 - SS_res / SS_tot`` and a fit
pooled over the shifts.

Models with shared gate maps (DeepSeek style) have only an offset-specific bias: shifting the bias alone is the
analogue and is what happens there (the result says so). Mean pooling, full attention, W != S and shared maps
without a bias raise ``AnalysisNotApplicable``. Under a layer schedule each gated layer is read with its own
attention (the sliding and full layers have no gates); every cycled layer needs W == S and the stride the phases
are taken mod (``task.stride``: by default the model's, the least common multiple of its layers' strides), so a
schedule whose gated layers differ in stride cycles one stride at a time (``analysis.layers``, ``task.stride``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from ckv.analysis.hooks import AnalysisNotApplicable, gated_branches, settings_from_params
from ckv.analysis.paired import interval, paired_replicates
from ckv.analysis.plots import plot_gate_cycling
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.config import ConfigError
from ckv.eval.stats import group_accuracy, with_cluster_intervals
from ckv.geometry import phase

log = logging.getLogger(__name__)


def cycling_parameters(
    module: nn.Module, model_name: str = "this model", layers: Optional[Sequence[int]] = None
) -> tuple[list[nn.Parameter], str, dict[int, int]]:
    """The offset-first gate parameters gate cycling rolls (in ``layers``, default every gated layer), a
    description of what is shifted and the stride of each layer they belong to; each layer is read with its own
    attention (``ModelConfig.layer_attention``: under a layer schedule its window, stride and gate maps). Raises
    ``AnalysisNotApplicable`` when the model has nothing to cycle."""
    branches = gated_branches(module, "gate_cycling", model_name, layers)
    config = module.config
    params, shifted, strides = [], [], {}
    for b in branches:
        a = config.layer_attention(b.layer)
        who = model_name if config.layers is None else f"{model_name}'s layer {b.layer}"
        if a.window != a.stride:
            raise AnalysisNotApplicable(
                f"analysis=gate_cycling needs W == S (then a token's offset in its window is its phase); {who} "
                f"has attention.window={a.window}, attention.stride={a.stride}"
            )
        strides[b.layer] = a.stride
        if a.offset_maps == "specific":
            params += [p for p in (b.compressor.gate.weight, b.compressor.gate.bias) if p is not None]
            what = "gate maps" + (" and biases" if a.gate.bias else "") + " (offset-specific)"
        elif a.gate.bias:
            params.append(b.compressor.gate.bias)
            what = "gate biases only (shared gate maps: the offset bias is the only offset-specific gate parameter)"
        else:
            raise AnalysisNotApplicable(
                f"analysis=gate_cycling: {who} shares its gate map across offsets (attention.offset_maps=shared) "
                "and has no gate bias (attention.gate.bias=false): no gate parameter is offset-specific"
            )
        if what not in shifted:
            shifted.append(what)
    return params, "; ".join(shifted), strides


@contextmanager
def cycled_gates(module: nn.Module, delta: int, layers: Optional[Sequence[int]] = None) -> Iterator[str]:
    """Inside the block the gate parameters are rolled by ``delta`` along the offset axis (``Z'_i = Z_{(i-d)
    mod W}``); they are restored on exit, also after an error. Yields what is shifted."""
    params, what, _ = cycling_parameters(module, layers=layers)
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


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predicted ``x`` against observed ``y`` (..., N): ``(1 - SS_res / SS_tot, squared Pearson correlation)``,
    NaN when ``y`` does not vary (and the correlation also when ``x`` does not, or with fewer than 3 points, whose
    correlation is 1 by construction: the interior phases of S = 4)."""
    yc, xc = y - y.mean(-1, keepdims=True), x - x.mean(-1, keepdims=True)
    ss_tot, sxx = (yc**2).sum(-1), (xc**2).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        r2 = 1 - ((y - x) ** 2).sum(-1) / ss_tot
        corr2 = (xc * yc).sum(-1) ** 2 / (sxx * ss_tot)
    varies = ss_tot > 1e-12
    return np.where(varies, r2, np.nan), np.where(varies & (sxx > 1e-12) & (x.shape[-1] >= 3), corr2, np.nan)


def _changes(clean: np.ndarray, observed: np.ndarray, delta: int) -> tuple[np.ndarray, np.ndarray]:
    """Predicted change ``A_0((r-d) mod S) - A_0(r)`` and observed change ``A_d(r) - A_0(r)`` (..., S)."""
    return predicted_accuracy(clean, delta) - clean, observed - clean


def prediction_r2(
    clean: np.ndarray, observed: np.ndarray, deltas: Sequence[int], boundary: int
) -> tuple[np.ndarray, np.ndarray]:
    """How well ``A_0((r - d) mod S)`` predicts the observed accuracy change, pooled over ``deltas`` (ckv's pooled
    fit; the paper pools no shifts, see ``shift_statistics``).

    ``clean`` (..., S): ``A_0``; ``observed`` (..., K, S): ``A_d`` for each of the K ``deltas``. Points: phases
    ``r != boundary`` of shifts ``d != 0 mod S``; x = predicted change, y = observed change. Returns
    ``(r2_identity, corr2)`` (...): ``1 - SS_res / SS_tot`` against ``y = x`` (the prediction taken as is, so bias
    and scale count against it; can be negative) and the squared Pearson correlation. NaN when no point is left or
    the observed change does not vary.
    """
    a0, obs = np.asarray(clean, dtype=np.float64), np.asarray(observed, dtype=np.float64)
    S = a0.shape[-1]
    use_k = [k for k, d in enumerate(deltas) if phase(d, S) != 0]
    use_r = [r for r in range(S) if r != boundary]
    if not use_k or not use_r:
        nan = np.full(a0.shape[:-1], np.nan)
        return nan, nan
    pairs = [_changes(a0, obs[..., k, :], deltas[k]) for k in use_k]
    x = np.concatenate([p[0][..., use_r] for p in pairs], axis=-1)  # (..., K' * (S - 1))
    y = np.concatenate([p[1][..., use_r] for p in pairs], axis=-1)
    return _fit(x, y)


def boundary_phases(stride: int, delta: int) -> list[int]:
    """The phases the paper's interior fit leaves out for shift ``d``: the boundary phase ``S - 1`` and
    ``(S - 1 + d) mod S``, the phase the shifted gates move the boundary's behaviour to."""
    return sorted({stride - 1, phase(stride - 1 + delta, stride)})


def shift_statistics(clean: np.ndarray, observed: np.ndarray, delta: int) -> dict[str, np.ndarray]:
    """The paper's statistics of one shift ``d`` (it pools none), over any leading axes.

    ``clean``, ``observed`` (..., S): ``A_0`` and ``A_d`` per phase (fractions). x = predicted change
    ``A_0((r-d) mod S) - A_0(r)``, y = observed change ``A_d(r) - A_0(r)``. Returns arrays (...):
    ``corr2_excl_boundary`` (the paper's headline R^2: squared Pearson correlation of x and y over phases
    ``r != S - 1``), ``corr2_interior`` (also without ``(S - 1 + d) mod S``), ``corr2_all_phases``,
    ``mae_all_phases_pp`` and ``mae_interior_pp`` (mean ``|A_d(r) - A_0((r-d) mod S)|``, percentage points),
    ``accuracy_change_pp`` (mean accuracy of the shifted model minus the clean one, pp) and ckv's
    ``r2_identity_excl_boundary`` (``1 - SS_res / SS_tot`` of y against ``y = x`` over ``r != S - 1``).
    """
    a0, obs = np.asarray(clean, dtype=np.float64), np.asarray(observed, dtype=np.float64)
    S = a0.shape[-1]
    x, y = _changes(a0, obs, delta)
    excl = [r for r in range(S) if r != S - 1]
    interior = [r for r in range(S) if r not in boundary_phases(S, delta)]
    r2_identity, corr2_excl = _fit(x[..., excl], y[..., excl])
    error = np.abs(y - x)  # |A_d(r) - A_0((r-d) mod S)|
    return {
        "corr2_excl_boundary": corr2_excl,
        "corr2_interior": _fit(x[..., interior], y[..., interior])[1],
        "corr2_all_phases": _fit(x, y)[1],
        "mae_all_phases_pp": 100 * error.mean(-1),
        "mae_interior_pp": 100 * error[..., interior].mean(-1),
        "accuracy_change_pp": 100 * (obs.mean(-1) - a0.mean(-1)),
        "r2_identity_excl_boundary": r2_identity,
    }


PAPER_DELTAS = (-3, -2, -1, 1, 2, 3)  # the paper's shifts (analysis.deltas=paper)


@dataclass(frozen=True)
class CyclingSettings:
    """``deltas``: shifts to apply (default ``0..S-1``; ``paper``: the paper's -3..-1, 1..3); ``layers``:
    compressed layers whose gates are shifted (default all)."""

    deltas: Union[None, str, tuple[int, ...]] = None
    layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.deltas == "paper":
            object.__setattr__(self, "deltas", PAPER_DELTAS)
        for name in ("deltas", "layers"):
            v = getattr(self, name)
            ints = isinstance(v, tuple) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            if v is not None and not ints:
                raise ConfigError(
                    f"analysis.{name}={v!r} must be null or a non-empty list of integers"
                    + (" (or 'paper': the paper's shifts -3..-1, 1..3)" if name == "deltas" else "")
                )


def _intervals(stats: dict[str, np.ndarray], boot: dict[str, np.ndarray], level: float) -> dict:
    """``{name: {"value", "lower", "upper"}}`` from point values and bootstrap replicates of each statistic."""
    return {k: interval(boot[k], float(v), level) for k, v in stats.items()}


def run_gate_cycling(ctx: AnalysisContext, settings: CyclingSettings) -> dict:
    """Shift the gates by every delta, re-score the prompts and compare with the prediction."""
    module = ctx.model.module
    _, shifted, strides = cycling_parameters(module, ctx.model.name, settings.layers)
    S = ctx.task.stride
    # the model's stride as its attention declares it (ModelFacts.stride), or that of every cycled layer of a schedule
    if S != ctx.model.stride and set(strides.values()) != {S}:
        raise ConfigError(
            f"analysis=gate_cycling: task.stride={S} differs from the model's stride "
            f"{ctx.model.stride}; phases must be positions mod the model's stride"
        )
    other = {layer: s for layer, s in strides.items() if s != S}  # a layer schedule's layers of another stride
    if other:
        raise ConfigError(
            f"analysis=gate_cycling: layers {sorted(other)} have stride {sorted(set(other.values()))}, not "
            f"task.stride={S}; the prediction needs offset = phase: cycle the layers of one stride "
            "(analysis.layers) with task.stride set to it"
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
        stats = shift_statistics(a0.accuracy, a.accuracy, d)
        boot = shift_statistics(reps[:, 0], reps[:, 1 + k], d)  # each (R,)
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
                "boundary_phases": boundary_phases(S, d),
                **_intervals(stats, boot, opts.level),
            }
        )
    pooled = prediction_r2(a0.accuracy, obs, deltas, boundary)
    pooled_boot = prediction_r2(reps[:, 0], reps[:, 1:], deltas, boundary)
    names = ("r2_identity_excl_boundary", "corr2_excl_boundary")
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
        "pooled": _intervals(dict(zip(names, pooled)), dict(zip(names, pooled_boot)), opts.level),
    }


@register_analysis("gate_cycling")
def gate_cycling(ctx: AnalysisContext) -> dict:
    """``eval.py analysis=gate_cycling``: the result and a plot of predicted vs observed accuracy per shift."""
    result = run_gate_cycling(ctx, settings_from_params(CyclingSettings, ctx.params, "gate_cycling"))
    if ctx.options.plots:
        result["plots"] = [plot_gate_cycling(result, ctx.out_dir / "gate_cycling.png", ctx.model.name).name]
    return result
