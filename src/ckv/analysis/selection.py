"""Selection: how often top-k selection keeps the target record, per phase, under named selectors
(``eval.py analysis=selection``).

For every compressed layer the analysis reads the selection the layer attended with at the final query position
(the last prompt token, whose logits the lookup task scores) from a forward hook on its joint softmax
(``CompressedAttention.attend``), and finds the entries that hold the target record: those whose window pools one of
its ``record_len`` tokens (``ckv.geometry.window_positions``, in the layer's grid coordinates). Per prompt and layer:

- ``hit``: at least one selected entry holds a token of the target record;
- ``covered``: every token of the target record lies in some selected entry (what a split record needs: both
  halves of its key).

``selectors`` (default ``[model]``) serve the SAME weights on the same prompts, each in its own evaluation
(``ImposedSelection``: forward pre-hooks that replace the layer's selection):

- ``model``: the model as it is (its indexer's or oracle's top-k, or every visible entry without selection);
- ``dense``: every visible entry (a selecting model served without selection);
- ``indexer``: the model's own lightning indexer's top-``topk`` (needs an indexer in every layer);
- ``indexer_fp8``, ``indexer_fp4``: the same with its index queries and keys fake-quantised as the real models
  serve them (``attention.selection.quant``); ``quantisation`` then reports, per layer and phase, how often the
  final query's selection differs from the fp32 indexer's (``indexer`` when listed, else ``model`` when the model's
  own indexer runs in fp32), with Wilson intervals;
- ``oracle``: the top-``topk`` entries of the layer's own DENSE joint softmax mass (``oracle_selection``);
- ``random``: ``topk`` visible entries uniformly at random (seeded by ``seed``);
- ``recency``: the ``topk`` most recent visible entries;
- ``oracle_drop``: the positive control, the oracle except that at prompts whose target lies at a straddling
  phase it drops the record with probability ``drop`` (seeded by ``seed``): the final query's selection then keeps
  the oracle's picks that hold no token of the record and fills the rest uniformly from the visible entries that
  hold none (``drop_record``), in every layer. It misses the straddling record with a known extra probability, so
  ``miss_odds_ratio`` must find it (docs/selection.md). It is served after the other selectors, whose first
  evaluation gives the straddling phases.

``topk`` defaults to the model's ``attention.selection.topk``. Per selector and phase: the accuracy, each layer's
hit and covered rates with Wilson intervals, the accuracy when the record was covered and when it was missed (with
Wilson intervals and their counts), and the straddling ratio (the covered rate at the phases where the fewest
visible entries hold the whole record over the rate at the other phases, with a cluster-bootstrap interval) and
the miss odds ratio with its coverage-matched null (``miss_odds_ratio``: the statistic that is fair at any coverage).
Beside them, ``geometric``: the exact probability that a uniformly random ``topk`` of the visible entries covers the
record (``random_cover_probability``), averaged per phase, and its straddling ratio. ``paired``: every selector's
accuracy minus the reference's (``dense`` when listed, else the first selector), per phase and overall, with a
paired cluster-bootstrap interval (``ckv.analysis.paired``). ``report`` holds each selector's task statistics (the
``results`` block of ``eval.py``'s results.json: phase gap, interval, noise floor, equivalence verdict, MDE).

Its parts: ``ckv.analysis.selection_hooks`` (the selectors imposed on the layers and the recorder of what the final
query attended), ``ckv.analysis.selection_stats`` (the straddling-phase statistics) and
``ckv.analysis.selection_design`` (the study design's simulations on synthetic selections).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ckv.analysis.hooks import AnalysisNotApplicable, settings_from_params
from ckv.analysis.plots import plot_selection
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.analysis.selection_hooks import (
    CONTROL,
    NEEDS_TOPK,
    QUANTISED,
    SELECTORS,
    ImposedSelection,
    SelectionRecorder,
    chosen_entries,
    target_entries,
)
from ckv.analysis.selection_stats import (
    miss_odds_ratio,
    paired_differences,
    random_cover_probability,
    straddle_ratio,
    straddling_phases,
)
from ckv.attention import CompressedAttention, compressed_layers
from ckv.checks import check_choice, check_float, check_int
from ckv.config import ConfigError, ModelConfig
from ckv.eval.scoring import length_batches
from ckv.eval.stats import group_accuracy, wilson_interval
from ckv.options import SelectionConfig


def selected_layers(module: nn.Module, model_name: str) -> list[CompressedAttention]:
    """The compressed attention layers of ``module`` in order; ``AnalysisNotApplicable`` when it has none."""
    layers = compressed_layers(module)
    if not layers:
        raise AnalysisNotApplicable(
            f"analysis=selection reads the compressed entries each query attends to; {model_name} has no "
            "compressed attention layer (attention.kind=compressed)"
        )
    return layers


def model_selection(config: ModelConfig) -> Optional[SelectionConfig]:
    """The top-k selection (``attention.selection``) of the model, each layer's read from its own attention
    (``ModelConfig.layer_attention``): the first layer's that selects (a layer schedule's compressed layers may
    differ, e.g. DeepSeek-V4's CSA layers select and its HCA layers do not), None when none does."""
    selections = [config.layer_attention(i).selection for i in range(config.n_layers)]
    return next((s for s in selections if s is not None), None)


