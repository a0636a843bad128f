"""Gate concentration: how many window offsets each learned gate uses (``eval.py analysis=gates``).

For every compressed layer, KV head and branch (K and V) the gate weights ``alpha`` of every full window of the
lookup prompts are read by a forward hook on the compressor's ``pooling`` step and summarised by the effective
number of offsets ``exp(H(p))`` (``H`` = entropy in nats; 1 for a one-hot gate, W for a uniform one):

- static: ``exp(H(E[alpha]))``, of the window-averaged gate (does the gate prefer fixed offsets?);
- per window: ``E[exp(H(alpha))]`` (does each window's gate pick few offsets, whichever they are?);
- offset profile: ``W * E[alpha_i]``, the mass on offset ``i`` relative to uniform (1 = uniform);
- phase profile (the paper's ``g(r)``, S entries): the mass on the offsets whose tokens have phase ``r``,
  divided by that phase's uniform share (1 = uniform; folded when W > S), the value gate rolled by -1.

Under a layer schedule every gated layer is read with its own attention (``ModelConfig.layer_attention``): its
window and its stride (its phase profile has that stride's entries); the figures' columns span the largest window.
Vector gates (one weight per channel) are summarised per channel and averaged over channels. Windows with
absent positions (the first entries when W > S) are left out. Given a run folder, the statistics are repeated
for every saved checkpoint: how the gates specialise during training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from ckv.analysis.hooks import Branch, gated_branches, settings_from_params
from ckv.analysis.plots import plot_gate_profiles, plot_gate_training
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.config import ConfigError
from ckv.eval.lookup import LookupOutcome, LookupTask
from ckv.eval.models import LoadedModel, load_ckv_model
from ckv.eval.runner import RunOptions
from ckv.eval.stats import group_accuracy
from ckv.geometry import phase
from ckv.io.layout import list_checkpoints

log = logging.getLogger(__name__)


def effective_offsets(weights: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(H(weights))`` along ``dim`` (``0 log 0 = 0``): 1 for a one-hot distribution, n for a uniform one."""
    return torch.exp(-torch.xlogy(weights, weights).sum(dim))


class GateAccumulator:
    """Running sums of one branch's gate weights over full windows. ``add`` takes ``alpha`` (B, E, W, KV, C)
    (C = 1 scalar gate, head_dim vector gate) and ``present`` (E, W)."""

    def __init__(self) -> None:
        self.mass: Optional[torch.Tensor] = None  # (W, KV, C) summed alpha
        self.concentration: Optional[torch.Tensor] = None  # (KV, C) summed exp(H(alpha))
        self.windows = 0

    def add(self, alpha: torch.Tensor, present: torch.Tensor) -> None:
        a = alpha[:, present.all(-1)].double()  # (B, E_full, W, KV, C)
        mass, conc = a.sum((0, 1)), effective_offsets(a, dim=2).sum((0, 1))
        self.mass = mass if self.mass is None else self.mass + mass
        self.concentration = conc if self.concentration is None else self.concentration + conc
        self.windows += a.shape[0] * a.shape[1]

    def summary(self, stride: int, grid_offsets: Sequence[int] = (0,), roll: int = 0) -> list[dict]:
        """Per KV head: ``profile`` (W,) mass relative to uniform, ``phase_profile`` (S,) the same folded to the
        phases of the tokens (``phase_profile``; ``grid_offsets``: the layer's, one or one per KV head), rolled by
        ``roll`` (``phase_roll``), ``static`` and ``per_window`` effective numbers of offsets (channel means),
        ``peak_offset`` and ``windows``."""
        if not self.windows or self.mass is None or self.concentration is None:
            raise RuntimeError("no full window was recorded: the prompts are shorter than one window")
        mean = self.mass / self.windows  # (W, KV, C)
        window, kv = mean.shape[0], mean.shape[1]
        static = effective_offsets(mean, dim=0).mean(-1)  # (KV,)
        per_window = (self.concentration / self.windows).mean(-1)  # (KV,)
        profile = window * mean.mean(-1)  # (W, KV)
        offsets = list(grid_offsets) * kv if len(grid_offsets) == 1 else list(grid_offsets)
        return [
            {
                "kv_head": h,
                "profile": profile[:, h].tolist(),
                "phase_profile": np.roll(phase_profile(profile[:, h].numpy(), stride, offsets[h]), roll).tolist(),
                "phase_roll": roll,
                "static": float(static[h]),
                "per_window": float(per_window[h]),
                "peak_offset": int(profile[:, h].argmax()),
                "windows": self.windows,
            }
            for h in range(kv)
        ]


