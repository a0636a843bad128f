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
- ``recency``: the ``topk`` most recent visible entries.

``topk`` defaults to the model's ``attention.selection.topk``. Per selector and phase: the accuracy, each layer's
hit and covered rates with Wilson intervals, the accuracy when the record was covered and when it was missed (with
Wilson intervals and their counts), and the straddling ratio (the covered rate at the phases where the fewest
visible entries hold the whole record over the rate at the other phases, with a cluster-bootstrap interval). Beside
them, ``geometric``: the exact probability that a uniformly random ``topk`` of the visible entries covers the
record (``random_cover_probability``), averaged per phase, and its straddling ratio. ``paired``: every selector's
accuracy minus the reference's (``dense`` when listed, else the first selector), per phase and overall, with a
paired cluster-bootstrap interval (``ckv.analysis.paired``). ``report`` holds each selector's task statistics (the
``results`` block of ``eval.py``'s results.json: phase gap, interval, noise floor, equivalence verdict, MDE).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ckv.analysis.hooks import AnalysisNotApplicable, settings_from_params
from ckv.analysis.paired import interval, paired_replicates
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.attention import CompressedAttention, compressed_layers
from ckv.attention.indexer import oracle_selection, top_k
from ckv.checks import check_choice, check_int
from ckv.config import ConfigError
from ckv.eval.scoring import length_batches
from ckv.eval.stats import bootstrap_group_accuracy, group_accuracy, wilson_interval
from ckv.geometry import compressed_mask, window_positions


def selected_layers(module: nn.Module, model_name: str) -> list[CompressedAttention]:
    """The compressed attention layers of ``module`` in order; ``AnalysisNotApplicable`` when it has none."""
    layers = compressed_layers(module)
    if not layers:
        raise AnalysisNotApplicable(
            f"analysis=selection reads the compressed entries each query attends to; {model_name} has no "
            "compressed attention layer (attention.kind=compressed)"
        )
    return layers


QUANTISED = {"indexer_fp8": "fp8", "indexer_fp4": "fp4"}  # selector -> the indexer's attention.selection.quant
SELECTORS = ("model", "dense", "indexer", *QUANTISED, "oracle", "random", "recency")
NEEDS_TOPK = ("indexer", *QUANTISED, "oracle", "random", "recency")


@dataclass(frozen=True)
class SelectionSettings:
    """``selectors``: the selectors that serve the model, each in its own evaluation of the same prompts (module
    docstring); ``topk``: the entries they keep (None: the model's ``attention.selection.topk``); ``seed``: the
    random selector's seed."""

    selectors: tuple[str, ...] = ("model",)
    topk: Optional[int] = None
    seed: int = 0

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

    @property
    def reference(self) -> str:
        """The selector the paired differences are taken against: ``dense`` when listed, else the first."""
        return "dense" if "dense" in self.selectors else self.selectors[0]


def resolve_topk(settings: SelectionSettings, module: nn.Module, model_name: str) -> Optional[int]:
    """The ``k`` the selectors keep (and the geometric expectation's): ``analysis.topk``, else the model's
    ``attention.selection.topk``, else None. Raises ``AnalysisNotApplicable`` when a listed selector needs one and
    neither is set, or when ``indexer`` is listed for a model without a lightning indexer in every compressed layer."""
    selection = module.config.attention.selection
    needs = [s for s in settings.selectors if s in NEEDS_TOPK]
    indexers = [s for s in needs if s.startswith("indexer")]
    if indexers and not all(layer.indexer is not None for layer in selected_layers(module, model_name)):
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