@dataclass(frozen=True)
class SelectionSettings:
    """``selectors``: the selectors that serve the model, each in its own evaluation of the same prompts (module
    docstring); ``topk``: the entries they keep (None: the model's ``attention.selection.topk``); ``seed``: the
    random selector's and the positive control's seed; ``drop``: the probability with which the positive control
    (``oracle_drop``) drops a straddling record."""

    selectors: tuple[str, ...] = ("model",)
    topk: Optional[int] = None
    seed: int = 0
    drop: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.selectors, str):
            object.__setattr__(self, "selectors", (self.selectors,))
        if not self.selectors:
            raise ConfigError(f"analysis.selectors is empty: name one or more of {list(SELECTORS)}")
        for name in self.selectors:
            check_choice("analysis.selectors", name, SELECTORS)
        if len(set(self.selectors)) != len(self.selectors):
            raise ConfigError(f"analysis.selectors={list(self.selectors)} lists a selector twice")
        if self.topk is not None:
            check_int("analysis.topk", self.topk, 1)
        check_int("analysis.seed", self.seed, 0)
        check_float("analysis.drop", self.drop, 0, 1)
        if self.selectors == (CONTROL,):
            raise ConfigError(
                f"analysis.selectors=[{CONTROL}] alone: list another selector too (its evaluation gives the "
                "straddling phases at which the positive control drops the record)"
            )

    @property
    def reference(self) -> str:
        """The selector the paired differences are taken against: ``dense`` when listed, else the first."""
        return "dense" if "dense" in self.selectors else self.selectors[0]


def resolve_topk(settings: SelectionSettings, module: nn.Module, model_name: str) -> Optional[int]:
    """The ``k`` the selectors keep (and the geometric expectation's): ``analysis.topk``, else the model's
    ``attention.selection.topk``, else None. Raises ``AnalysisNotApplicable`` when a listed selector needs one and
    neither is set, or when ``indexer`` is listed for a model without a lightning indexer in every compressed layer."""
    layers = selected_layers(module, model_name)
    selection = model_selection(module.config)
    needs = [s for s in settings.selectors if s in NEEDS_TOPK]
    indexers = [s for s in needs if s.startswith("indexer")]
    if indexers and not all(layer.indexer is not None for layer in layers):
        raise AnalysisNotApplicable(
            f"analysis.selectors lists {indexers}, but {model_name} has no lightning indexer "
            "(attention.selection with by=indexer): drop it from the list"
        )
    k = settings.topk if settings.topk is not None else (None if selection is None else selection.topk)
    if needs and k is None:
        raise AnalysisNotApplicable(
            f"analysis.selectors {needs} keep top-k entries, but {model_name} does not select "
            "(no attention.selection): set analysis.topk"
        )
    return k


@dataclass
class SelectionOutcome:
    """One evaluation of the task with hooks on the layers: ``hit`` and ``covered`` (n_layers, P) bool,
    ``whole`` (n_layers, P) the number of entries visible to the final query that hold every token of the target
    record, ``geometric`` (n_layers, P) the probability that a uniformly random top-k of them covers it (None
    without a k), ``chosen`` (n_layers, P, longest prompt) the entries the final query attended (columns past its
    entries False), and the task's ``outcome``."""

    hit: np.ndarray
    covered: np.ndarray
    whole: np.ndarray
    geometric: Optional[np.ndarray]
    chosen: np.ndarray
    outcome: Any