def offset_phases(window: int, stride: int, grid_offset: int = 0) -> np.ndarray:
    """(W,) the phase of the token at each window offset: entry ``j`` covers ``[(j+1)S - W + o, (j+1)S - 1 + o]``
    (``o``: the grid offset, ``ckv.geometry``), so offset ``i`` holds a position of phase ``(i - W + o) mod S``."""
    return phase(np.arange(window) - window + grid_offset, stride)


def phase_profile(profile: np.ndarray, stride: int, grid_offset: int = 0) -> np.ndarray:
    """(S,) the paper's ``g(r)`` from an offset profile (W,) (``W * E[alpha_i]``): the gate mass on the offsets of
    phase ``r`` divided by their uniform share ``n_r / W`` (1 = uniform; with W == S and no grid offset it is the
    offset profile itself)."""
    phases = offset_phases(len(profile), stride, grid_offset)
    n = np.bincount(phases, minlength=stride)  # offsets per phase (>= 1: W >= S)
    return np.bincount(phases, weights=np.asarray(profile, dtype=np.float64), minlength=stride) / n


@contextmanager
def record_gates(branches: list[Branch]) -> Iterator[dict[tuple[int, str], GateAccumulator]]:
    """Inside the block every forward pass adds each branch's gate weights to its accumulator (keyed by
    ``(layer, branch)``), read by a forward hook on the compressor's ``pooling`` submodule; the hooks are removed
    afterwards, also after an error."""
    accumulators = {(b.layer, b.name): GateAccumulator() for b in branches}

    def hook_for(acc: GateAccumulator) -> Callable[[nn.Module, tuple, tuple], None]:
        def hook(_: nn.Module, args: tuple, output: tuple) -> None:
            present, alpha = args[2], output[1]  # Pooling.forward(payload, logits, present) -> (pooled, alpha)
            acc.add(alpha.detach(), present)

        return hook

    handles = [b.compressor.pooling.register_forward_hook(hook_for(accumulators[(b.layer, b.name)])) for b in branches]
    try:
        yield accumulators
    finally:
        for h in handles:
            h.remove()


# The paper reports the value gate rolled by -1 (its project page's data, figure 4: "value profile already
# rolled by -1: vg[r] is the value gate at phase r+1, aligned with the key at phase r"; science.md: each value gate
# peaks about one offset after its key gate): a record's value token follows its key token, so vg[r] and kg[r]
# both describe the record whose key, the target position, has phase r.
PHASE_ROLL = {"K": 0, "V": -1}


def gate_statistics(model: LoadedModel, task: LookupTask, options: RunOptions) -> tuple[list[dict], LookupOutcome]:
    """Gate statistics of every branch over the task's prompts, and the task's outcome (scored on the way).
    Rows: ``layer``, ``branch``, ``kv_head`` plus ``GateAccumulator.summary``'s fields."""
    branches = gated_branches(model.module, "gates", model.name)
    with record_gates(branches) as accs:
        outcome = task.evaluate(
            model.logits, batch_size=options.batch_size, device=model.device, progress=options.progress
        )
    config = model.module.config
    rows = [
        {"layer": layer, "branch": name, **s}
        for (layer, name), acc in accs.items()
        for s in acc.summary(config.layer_attention(layer).stride, config.grid_offsets(layer), PHASE_ROLL[name])
    ]
    return rows, outcome


