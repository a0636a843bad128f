"""Training the lightning indexer (``trainer.indexer``, docs/training.md "Training the lightning indexer"):
DeepSeek-V3.2/V4's recipe, a training-only loss hooked onto the model.

Top-k selection is hard, so the language-model loss gives the indexer no gradient (and its inputs are detached:
``CompressedAttention``). The indexer learns from its own loss instead, per query ``t`` of every layer with an
indexer and over a set ``S_t`` of compressed entries:

    KL(p_t || softmax(I_t)),    p_t(s) = sum_h exp(q_h . k_s / sqrt(D) - lse_h(t)) / Z_t    (s in S_t)

``I_t`` are the indexer's scores (``LightningIndexer``), ``lse_h(t)`` the log-sum-exp of the layer's ONE joint
softmax (sliding window, entries and sink together, as the reference and the Triton kernel return it), so
``exp(q_h . k_s / sqrt(D) - lse_h)`` is the probability that head ``h`` puts on entry ``s`` in the attention it
actually computed; summed over heads and L1-normalised over ``S_t`` (``Z_t``), detached. The loss is the mean over
the queries with a non-empty ``S_t`` and over layers; the trainer adds ``weight`` times it to the objective.

Two stages: first a dense stage, where every layer attends to every visible entry (the hook hands the layer no
selection) and ``S_t`` is every visible entry; then sparse training: the layers attend to the indexer's top-k,
``S_t`` is the selected entries, and the model trains on the LM loss while the indexer trains on its KL. The dense
stage is either ``warmup_steps`` of warm-up, where only the indexer trains (the LM loss is not backpropagated and
the other parameters' learning rate is 0: V4's warm-up of an indexer added to a dense-trained model), or
``dense_steps`` of dense training, where the whole model trains on the LM loss and the indexer on its KL at once
(neither loss reaches the other's parameters, so this is V4's dense pre-training and indexer warm-up in one stage,
for a model trained from scratch).

Recall (logged): for each query whose selection binds (more visible entries than ``topk``), the fraction of the
main attention's mass on its ``topk`` heaviest visible entries that lies on entries the indexer selected; the mass
is the dense joint softmax's (in sparse training its log-sum-exp is extended by the unselected visible entries), so
a perfect indexer scores 1 and one that picks at random ``topk / visible`` on average.

Like ``ckv.train.gate_entropy`` the model carries nothing for this: forward hooks on every ``LightningIndexer``
(reading its scores and selection, and returning no selection during the warm-up) and on every layer's
``attend`` (reading its queries, entries and log-sum-exp). They act only while their module trains with
gradients enabled (validation, evaluation and decoding are untouched), and terms are kept only between ``start``
and ``finish`` of one micro-step (the forward that activation checkpointing replays in backward is dropped).
Memory: the target needs every (query, head, entry) logit, ``B * T * H * E`` fp32, as the reference attention's
scores do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ckv.attention.compressed import CompressedAttention
from ckv.attention.indexer import entry_logits, top_k
from ckv.config import ConfigError, check_float, check_int


@dataclass
class IndexerTrainingConfig:
    """``trainer.indexer``: the lightning indexer's loss ``weight`` (> 0 wherever the model has an indexer: at 0
    the indexer would never train) and its dense stage before sparse training, at most one of ``warmup_steps``
    (only the indexer trains) and ``dense_steps`` (the whole model trains, attending every visible entry). Used
    only by models with ``attention.selection``."""

    weight: float = 1.0
    warmup_steps: int = 0
    dense_steps: int = 0

    def __post_init__(self) -> None:
        check_float("trainer.indexer.weight", self.weight, 0)
        check_int("trainer.indexer.warmup_steps", self.warmup_steps, 0)
        check_int("trainer.indexer.dense_steps", self.dense_steps, 0)
        if self.warmup_steps and self.dense_steps:
            raise ConfigError(
                f"trainer.indexer.warmup_steps={self.warmup_steps} and dense_steps={self.dense_steps} are two dense "
                "stages (warm-up: only the indexer trains; dense: the whole model trains): set one of them to 0"
            )

    @property
    def dense_stage(self) -> int:
        """The optimizer steps before sparse training (warm-up or dense training)."""
        return self.warmup_steps + self.dense_steps


def _listed(selected: torch.Tensor, n_entries: int) -> torch.Tensor:
    """(B, Tq, E) bool: entry ``s`` is listed in row ``[b, t]`` of ``selected`` (-1: an empty slot). Unchecked
    (the layer's attention already checked it), so no host sync."""
    B, T, _ = selected.shape
    listed = torch.zeros(B, T, n_entries + 1, dtype=torch.bool, device=selected.device)  # column E: empty slots
    listed.scatter_(-1, torch.where(selected < 0, n_entries, selected), True)
    return listed[..., :n_entries]


def indexer_loss_and_recall(
    q: torch.Tensor,
    kc: torch.Tensor,
    lse: torch.Tensor,
    scores: torch.Tensor,
    selected: torch.Tensor,
    topk: int,
    dense: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's KL term and recall (module docstring), both 0-d fp32.

    q (B, Tq, H, D), kc (B, E, KV, D), lse (B, Tq, H): the joint softmax's queries, entries and log-sum-exp
    (detached here); scores (B, Tq, E): the indexer's (``-inf`` exactly where an entry is not visible; the only
    input with a gradient); selected (B, Tq, K): its top-k; ``dense``: the layer attended to every visible entry
    (warm-up) rather than to the selection. The KL is the mean over queries with a non-empty set (0 when none);
    the recall the mean over queries whose selection binds (NaN when none does)."""
    q, kc, lse = q.detach(), kc.detach(), lse.detach().float()
    visible = torch.isfinite(scores.detach())  # (B, T, E)
    chosen = _listed(selected, kc.shape[1]) & visible
    attended = visible if dense else chosen  # the entries in the joint softmax, and the KL's set
    logits = entry_logits(q, kc)  # (B, T, H, E)
    mass = torch.exp(logits - lse[..., None]).masked_fill(~attended[:, :, None], 0.0).sum(2)  # (B, T, E)
    total = mass.sum(-1, keepdim=True)
    rows = attended.any(-1) & (total[..., 0] > 0)  # (B, T): queries with a target
    target = mass / total.clamp_min(1e-30)
    # rows without a target get finite scores (0): a log-softmax over nothing would put NaN into the gradient
    masked = scores.masked_fill(~attended, float("-inf")).masked_fill(~rows[..., None], 0.0)
    log_q = torch.log_softmax(masked, dim=-1).masked_fill(~attended, 0.0)
    kl = (torch.xlogy(target, target) - target * log_q).sum(-1)  # (B, T)
    loss = kl[rows].sum() / rows.sum().clamp_min(1)

    with torch.no_grad():
        unselected = visible & ~attended  # entries the sparse softmax left out: extend its log-sum-exp by them
        extra = logits.masked_fill(~unselected[:, :, None], float("-inf"))
        dense_lse = torch.logsumexp(torch.cat([lse[..., None], extra], dim=-1), dim=-1)  # (B, T, H)
        p = torch.exp(logits - dense_lse[..., None]).masked_fill(~visible[:, :, None], 0.0).sum(2)  # (B, T, E)
        heaviest = _listed(top_k(p.masked_fill(~visible, float("-inf")), topk), kc.shape[1])
        binding = visible.sum(-1) > topk  # (B, T)
        caught = (p * (heaviest & chosen)).sum(-1) / (p * heaviest).sum(-1).clamp_min(1e-30)
        recall = caught[binding].mean() if binding.any() else caught.new_full((), float("nan"))
    return loss, recall


class IndexerTraining:
    """Forward hooks on every compressed layer with a lightning indexer of ``model`` that add up the indexer's
    loss and recall over one forward, with ``trainer.indexer``'s settings ``cfg``.

    ``start(dense)`` opens a micro-step (``dense``: the dense stage, every layer attends to every visible entry);
    ``finish()`` closes it and returns the mean KL over the hooked layers (0-d fp32 on the model's device, attached
    to the indexers' graph; 0 when nothing was hooked) and the mean recall (NaN when no selection bound).
    ``remove()`` takes the hooks off. No host sync."""

    def __init__(self, model: nn.Module, cfg: IndexerTrainingConfig) -> None:
        self.cfg = cfg
        self.weight = float(cfg.weight)
        self.dense = False
        self._open = False
        self._terms: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer id -> (scores, selection)
        self._device = next(model.parameters()).device
        layers = [m for m in model.modules() if isinstance(m, CompressedAttention) and m.indexer is not None]
        if not layers:
            raise ValueError("indexer training found no lightning indexer (attention.selection) in the model")
        self._handles = []
        for layer in layers:
            self._handles.append(layer.indexer.register_forward_hook(partial(self._on_indexer, layer)))
            self._handles.append(layer.attend.register_forward_hook(partial(self._on_attend, layer), with_kwargs=True))

    def _on_indexer(self, layer: CompressedAttention, module: nn.Module, args: Any, output: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return None
        self._pending[id(layer)] = output
        return (output[0], None) if self.dense else None  # None: keep the indexer's selection

    def _on_attend(
        self, layer: CompressedAttention, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any
    ) -> None:
        record = self._pending.pop(id(layer), None)
        if record is None:  # not training
            return
        scores, selected = record
        q, kc = args[0], args[1]
        term = indexer_loss_and_recall(q, kc, output[1], scores, selected, layer.indexer.topk, self.dense)
        if self._open:  # a checkpointed layer's replay in backward computes the same ops, and is dropped here
            self._terms.append(term)

    def start(self, dense: bool = False) -> None:
        self.dense = dense
        self._terms.clear()
        self._pending.clear()
        self._open = True

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._open = False
        terms, self._terms = self._terms, []
        if not terms:
            zero = torch.zeros((), dtype=torch.float32, device=self._device)
            return zero, torch.full_like(zero, float("nan"))
        losses, recalls = zip(*terms)
        return torch.stack(losses).mean(), torch.stack(recalls).nanmean()

    def in_warmup(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` belongs to the warm-up (only the indexer trains)."""
        return step < self.cfg.warmup_steps

    def attends_densely(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` belongs to the dense stage (warm-up or dense training)."""
        return step < self.cfg.dense_stage

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every lightning indexer of ``model`` (the only ones the dense warm-up trains)."""
    return [
        p
        for m in model.modules()
        if isinstance(m, CompressedAttention) and m.indexer is not None
        for p in m.indexer.parameters()
    ]


def has_indexer(model: nn.Module) -> bool:
    """Whether ``model`` has a compressed layer with a lightning indexer."""
    return any(isinstance(m, CompressedAttention) and m.indexer is not None for m in model.modules())