def selection_outcome(
    ctx: AnalysisContext,
    layers: list[CompressedAttention],
    topk: Optional[int] = None,
    imposed: Optional[ImposedSelection] = None,
    straddling: tuple[int, ...] = (),
) -> SelectionOutcome:
    """Score the task once with hooks on ``layers`` (``SelectionOutcome``; ``topk`` sizes the geometric
    expectation). ``imposed``: told each batch's targets before its forward (``ImposedSelection.targets``), with
    which of them lie at the ``straddling`` phases."""
    task, R = ctx.task, ctx.task.codec.record_len
    starts_all = torch.as_tensor(task.table["target_position"])
    lengths = np.array([len(p) for p in task.prompts], dtype=np.int64)
    batches = iter(length_batches(lengths, ctx.options.batch_size))  # score_next_token's order
    hit = np.zeros((len(layers), len(lengths)), dtype=bool)
    covered = np.zeros_like(hit)
    whole = np.zeros(hit.shape, dtype=np.int64)
    geometric = None if topk is None else np.zeros(hit.shape)
    chosen_all = np.zeros((*hit.shape, int(lengths.max())), dtype=bool)  # entries <= tokens
    recorder = SelectionRecorder(layers)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        idx = next(batches)
        if not torch.equal(ids.cpu(), torch.as_tensor(np.stack([task.prompts[i] for i in idx]))):
            raise RuntimeError("analysis=selection: the prompts arrived in another order than length_batches'")
        starts = starts_all[idx]
        if imposed is not None:
            imposed.targets(starts, np.isin(task.table["phase"][idx], straddling), R)
        out = ctx.model.logits(ids)
        for i, last, n_entries, q_grid in recorder.take():
            layer = layers[i]
            holds = target_entries(layer, n_entries, starts, R)  # (B, E, R)
            chosen = chosen_entries(last, n_entries, q_grid, layer.stride, len(idx))  # (B, E)
            hit[i, idx] = (holds.any(-1) & chosen).any(-1).numpy()
            covered[i, idx] = (holds & chosen[..., None]).any(1).all(-1).numpy()
            chosen_all[i, idx, :n_entries] = chosen.numpy()
            visible = chosen_entries(None, n_entries, q_grid, layer.stride, 1)[0]  # (E,)
            whole[i, idx] = (holds.all(-1) & visible).sum(-1).numpy()
            if geometric is not None:
                seen = holds[:, visible].numpy()  # (B, n_visible, R)
                geometric[i, idx] = [random_cover_probability(h, topk) for h in seen]
        return out

    try:
        outcome = ctx.evaluate(logits)
    finally:
        recorder.remove()
    return SelectionOutcome(hit, covered, whole, geometric, chosen_all, outcome)


def _rate(x: np.ndarray) -> float | None:
    return float(x.mean()) if len(x) else None


def _proportion(x: np.ndarray, level_z: float) -> dict:
    """``{"n", "successes", "rate", "lower", "upper"}`` of the 0/1 array ``x`` (Wilson interval; rate None when
    empty)."""
    k, n = int(np.sum(x)), len(x)
    lo, hi = wilson_interval(k, n, level_z)
    return {"n": n, "successes": k, "rate": k / n if n else None, "lower": float(lo), "upper": float(hi)}


def selector_rows(res: SelectionOutcome, stride: int, straddling: list[int], ctx: AnalysisContext) -> dict:
    """One selector's results: per phase the accuracy and, per layer, the hit rate, the covered rate (with a
    Wilson interval) and the accuracy when covered and when missed (``_proportion``: counts, rate, Wilson
    interval); per layer the same over every phase, the straddling ratio of the covered rate and the miss odds
    ratio with its coverage-matched null (``miss_odds_ratio``; None without a k, hence without the geometry)."""
    correct, t, opts = res.outcome.correct, res.outcome.table, ctx.options.stats
    phases = t["phase"]
    z = NormalDist().inv_cdf((1 + opts.level) / 2)  # the two-sided normal quantile of the level
    acc = group_accuracy(correct, phases, stride).accuracy

    def cell(mask: np.ndarray, i: int) -> dict:
        cov = res.covered[i][mask]
        return {
            "hit": _rate(res.hit[i][mask]),
            "covered": _proportion(cov, z),
            "accuracy_covered": _proportion(correct[mask][cov], z),
            "accuracy_missed": _proportion(correct[mask][~cov], z),
        }

    n_layers = len(res.covered)
    per_phase = [
        {
            "phase": r,
            "n": int((phases == r).sum()),
            "accuracy": float(acc[r]),
            "layers": [cell(phases == r, i) for i in range(n_layers)],
        }
        for r in range(stride)
    ]
    every = np.ones(len(correct), dtype=bool)
    per_layer = [
        {
            "layer": i,
            **cell(every, i),
            "straddle_ratio": straddle_ratio(res.covered[i].astype(np.float64), phases, straddling, t["base"], opts),
            "miss_odds_ratio": None
            if res.geometric is None
            else miss_odds_ratio(res.covered[i], res.geometric[i], phases, straddling, t["base"], opts),
        }
        for i in range(n_layers)
    ]
    return {
        "mean_accuracy": float(correct.mean()),
        "phases": per_phase,
        "layers": per_layer,
        "report": ctx.report(res.outcome),
    }