def peak_shifts(rows: list[dict], window: Union[int, Mapping[int, int]]) -> list[dict]:
    """Per layer and KV head with both branches: ``(V peak - K peak) mod W`` (the paper: about +1); ``window``: W,
    or each layer's (a layer schedule's layers may differ)."""
    peaks = {(r["layer"], r["kv_head"], r["branch"]): r["peak_offset"] for r in rows}
    return [
        {
            "layer": layer,
            "kv_head": h,
            "k_peak": k,
            "v_peak": peaks[(layer, h, "V")],
            "shift": (peaks[(layer, h, "V")] - k) % (window if isinstance(window, int) else window[layer]),
        }
        for (layer, h, b), k in peaks.items()
        if b == "K" and (layer, h, "V") in peaks
    ]


@dataclass(frozen=True)
class GateSettings:
    """``checkpoints``: ``all`` (every saved checkpoint of the model's run folder, when there is one), ``none``,
    or a list of checkpoint steps."""

    checkpoints: Union[str, tuple[int, ...]] = "all"

    def __post_init__(self) -> None:
        c = self.checkpoints
        steps = isinstance(c, tuple) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in c)
        if c not in ("all", "none") and not steps:
            raise ConfigError(f"analysis.checkpoints={c!r} must be 'all', 'none' or a list of integer steps")


def _accuracy(outcome: LookupOutcome, stride: int) -> dict:
    acc = group_accuracy(outcome.correct, outcome.table["phase"], stride).accuracy
    return {"mean": float(np.mean(outcome.correct)), "phase": acc.tolist()}


def checkpoint_series(ctx: AnalysisContext, settings: GateSettings) -> list[dict]:
    """Gate statistics of the chosen checkpoints of the model's run (empty without a run folder). Each item:
    ``step``, ``accuracy`` (mean and per phase on the same prompts) and ``gates`` (rows)."""
    run_dir = ctx.model.info.get("run_dir")
    if settings.checkpoints == "none" or not run_dir:
        return []
    found = dict(list_checkpoints(run_dir))
    steps = sorted(found) if settings.checkpoints == "all" else list(settings.checkpoints)
    missing = [s for s in steps if s not in found]
    if missing:
        raise ConfigError(
            f"analysis.checkpoints: steps {missing} are not checkpoints of {run_dir}; it has {sorted(found)}"
        )
    first = gated_branches(ctx.model.module, "gates", ctx.model.name)[0].layer
    impl = ctx.model.module.config.layer_attention(first).impl  # the gated layers' impl, as the model ran
    series = []
    for step in steps:
        log.info("gates of checkpoint step %d", step)
        model = load_ckv_model(run_dir, step=step, device=str(ctx.model.device), impl=impl)
        rows, outcome = gate_statistics(model, ctx.task, ctx.options)
        series.append({"step": step, "accuracy": _accuracy(outcome, ctx.task.stride), "gates": rows})
    return series


@register_analysis("gates")
def gates(ctx: AnalysisContext) -> dict:
    """``eval.py analysis=gates``: gate statistics of the model (and of its run's checkpoints), plots of the
    offset profiles and of the concentration over training."""
    settings = settings_from_params(GateSettings, ctx.params, "gates")
    rows, outcome = gate_statistics(ctx.model, ctx.task, ctx.options)
    config = ctx.model.module.config
    windows = {r["layer"]: config.layer_attention(r["layer"]).window for r in rows}  # each layer's own
    window = max(windows.values())  # the gated layers' window (a layer schedule's: the largest)
    result = {
        "window": window,
        "stride": ctx.task.stride,
        "channels": "vector gates: channel means",
        "accuracy": _accuracy(outcome, ctx.task.stride),
        "gates": rows,
        "peak_shifts": peak_shifts(rows, windows),
        "checkpoints": checkpoint_series(ctx, settings),
    }
    if ctx.options.plots:
        plots = [plot_gate_profiles(rows, window, ctx.out_dir / "gate_profiles.png", ctx.model.name)]
        if result["checkpoints"]:
            plots.append(
                plot_gate_training(result["checkpoints"], window, ctx.out_dir / "gate_training.png", ctx.model.name)
            )
        result["plots"] = [p.name for p in plots]
    return result
