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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from statistics import NormalDist
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ckv.analysis.hooks import AnalysisNotApplicable, settings_from_params
from ckv.analysis.paired import interval, paired_replicates
from ckv.analysis.plots import plot_selection
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.attention import AttendCall, CompressedAttention, compressed_layers
from ckv.attention.indexer import oracle_selection, top_k
from ckv.checks import check_choice, check_float, check_int
from ckv.config import ConfigError
from ckv.eval.scoring import length_batches
from ckv.eval.stats import StatsOptions, bootstrap_group_accuracy, group_accuracy, wilson_interval
from ckv.geometry import compressed_mask, phase, window_positions


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
CONTROL = "oracle_drop"  # the positive control: the oracle, dropping the straddling record with probability ``drop``
SELECTORS = ("model", "dense", "indexer", *QUANTISED, "oracle", "random", "recency", CONTROL)
NEEDS_TOPK = ("indexer", *QUANTISED, "oracle", "random", "recency", CONTROL)


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
    call = AttendCall.decode(args, kwargs)
    q, kc = call.q, call.kc  # (B, Tq, H, D), (B, E, KV, D)
    B, T, E = q.shape[0], q.shape[1], kc.shape[1]
    q_start, stride = call.q_start, call.stride
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
    selector's generator is seeded with ``seed`` on entry, so one evaluation draws the same selections every run.
    ``oracle_drop`` (the positive control) also needs each batch's targets before its forward (``targets``): it
    drops the record of a prompt at a straddling phase with probability ``drop``, drawn once per prompt."""

    def __init__(
        self, layers: list[CompressedAttention], selector: str, topk: Optional[int], seed: int = 0, drop: float = 0.0
    ) -> None:
        self.layers, self.selector, self.topk, self.seed, self.drop = layers, selector, topk, seed, drop
        self.generator = torch.Generator()
        self.handles: list[Any] = []
        self.saved: list[tuple[int, str]] = []  # each indexer's (topk, quant) while an indexer selector serves
        self.starts: Optional[torch.Tensor] = None  # (B,) the batch's record starts (oracle_drop)
        self.dropped: Optional[torch.Tensor] = None  # (B,) bool: the prompts whose record oracle_drop drops
        self.record_len = 0

    def targets(self, starts: torch.Tensor, straddle: np.ndarray, record_len: int) -> None:
        """The next forward's records (``starts`` (B,) real positions, ``record_len`` tokens) and whether each lies
        at a straddling phase (``straddle`` (B,) bool); draws which of those ``oracle_drop`` drops."""
        draw = torch.rand(len(starts), generator=self.generator) < self.drop
        self.starts, self.dropped, self.record_len = starts, torch.as_tensor(straddle) & draw, record_len

    def _on_attend(
        self, layer: CompressedAttention, module: nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]]:
        if self.selector == "dense":
            return args, {**kwargs, "selected": None}
        if self.selector == CONTROL:
            if self.dropped is None:
                raise RuntimeError(f"{CONTROL} serves a forward whose targets were not given (targets())")
            selected = imposed_selection("oracle", module, args, kwargs, self.topk)
            selected = drop_record(layer, selected, args, kwargs, self.starts, self.record_len, self.dropped,
                                   self.generator)  # fmt: skip
            return args, {**kwargs, "selected": selected}
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
                hook = partial(self._on_attend, layer)
                self.handles.append(layer.attend.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for layer, (k, quant) in zip(self.layers, self.saved):
            layer.indexer.topk, layer.indexer.quant = k, quant
        self.saved, self.starts, self.dropped = [], None, None
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


def drop_record(
    layer: CompressedAttention,
    selected: torch.Tensor,
    args: tuple,
    kwargs: dict[str, Any],
    starts: torch.Tensor,
    record_len: int,
    dropped: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """``selected`` (B, Tq, K) with the final query's row replaced, for the ``dropped`` (B,) prompts, by a
    selection that holds no token of the record starting at ``starts`` (B,): the row's picks that hold none, then
    picks drawn uniformly (``generator``) from the other visible entries that hold none, best first as ``top_k``
    lists them (``-1`` where fewer remain). ``args``/``kwargs``: the layer's ``attend`` call."""
    if not bool(dropped.any()):
        return selected
    call = AttendCall.decode(args, kwargs)
    E, q_grid = call.n_entries, call.last_query  # the final query's grid position
    holds = target_entries(layer, E, starts.cpu(), record_len).any(-1)  # (B, E)
    visible = compressed_mask(torch.tensor([q_grid]), E, call.stride)[0]  # (E,)
    last = selected[:, -1].cpu()  # (B, K)
    kept = torch.zeros(len(last), E + 1, dtype=torch.bool)  # column E: the empty slots
    kept.scatter_(-1, torch.where(last < 0, E, last), True)
    rank = torch.rand(len(last), E, generator=generator)  # (B, E): fills at random
    rank = torch.where(kept[:, :E], rank + 1, rank).masked_fill(holds | ~visible, float("-inf"))  # picks first
    row = top_k(rank[:, None], selected.shape[-1])[:, 0]  # (B, K)
    out = selected.clone()
    out[:, -1] = torch.where(dropped[:, None], row.to(selected.device), selected[:, -1])
    return out


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
            call = AttendCall.decode(args, kwargs)
            last = None if call.selected is None else call.selected[:, -1].detach()  # (B, K)
            self.seen.append((i, last, call.n_entries, call.last_query))

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
    a = ctx.model.module.config.attention
    quantised = [n for n in settings.selectors if n in QUANTISED]
    fp32 = next((n for n in ("indexer", "model") if n in settings.selectors), None)  # the fp32 selection to compare
    if quantised and (fp32 is None or a.selection.quant != "none"):  # quantised selectors need an indexer: a.selection
        raise AnalysisNotApplicable(
            f"analysis.selectors {quantised} are compared with the selection of an indexer in fp32: list 'indexer' "
            f"(or 'model') too, on a model with attention.selection.quant=none (this one: {a.selection.quant!r})"
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
        "model_selection": None if a.selection is None else {"by": a.selection.by, "topk": a.selection.topk},
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