def geometric_rows(res: SelectionOutcome, stride: int, straddling: list[int], ctx: AnalysisContext) -> dict:
    """The random-selection expectation from the geometry alone: per phase and layer, the mean probability that
    a uniformly random top-k of the visible entries covers the target record, and the mean number of visible
    entries holding it whole; per layer its straddling ratio (with the same bootstrap as the selectors')."""
    t, opts = res.outcome.table, ctx.options.stats
    phases, geo = t["phase"], res.geometric
    return {
        "phases": [
            {
                "phase": r,
                "covered": [float(g[phases == r].mean()) for g in geo],
                "whole_entries": [float(w[phases == r].mean()) for w in res.whole],
            }
            for r in range(stride)
        ],
        "layers": [
            {
                "layer": i,
                "covered": float(geo[i].mean()),
                "straddle_ratio": straddle_ratio(geo[i], phases, straddling, t["base"], opts),
            }
            for i in range(len(geo))
        ],
    }


def quantisation_rows(results: dict[str, SelectionOutcome], against: str, stride: int, level: float) -> dict:
    """Per quantised indexer selector (``QUANTISED``) in ``results``: how often the final query's selection differs
    from ``against``'s (the fp32 indexer), per layer over every prompt and per phase (``_proportion``: counts, rate,
    Wilson interval)."""
    z = NormalDist().inv_cdf((1 + level) / 2)
    phases = results[against].outcome.table["phase"]
    out = {}
    for name in (n for n in results if n in QUANTISED):
        changed = (results[name].chosen != results[against].chosen).any(-1)  # (n_layers, P)
        out[name] = {
            "against": against,
            "layers": [_proportion(c, z) for c in changed],
            "phases": [
                {"phase": r, "layers": [_proportion(c[phases == r], z) for c in changed]} for r in range(stride)
            ],
        }
    return out


@register_analysis("selection")
def selection(ctx: AnalysisContext) -> dict:
    """``eval.py analysis=selection``: the model served by each of ``analysis.selectors`` on the same prompts;
    per phase and selector, how often each layer's selection at the query holds (``hit``) and covers
    (``covered``) the target record, the accuracy when covered and when missed, the geometric expectation of a
    random top-k, the straddling ratios, and the paired accuracy differences against the reference; a plot."""
    settings = settings_from_params(SelectionSettings, ctx.params, "selection")
    layers = selected_layers(ctx.model.module, ctx.model.name)
    k = resolve_topk(settings, ctx.model.module, ctx.model.name)
    stride = ctx.task.require_stride("analysis=selection")
    selection = model_selection(ctx.model.module.config)  # each layer's own attention.selection
    quantised = [n for n in settings.selectors if n in QUANTISED]
    fp32 = next((n for n in ("indexer", "model") if n in settings.selectors), None)  # the fp32 selection to compare
    if quantised and (fp32 is None or selection.quant != "none"):  # quantised selectors need an indexer: a selection
        raise AnalysisNotApplicable(
            f"analysis.selectors {quantised} are compared with the selection of an indexer in fp32: list 'indexer' "
            f"(or 'model') too, on a model with attention.selection.quant=none (this one: {selection.quant!r})"
        )
    results: dict[str, SelectionOutcome] = {}
    straddling: list[int] = []
    for name in sorted(settings.selectors, key=lambda n: n == CONTROL):  # the positive control last
        with ImposedSelection(layers, name, k, settings.seed, settings.drop) as imposed:
            control = name == CONTROL
            results[name] = selection_outcome(ctx, layers, k, imposed if control else None, tuple(straddling))
        if not straddling:  # the geometry, the same in every evaluation: from the first
            straddling = straddling_phases(results[name].whole, results[name].outcome.table["phase"], stride)
        print(f"analysis=selection: {ctx.model.name} served by {name}: done", flush=True)
    results = {name: results[name] for name in settings.selectors}
    first = results[settings.selectors[0]]
    result = {
        "stride": stride,
        "record_len": ctx.task.codec.record_len,
        "topk": k,
        "model_selection": None if selection is None else {"by": selection.by, "topk": selection.topk},
        "seed": settings.seed,
        "drop": settings.drop if CONTROL in settings.selectors else None,
        "straddling_phases": straddling,
        "selectors": {name: selector_rows(res, stride, straddling, ctx) for name, res in results.items()},
        "geometric": None if k is None else geometric_rows(first, stride, straddling, ctx),
        "paired": paired_differences(
            {n: r.outcome for n, r in results.items()}, settings.reference, stride, straddling, ctx.options.stats
        ),
        "quantisation": quantisation_rows(results, fp32, stride, ctx.options.stats.level) if quantised else None,
    }
    if ctx.options.plots:
        result["plots"] = [plot_selection(result, ctx.out_dir / "selection.png", ctx.model.name).name]
    return result