def imposed_selection(
    selector: str,
    attend: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    k: int,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """(B, Tq, min(k, E)) int64: ``selector``'s (``oracle``, ``random`` or ``recency``) top-``k`` entries for the
    queries of one ``attend`` call (``args``/``kwargs``: the layer's ``joint_attention`` arguments), among the
    entries visible to each (``geometry.compressed_mask``), ``-1`` in the slots beyond them (``top_k``). ``oracle``:
    ``oracle_selection`` of the layer's dense joint softmax, as ``attention.selection.by: oracle`` computes it;
    ``random``: a uniformly random order of the visible entries drawn from ``generator``; ``recency``: the latest."""
    q, kc = args[0], args[1]  # (B, Tq, H, D), (B, E, KV, D)
    B, T, E = q.shape[0], q.shape[1], kc.shape[1]
    q_start, stride = kwargs["q_start"], kwargs["stride"]
    if selector == "oracle":  # the dense joint softmax's log-sum-exp (every visible entry)
        with torch.no_grad():
            _, lse = attend.forward(*args, **{**kwargs, "selected": None})  # (B, Tq, H)
        return oracle_selection(q, kc, lse, q_start, stride, k)
    if selector == "random":
        rank = torch.rand(B, T, E, generator=generator).to(q.device)
    elif selector == "recency":
        rank = torch.arange(E, dtype=torch.float32, device=q.device).expand(B, T, E)
    else:
        raise ValueError(f"selector {selector!r} is not imposed by a ranking; known: oracle, random, recency")
    visible = compressed_mask(torch.arange(q_start, q_start + T, device=q.device), E, stride)  # (Tq, E)
    return top_k(rank.masked_fill(~visible, float("-inf")), k)


class ImposedSelection:
    """Under this context manager every layer of ``layers`` attends with ``selector``'s selection of ``topk``
    entries (module docstring): a forward pre-hook on each layer's ``attend`` replaces its ``selected`` (``dense``:
    None; ``oracle``, ``random``, ``recency``: ``imposed_selection``), and ``indexer`` sets each lightning
    indexer's ``topk`` for the duration (its own selection code path; ``indexer_fp8``/``indexer_fp4`` its
    ``quant`` too); ``model`` changes nothing. The random
    selector's generator is seeded with ``seed`` on entry, so one evaluation draws the same selections every run."""

    def __init__(self, layers: list[CompressedAttention], selector: str, topk: Optional[int], seed: int = 0) -> None:
        self.layers, self.selector, self.topk, self.seed = layers, selector, topk, seed
        self.generator = torch.Generator()
        self.handles: list[Any] = []
        self.saved: list[tuple[int, str]] = []  # each indexer's (topk, quant) while an indexer selector serves

    def _on_attend(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if self.selector == "dense":
            return args, {**kwargs, "selected": None}
        selected = imposed_selection(self.selector, module, args, kwargs, self.topk, self.generator)
        return args, {**kwargs, "selected": selected}

    def __enter__(self) -> ImposedSelection:
        self.generator.manual_seed(self.seed)
        for layer in self.layers:
            if self.selector.startswith("indexer"):
                self.saved.append((layer.indexer.topk, layer.indexer.quant))
                layer.indexer.topk = self.topk
                layer.indexer.quant = QUANTISED.get(self.selector, layer.indexer.quant)
            elif self.selector != "model":
                self.handles.append(layer.attend.register_forward_pre_hook(self._on_attend, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for layer, (k, quant) in zip(self.layers, self.saved):
            layer.indexer.topk, layer.indexer.quant = k, quant
        self.saved = []
        for h in self.handles:
            h.remove()
        self.handles = []


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
    ctx: AnalysisContext, layers: list[CompressedAttention], topk: Optional[int] = None
) -> SelectionOutcome:
    """Score the task once with hooks on ``layers`` (``SelectionOutcome``; ``topk`` sizes the geometric
    expectation)."""
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
        out = ctx.model.logits(ids)
        starts = starts_all[idx]
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


def straddling_phases(whole: np.ndarray, phases: np.ndarray, stride: int) -> list[int]:
    """The phases at which the fewest visible entries hold the whole target record (mean over prompts, the last
    layer's grid): where the record straddles a stride boundary. Empty when every phase has as many."""
    mean = np.array([whole[-1][phases == r].mean() if (phases == r).any() else np.nan for r in range(stride)])
    low = np.nanmin(mean)
    return [] if np.allclose(mean[np.isfinite(mean)], low) else [int(r) for r in np.flatnonzero(mean == low)]


def straddle_ratio(
    rate: np.ndarray,
    phases: np.ndarray,
    straddling: list[int],
    clusters: np.ndarray,
    n_boot: int,
    seed: int,
    level: float,
) -> dict:
    """``{"value", "lower", "upper"}``: the mean of ``rate`` (P,) (0/1 or a probability) at the ``straddling``
    phases over its mean at the other phases, with a cluster-bootstrap interval (the same clusters and seed as
    the task's statistics); None values without straddling phases or without a rate at the others."""
    if not straddling:
        return {"value": None, "lower": None, "upper": None}
    group = np.isin(phases, straddling).astype(np.int64)  # 1: straddling
    means = np.array([rate[group == g].mean() for g in (0, 1)])
    reps, _ = bootstrap_group_accuracy(rate, group, 2, clusters, n_boot, seed)  # (n_boot, 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        value = means[1] / means[0] if means[0] > 0 else float("nan")
        return interval(reps[:, 1] / reps[:, 0], value, level)


def selector_rows(res: SelectionOutcome, stride: int, straddling: list[int], ctx: AnalysisContext) -> dict:
    """One selector's results: per phase the accuracy and, per layer, the hit rate, the covered rate (with a
    Wilson interval) and the accuracy when covered and when missed (``_proportion``: counts, rate, Wilson
    interval); per layer the same over every phase and the straddling ratio of the covered rate."""
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
            "straddle_ratio": straddle_ratio(
                res.covered[i].astype(np.float64),
                phases,
                straddling,
                t["base"],
                opts.n_bootstrap,
                opts.seed,
                opts.level,
            ),
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
                "straddle_ratio": straddle_ratio(
                    geo[i], phases, straddling, t["base"], opts.n_bootstrap, opts.seed, opts.level
                ),
            }
            for i in range(len(geo))
        ],
    }


