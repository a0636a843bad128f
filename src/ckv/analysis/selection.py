"""Selection: how often top-k selection keeps the target record, per phase (``eval.py analysis=selection``).

For every compressed layer the analysis reads the selection the layer attended with at the final query position
(the last prompt token, whose logits the lookup task scores) from a forward hook on its joint softmax
(``CompressedAttention.attend``: the lightning indexer's top-k, the oracle's, or every visible entry without
``attention.selection``), and finds the entries that hold the target record: those whose window pools one of its
``record_len`` tokens (``ckv.geometry.window_positions``, in the layer's grid coordinates). Per prompt and layer:

- ``hit``: at least one selected entry holds a token of the target record;
- ``covered``: every token of the target record lies in some selected entry (what a split record needs: both
  halves of its key).

Per phase of the target (position mod the task's stride) it reports both rates beside the accuracy, and per layer
the accuracy of the prompts whose record was covered and of those whose record was not. The scores come from the
same forward passes, so the accuracy is the task's; ``report`` holds the task's full statistics of them (the
``results`` block of ``eval.py``'s results.json: phase gap, interval, noise floor, equivalence verdict, MDE).

``oracle_topk`` (default null) evaluates the model with oracle selection imposed at inference
(``attention.selection: {by: oracle, topk: oracle_topk}``, ``with_oracle``): the same weights (oracle selection has
no parameters), each query attending only to the top-k entries of its layer's own dense attention. On a model
trained dense this asks what a perfect selector would cost it, per phase.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ckv.analysis.hooks import AnalysisNotApplicable, settings_from_params
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.attention.compressed import CompressedAttention
from ckv.checks import check_int
from ckv.config import ModelConfig
from ckv.eval.models import CkvLastLogits, LoadedModel
from ckv.eval.scoring import length_batches
from ckv.eval.stats import group_accuracy
from ckv.geometry import compressed_mask, window_positions


def selected_layers(module: nn.Module, model_name: str) -> list[CompressedAttention]:
    """The compressed attention layers of ``module`` in order; ``AnalysisNotApplicable`` when it has none."""
    layers = [m for m in module.modules() if isinstance(m, CompressedAttention)]
    if not layers:
        raise AnalysisNotApplicable(
            f"analysis=selection reads the compressed entries each query attends to; {model_name} has no "
            "compressed attention layer (attention.kind=compressed)"
        )
    return layers


@dataclass(frozen=True)
class SelectionSettings:
    """``oracle_topk``: impose oracle selection of this many entries at evaluation (``with_oracle``); None: the
    model as it is."""

    oracle_topk: Optional[int] = None

    def __post_init__(self) -> None:
        if self.oracle_topk is not None:
            check_int("analysis.oracle_topk", self.oracle_topk, 1)


def with_oracle(model: LoadedModel, topk: int) -> LoadedModel:
    """``model`` (a ckv model whose compressed layers attend without selection) rebuilt with oracle selection of
    ``topk`` entries and the same weights, in eval mode on the same device."""
    config = model.module.config
    if config.attention.selection is not None:
        raise AnalysisNotApplicable(
            f"analysis.oracle_topk={topk} imposes oracle selection, but {model.name} already selects "
            f"(attention.selection.by={config.attention.selection.by!r}): use oracle_topk=null"
        )
    d = config.to_dict()
    d["attention"] = {**d["attention"], "selection": {"topk": topk, "by": "oracle"}}
    module = type(model.module)(ModelConfig.from_dict(d))
    module.load_state_dict(model.module.state_dict())  # strict: oracle selection adds no parameter
    module.to(model.device).eval()
    name = f"{model.name} + oracle top-{topk}"
    return dataclasses.replace(model, name=name, module=module, logits=CkvLastLogits(module))


def target_entries(layer: CompressedAttention, n_entries: int, starts: torch.Tensor, record_len: int) -> torch.Tensor:
    """(B, E, R) bool: entry ``j`` of ``layer``'s grid pools token ``r`` of the record starting at real position
    ``starts[b]`` (B,)."""
    P = layer.origin
    pos, present = window_positions(0, n_entries, layer.window, layer.stride, device=starts.device, origin=P)  # (E, W)
    tokens = starts[:, None] + P + torch.arange(record_len, device=starts.device)  # (B, R) grid positions
    same = pos[None, :, :, None] == tokens[:, None, None, :]  # (B, E, W, R)
    return (same & present[None, :, :, None]).any(2)


def chosen_entries(selected: torch.Tensor | None, n_entries: int, q_grid: int, stride: int, batch: int) -> torch.Tensor:
    """(B, E) bool: the entries the final query (grid position ``q_grid``) attended, from its row of ``selected``
    (B, K) (-1: empty slot) or, without selection (None), every entry visible to it."""
    visible = compressed_mask(torch.tensor([q_grid]), n_entries, stride)[0]  # (E,)
    if selected is None:
        return visible[None].expand(batch, n_entries)
    listed = torch.zeros(batch, n_entries + 1, dtype=torch.bool)  # column E: the empty slots
    listed.scatter_(-1, torch.where(selected < 0, n_entries, selected).long().cpu(), True)
    return listed[:, :n_entries] & visible


@dataclass
class SelectionRecorder:
    """Forward hooks on every layer's ``attend`` that keep, per call, the final query's selection and the number
    of entries; ``take()`` returns and clears what the last forward recorded, one item per layer."""

    layers: list[CompressedAttention]
    seen: list[tuple[int, torch.Tensor | None, int, int]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.attend.register_forward_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            q, kc, selected = args[0], args[1], kwargs.get("selected")
            last = None if selected is None else selected[:, -1].detach()  # (B, K)
            self.seen.append((i, last, kc.shape[1], kwargs["q_start"] + q.shape[1] - 1))

        return hook

    def take(self) -> list[tuple[int, torch.Tensor | None, int, int]]:
        seen, self.seen = self.seen, []
        return seen

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def selection_outcome(ctx: AnalysisContext, layers: list[CompressedAttention]) -> tuple[np.ndarray, np.ndarray, Any]:
    """Score the task once with hooks on ``layers``: ``hit`` and ``covered`` (n_layers, P) bool and the outcome."""
    task, R = ctx.task, ctx.task.codec.record_len
    starts_all = torch.as_tensor(task.table["target_position"])
    lengths = np.array([len(p) for p in task.prompts], dtype=np.int64)
    batches = iter(length_batches(lengths, ctx.options.batch_size))  # score_next_token's order
    hit = np.zeros((len(layers), len(lengths)), dtype=bool)
    covered = np.zeros_like(hit)
    recorder = SelectionRecorder(layers)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        idx = next(batches)
        if not torch.equal(ids.cpu(), torch.as_tensor(np.stack([task.prompts[i] for i in idx]))):
            raise RuntimeError("analysis=selection: the prompts arrived in another order than length_batches'")
        out = ctx.model.logits(ids)
        starts = starts_all[idx]
        for i, last, n_entries, q_grid in recorder.take():
            layer = layers[i]
            holds = target_entries(layer, n_entries, starts, R)  # (B, E, R)
            chosen = chosen_entries(last, n_entries, q_grid, layer.stride, len(idx))  # (B, E)
            hit[i, idx] = (holds.any(-1) & chosen).any(-1).numpy()
            covered[i, idx] = (holds & chosen[..., None]).any(1).all(-1).numpy()
        return out

    try:
        outcome = ctx.evaluate(logits)
    finally:
        recorder.remove()
    return hit, covered, outcome


def _rate(x: np.ndarray) -> float | None:
    return float(x.mean()) if len(x) else None


def selection_rows(hit: np.ndarray, covered: np.ndarray, correct: np.ndarray, phases: np.ndarray, stride: int) -> dict:
    """Per phase: accuracy and, per layer, the hit and covered rates; per layer the accuracy where the record was
    covered and where it was not (None without such prompts)."""
    acc = group_accuracy(correct, phases, stride).accuracy
    per_phase = [
        {
            "phase": r,
            "n": int((phases == r).sum()),
            "accuracy": float(acc[r]),
            "hit": [_rate(h[phases == r]) for h in hit],
            "covered": [_rate(c[phases == r]) for c in covered],
        }
        for r in range(stride)
    ]
    per_layer = [
        {
            "layer": i,
            "hit": _rate(hit[i]),
            "covered": _rate(covered[i]),
            "accuracy_covered": _rate(correct[covered[i]]),
            "accuracy_missed": _rate(correct[~covered[i]]),
        }
        for i in range(len(hit))
    ]
    return {"mean_accuracy": float(correct.mean()), "phases": per_phase, "layers": per_layer}


def plot_selection(result: dict, path: Path, title: str) -> Path:
    """Per phase: accuracy (black) and each layer's covered rate (coloured, hit rate dashed)."""
    import matplotlib.pyplot as plt

    phases = [p["phase"] for p in result["phases"]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(phases, [100 * p["accuracy"] for p in result["phases"]], "k-o", label="accuracy")
    for i in range(len(result["layers"])):
        color = plt.cm.tab10(i)
        ax.plot(phases, [100 * p["covered"][i] for p in result["phases"]], "-s", color=color, label=f"L{i} covered")
        ax.plot(phases, [100 * p["hit"][i] for p in result["phases"]], "--", color=color, alpha=0.6, label=f"L{i} hit")
    ax.set_xlabel(f"phase of the target record (position mod {result['stride']})")
    ax.set_ylabel("%")
    ax.set_ylim(-2, 102)
    ax.set_xticks(phases)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@register_analysis("selection")
def selection(ctx: AnalysisContext) -> dict:
    """``eval.py analysis=selection``: per phase of the target, how often each layer's selection at the query
    holds (``hit``) and covers (``covered``) the target record, beside the accuracy; a plot."""
    settings = settings_from_params(SelectionSettings, ctx.params, "selection")
    if settings.oracle_topk is not None:
        selected_layers(ctx.model.module, ctx.model.name)
        ctx = dataclasses.replace(ctx, model=with_oracle(ctx.model, settings.oracle_topk))
    layers = selected_layers(ctx.model.module, ctx.model.name)
    stride = ctx.task.require_stride("analysis=selection")
    hit, covered, outcome = selection_outcome(ctx, layers)
    a = ctx.model.module.config.attention
    result = {
        "stride": stride,
        "record_len": ctx.task.codec.record_len,
        "topk": None if a.selection is None else a.selection.topk,
        "by": None if a.selection is None else a.selection.by,
        **selection_rows(hit, covered, outcome.correct, outcome.table["phase"], stride),
        "report": ctx.report(outcome),
    }
    if ctx.options.plots:
        result["plots"] = [plot_selection(result, ctx.out_dir / "selection.png", ctx.model.name).name]
    return result
