"""The selectors of ``analysis=selection`` on a model's compressed layers: the selections they impose and the
entries the final query attended.

``ImposedSelection`` serves the same weights under a named selector (forward pre-hooks on each layer's ``attend``
that replace its ``selected``, or the lightning indexer's own ``topk`` and ``quant``; the selectors are described in
``ckv.analysis.selection``); ``SelectionRecorder`` keeps, per layer, the final query's selection (forward hooks);
``target_entries`` and ``chosen_entries`` give the entries that hold a record and those the final query attended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ckv.attention import AttendCall, CompressedAttention
from ckv.attention.indexer import oracle_selection, top_k
from ckv.geometry import compressed_mask, window_positions

QUANTISED = {"indexer_fp8": "fp8", "indexer_fp4": "fp4"}  # selector -> the indexer's attention.selection.quant
CONTROL = "oracle_drop"  # the positive control: the oracle, dropping the straddling record with probability ``drop``
SELECTORS = ("model", "dense", "indexer", *QUANTISED, "oracle", "random", "recency", CONTROL)
NEEDS_TOPK = ("indexer", *QUANTISED, "oracle", "random", "recency", CONTROL)


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