def paired_differences(
    outcomes: dict[str, Any], reference: str, stride: int, straddling: list[int], ctx: AnalysisContext
) -> dict[str, dict]:
    """Per selector other than ``reference``: its accuracy minus the reference's on the same prompts, per phase
    and overall, and ``straddle_excess``, the difference at the ``straddling`` phases minus the difference at the
    others (how much more the selector costs the straddling phases; None values without straddling phases), each
    ``{"value", "lower", "upper"}`` with a paired cluster-bootstrap interval (one resample of the key->value
    mappings applied to every selector: ``ckv.analysis.paired``)."""
    names = [reference, *(n for n in outcomes if n != reference)]
    correct = [outcomes[n].correct for n in names]
    t, opts = outcomes[reference].table, ctx.options.stats
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


def plot_selection(result: dict, path: Path, title: str) -> Path:
    """Left: accuracy per phase, one line per selector. Right: the last layer's covered rate per phase, one line
    per selector with its Wilson interval, and the geometric expectation of a random top-k (dashed, black)."""
    import matplotlib.pyplot as plt

    fig, (acc, cov) = plt.subplots(1, 2, figsize=(12, 4.5))
    for j, (name, res) in enumerate(result["selectors"].items()):
        color = plt.cm.tab10(j)
        phases = [p["phase"] for p in res["phases"]]
        acc.plot(phases, [100 * p["accuracy"] for p in res["phases"]], "-o", color=color, label=name)
        last = [p["layers"][-1]["covered"] for p in res["phases"]]
        cov.errorbar(
            phases,
            [100 * c["rate"] for c in last],
            yerr=[[100 * (c["rate"] - c["lower"]) for c in last], [100 * (c["upper"] - c["rate"]) for c in last]],
            fmt="-s",
            color=color,
            capsize=3,
            label=name,
        )
    if result["geometric"] is not None:
        geo = result["geometric"]["phases"]
        cov.plot([p["phase"] for p in geo], [100 * p["covered"][-1] for p in geo], "k--", label="random (geometry)")
    for ax, what in ((acc, "accuracy (%)"), (cov, "target record covered by the last layer's selection (%)")):
        ax.set_xlabel(f"phase of the target record (position mod {result['stride']})")
        ax.set_ylabel(what)
        ax.set_ylim(-2, 102)
        ax.set_xticks(range(result["stride"]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: top-{result['topk']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    a = ctx.model.module.config.attention
    quantised = [n for n in settings.selectors if n in QUANTISED]
    fp32 = next((n for n in ("indexer", "model") if n in settings.selectors), None)  # the fp32 selection to compare
    if quantised and (fp32 is None or a.selection.quant != "none"):  # quantised selectors need an indexer: a.selection
        raise AnalysisNotApplicable(
            f"analysis.selectors {quantised} are compared with the selection of an indexer in fp32: list 'indexer' "
            f"(or 'model') too, on a model with attention.selection.quant=none (this one: {a.selection.quant!r})"
        )
    results: dict[str, SelectionOutcome] = {}
    for name in settings.selectors:
        with ImposedSelection(layers, name, k, settings.seed):
            results[name] = selection_outcome(ctx, layers, k)
        print(f"analysis=selection: {ctx.model.name} served by {name}: done", flush=True)
    first = results[settings.selectors[0]]
    straddling = straddling_phases(first.whole, first.outcome.table["phase"], stride)
    result = {
        "stride": stride,
        "record_len": ctx.task.codec.record_len,
        "topk": k,
        "model_selection": None if a.selection is None else {"by": a.selection.by, "topk": a.selection.topk},
        "seed": settings.seed,
        "straddling_phases": straddling,
        "selectors": {name: selector_rows(res, stride, straddling, ctx) for name, res in results.items()},
        "geometric": None if k is None else geometric_rows(first, stride, straddling, ctx),
        "paired": paired_differences(
            {n: r.outcome for n, r in results.items()}, settings.reference, stride, straddling, ctx
        ),
        "quantisation": quantisation_rows(results, fp32, stride, ctx.options.stats.level) if quantised else None,
    }
    if ctx.options.plots:
        result["plots"] = [plot_selection(result, ctx.out_dir / "selection.png", ctx.model.name).name]
    return result
