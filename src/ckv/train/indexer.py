"""Training the lightning indexer (``trainer.indexer``, docs/training.md "Training the lightning indexer"):
DeepSeek-V3.2's recipe (V4 keeps its lightning indexer), a training-only loss hooked onto the model.

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
``S_t`` is the selected entries, and the model trains on the LM loss while the indexer trains on its KL. The sparse
stage's KL over the selected set only is DeepSeek-V3.2's (DeepSeek-V3.2-Exp technical report,
github.com/deepseek-ai/DeepSeek-V3.2-Exp ``DeepSeek_V3_2.pdf``, "Sparse Training Stage":
``L_I = sum_t KL(p_{t, S_t} || softmax(I_{t, S_t}))``, ``S_t`` the selected tokens); ``lse`` is then the sparse
softmax's, over the selected entries, window and sink, as the layer computed it. Before sparse training come up
to two dense stages, in this order (``dense_steps``, then ``warmup_steps``; either may be 0):

1. ``dense_steps`` of dense training: the whole model trains on the LM loss while the indexer trains on its KL at
   once (neither loss reaches the other's parameters). For a model trained from scratch: DeepSeek-V3.2 starts from
   an already trained dense checkpoint (DeepSeek-V3.1-Terminus), which this stage stands in for.
2. ``warmup_steps`` of indexer warm-up: only the indexer trains (the LM loss is not backpropagated and the other
   parameters' learning rate is 0), every layer attending every visible entry: DeepSeek-V3.2's "Dense Warm-up
   Stage" (the report above: the main model frozen, the indexer's KL to the dense attention).
3. Sparse training: DeepSeek-V3.2's "Sparse Training Stage" (above).

``dense_steps`` then ``warmup_steps`` then sparse is the three-stage recipe, the default (``recipe: three_stage``:
60% / 20% / 20% of ``trainer.max_steps`` unless the steps are given: DeepSeek-V3.2's order, ckv's shares and one
learning-rate schedule for every stage; docs/selection.md, "Recipe, sourced", names each deviation); ``recipe:
v32`` is the same order with DeepSeek-V3.2's warm-up:sparse proportion (76% / 1.5% / 22.5%: the warm-up a fifteenth
of sparse training, as V3.2's 1,000 and 15,000 steps) and a long dense share, so the sparse stage falls
mostly in the learning-rate decay, as V3.2 trains sparse at a small fraction of its warm-up's learning rate;
``dense_steps`` alone (no warm-up) is co-training (``recipe: cotrain``: 80% dense, then sparse), ckv's
alternative, which no source describes as DeepSeek's; ``recipe: sparse`` trains sparse from step 0.

Memory (``indexer_loss``): the KL runs in query chunks sized from ``ckv.attention.indexer.WORKING_BYTES`` by
``kl_working_bytes``, each chunk under activation checkpointing, so neither its forward nor its backward holds a
``(B, T, heads, entries)`` tensor. The sparse stage needs only the selected entries: the main logits of the
``K`` selected entries per query (``(B, chunk, H, K)``, their keys gathered) and the indexer's scores recomputed
for them from the index queries and the gathered index keys (``(B, chunk, K, head_dim)``); the dense stage the
``(B, chunk, heads, visible entries)`` logits of one chunk at a time.

Recall (logged), on a sample: for each sampled query whose selection binds (more visible entries than
``topk``), the fraction of the main attention's mass on its ``topk`` heaviest visible entries that lies on entries
the indexer selected; the mass is the dense joint softmax's (in sparse training its log-sum-exp is extended by the
unselected visible entries), so a perfect indexer scores 1 and one that picks at random ``topk / visible`` on
average. The exact recall needs that dense softmax over every visible entry of every query, so it is measured on
at most ``RECALL_QUERIES`` (256) binding query positions per layer and forward, every sequence of the batch at each
(``recall_queries``: all binding positions when there are at most 256, else 256 evenly spaced from the first
binding position to the last; deterministic), and averaged over them.

Like ``ckv.train.gate_entropy`` the model carries nothing for this: forward hooks on every ``LightningIndexer``
(reading its index queries, keys and selection, and returning no selection during the dense stage) and on every
layer's ``attend`` (reading its queries, entries and log-sum-exp). They act only while their module trains with
gradients enabled (validation, evaluation and decoding are untouched), and terms are kept only between ``start``
and ``finish`` of one micro-step (the forward that activation checkpointing replays in backward recomputes the
loss, for its saved tensors, and drops it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckv.attention import AttendCall, CompressedAttention, compressed_layers
from ckv.attention.indexer import IndexQueries, entry_logits, index_scores, kl_working_bytes, query_chunk, top_k
from ckv.config import check_choice, check_float, check_int
from ckv.geometry import compressed_mask, visible_entries

# trainer.indexer.recipe -> (dense training, indexer warm-up) in % of trainer.max_steps; then sparse training. Which
# parts are DeepSeek's (DeepSeek-V3.2-Exp technical report, "Continued Pre-Training"; maxtext's and Megatron-LM's
# DSA code) and which are ckv's: docs/selection.md, "Recipe, sourced". In every recipe the stages' losses, what each
# stage freezes and the detached indexer input are DeepSeek-V3.2's; the learning rate is ckv's (one schedule for
# every stage, where V3.2 gives the warm-up 1e-3 and sparse training 7.3e-6).
RECIPES = {
    # DeepSeek-V3.2's ORDER; ckv's SHARES: dense training stands in for V3.2's trained checkpoint (the indexer
    # co-trains in it), and warm-up = sparse in steps, where V3.2 runs 1,000 warm-up steps before 15,000 sparse ones
    "three_stage": (60, 20),
    # DeepSeek-V3.2's order AND its warm-up:sparse proportion, 1.5:22.5 = 1,000:15,000 steps; ckv's: the long
    # dense share (the module docstring; docs/selection.md, "After the second run: the sparse arm's recipe")
    "v32": (76, 1.5),
    "cotrain": (80, 0),  # ckv's: dense training with the indexer fitted meanwhile, then sparse; no warm-up
    "sparse": (0, 0),  # ckv's: sparse training from step 0
}


@dataclass
class IndexerTrainingConfig:
    """``trainer.indexer``: the lightning indexer's loss ``weight`` (> 0 wherever the model has an indexer: at 0
    the indexer would never train) and its dense stages before sparse training, in this order: ``dense_steps``
    (the whole model trains, attending every visible entry), then ``warmup_steps`` (only the indexer trains; the
    module docstring). ``recipe`` (``RECIPES``) gives each stage left ``None`` its share of ``trainer.max_steps``
    (floored); ``resolved`` turns them into steps. Used only by models with ``attention.selection``."""

    weight: float = 1.0
    recipe: str = "three_stage"
    dense_steps: Optional[int] = None
    warmup_steps: Optional[int] = None

    def __post_init__(self) -> None:
        check_float("trainer.indexer.weight", self.weight, 0)
        check_choice("trainer.indexer.recipe", self.recipe, tuple(RECIPES))
        for name in ("dense_steps", "warmup_steps"):
            if getattr(self, name) is not None:
                check_int(f"trainer.indexer.{name}", getattr(self, name), 0)

    def resolved(self, max_steps: int, has_indexer: bool) -> IndexerTrainingConfig:
        """The stages in steps: a stage left ``None`` takes the recipe's share of ``max_steps`` with a lightning
        indexer to train and 0 without one."""
        shares = RECIPES[self.recipe] if has_indexer else (0, 0)
        dense, warmup = (
            int(max_steps * share) // 100 if steps is None else steps  # shares may be fractional: v32's 1.5
            for steps, share in zip((self.dense_steps, self.warmup_steps), shares)
        )
        return IndexerTrainingConfig(self.weight, self.recipe, dense, warmup)

    @property
    def dense_stage(self) -> int:
        """The optimizer steps before sparse training (dense training, then the warm-up)."""
        if self.dense_steps is None or self.warmup_steps is None:
            raise ValueError("trainer.indexer's stages are not resolved: call resolved(max_steps, has_indexer)")
        return self.warmup_steps + self.dense_steps


RECALL_QUERIES = 256  # query positions per layer and forward whose recall is measured (``recall_queries``)


def _listed(selected: torch.Tensor, n_entries: int) -> torch.Tensor:
    """(B, Tq, E) bool: entry ``s`` is listed in row ``[b, t]`` of ``selected`` (-1: an empty slot). Unchecked
    (the layer's attention already checked it), so no host sync."""
    B, T, _ = selected.shape
    listed = torch.zeros(B, T, n_entries + 1, dtype=torch.bool, device=selected.device)  # column E: empty slots
    listed.scatter_(-1, torch.where(selected < 0, n_entries, selected), True)
    return listed[..., :n_entries]


def _kl_chunk(
    queries: IndexQueries,
    keys: torch.Tensor,
    q: torch.Tensor,
    kc: torch.Tensor,
    lse: torch.Tensor,
    selected: Optional[torch.Tensor],
    q_start: int,
    stride: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL summed over one chunk of queries (those with a target) and their number, both 0-d. ``queries`` and
    q (B, c, H, D), lse (B, c, H), ``selected`` (B, c, K) are the chunk's rows (grid positions ``q_start ..``),
    keys (B, E, Di) and kc (B, E, KV, D) every entry; ``selected`` None: the dense stage, the KL over every
    visible entry; else over the selected ones, gathered: (B, c, K, KV, D) entries and (B, c, K, Di) index keys."""
    B, T = q.shape[:2]
    with torch.no_grad():
        if selected is None:
            n = min(kc.shape[1], visible_entries(q_start + T - 1, stride))  # the entries visible to the chunk
            attended = compressed_mask(torch.arange(q_start, q_start + T, device=q.device), n, stride)[None]
            logits = entry_logits(q, kc[:, :n])  # (B, c, H, n)
        else:
            attended = selected >= 0  # (B, c, K): top_k lists visible entries only
            at = (torch.arange(B, device=q.device)[:, None, None], selected.clamp_min(0))
            logits = entry_logits(q, kc[at])  # (B, c, H, K)
        mass = torch.exp(logits - lse.float()[..., None]).masked_fill(~attended[:, :, None], 0.0).sum(2)
        total = mass.sum(-1, keepdim=True)
        rows = attended.any(-1) & (total[..., 0] > 0)  # (B, c): queries with a target
        target = mass / total.clamp_min(1e-30)
    scores = index_scores(queries, keys[:, :n] if selected is None else keys[at])  # (B, c, n or K)
    # rows without a target get finite scores (0): a log-softmax over nothing would put NaN into the gradient
    masked = scores.masked_fill(~attended, float("-inf")).masked_fill(~rows[..., None], 0.0)
    log_q = torch.log_softmax(masked, dim=-1).masked_fill(~attended, 0.0)
    kl = (torch.xlogy(target, target) - target * log_q).sum(-1)  # (B, c)
    return torch.where(rows, kl, 0.0).sum(), rows.sum()


def indexer_loss(
    q: torch.Tensor,
    kc: torch.Tensor,
    lse: torch.Tensor,
    queries: IndexQueries,
    keys: torch.Tensor,
    selected: Optional[torch.Tensor],
    q_start: int,
    stride: int,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """One layer's KL term (module docstring), 0-d fp32: the mean over queries with a non-empty set (0 when none).

    q (B, Tq, H, D), kc (B, E, KV, D), lse (B, Tq, H): the joint softmax's queries, entries and log-sum-exp
    (detached here); ``queries`` (B, Tq, Hi, Di) and keys (B, E, Di): the indexer's (the only inputs with a
    gradient), queries at grid positions ``q_start ..``; ``selected`` (B, Tq, K): the entries the layer attended
    (the sparse stage), or None: every visible entry (the dense stage). In query chunks (``chunk``, default from
    ``WORKING_BYTES`` by ``kl_working_bytes``), each under activation checkpointing: backward recomputes a
    chunk's logits instead of keeping them."""
    q, kc, lse = q.detach(), kc.detach(), lse.detach()
    B, T, H, D = q.shape
    KV, Hi, Di = kc.shape[2], queries.q.shape[2], queries.q.shape[3]
    if selected is None:
        per_query = kl_working_bytes(B, 1, H, Hi, kc.shape[1])
    else:
        per_query = kl_working_bytes(B, 1, H, Hi, selected.shape[-1], gathered=KV * D + 2 * Di)
    c = query_chunk(per_query, T, chunk)
    total, rows = torch.zeros((), device=q.device), torch.zeros((), dtype=torch.long, device=q.device)
    for t0 in range(0, T, c):
        t1 = min(T, t0 + c)
        part = None if selected is None else selected[:, t0:t1]
        kl, n = checkpoint(
            _kl_chunk,
            queries.span(t0, t1),
            keys,
            q[:, t0:t1],
            kc,
            lse[:, t0:t1],
            part,
            q_start + t0,
            stride,
            use_reentrant=False,
        )
        total, rows = total + kl, rows + n
    return total / rows.clamp_min(1)


def recall_queries(n_queries: int, n_entries: int, q_start: int, stride: int, topk: int, sample: int) -> torch.Tensor:
    """(n,) int64: the queries (of ``n_queries`` at grid positions ``q_start ..`` over ``n_entries`` entries) whose
    recall is measured: those whose selection binds (more visible entries than ``topk``), all of them when at most
    ``sample``, else ``sample`` of them evenly spaced from the first to the last (deterministic)."""
    visible = torch.clamp(visible_entries(torch.arange(q_start, q_start + n_queries), stride), max=n_entries)
    binding = torch.nonzero(visible > topk)[:, 0]
    if len(binding) <= sample:
        return binding
    return binding[torch.linspace(0, len(binding) - 1, sample).round().long()]


@torch.no_grad()
def indexer_recall(
    q: torch.Tensor,
    kc: torch.Tensor,
    lse: torch.Tensor,
    selected: torch.Tensor,
    q_start: int,
    stride: int,
    topk: int,
    dense: bool,
    sample: int = RECALL_QUERIES,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """One layer's recall (module docstring), 0-d fp32: the mean over the batch and the ``recall_queries`` sample
    (NaN when no selection binds). q (B, Tq, H, D), kc (B, E, KV, D), lse (B, Tq, H) as ``indexer_loss``;
    ``selected`` (B, Tq, K) the indexer's top-k; ``dense``: ``lse`` covers every visible entry (the dense stage),
    else only the selected ones (it is extended by the others). The sample's rows go ``chunk`` at a time (default
    from ``WORKING_BYTES``: ``kl_working_bytes`` with twice the heads for the extended log-sum-exp)."""
    B, T, H, _ = q.shape
    E = kc.shape[1]
    picked = recall_queries(T, E, q_start, stride, topk, sample)  # on the host: no sync for the chunks' sizes
    c = query_chunk(kl_working_bytes(B, 1, 2 * H, 0, E), len(picked), chunk)
    caught = []
    for i0 in range(0, len(picked), c):
        n = min(E, visible_entries(q_start + int(picked[i0 : i0 + c][-1]), stride))  # rows ascend: the last sees most
        rows = picked[i0 : i0 + c].to(q.device)
        visible = compressed_mask(q_start + rows, n, stride)  # (r, n)
        chosen = _listed(selected[:, rows], n) & visible  # (B, r, n)
        logits = entry_logits(q[:, rows], kc[:, :n])  # (B, r, H, n)
        full_lse = lse[:, rows].float()  # (B, r, H)
        if not dense:  # extend the sparse softmax's log-sum-exp by the visible entries it left out
            extra = logits.masked_fill(~(visible & ~chosen)[:, :, None], float("-inf"))
            full_lse = torch.logsumexp(torch.cat([full_lse[..., None], extra], dim=-1), dim=-1)
        p = torch.exp(logits - full_lse[..., None]).masked_fill(~visible[:, None], 0.0).sum(2)  # (B, r, n)
        heaviest = _listed(top_k(p.masked_fill(~visible, float("-inf")), topk), n)
        caught.append((p * (heaviest & chosen)).sum(-1) / (p * heaviest).sum(-1).clamp_min(1e-30))  # (B, r)
    if not caught:
        return torch.full((), float("nan"), device=q.device)
    return torch.cat(caught, dim=1).mean()


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
        # layer id -> the indexer's queries, keys and selection
        self._pending: dict[int, tuple[IndexQueries, torch.Tensor, torch.Tensor]] = {}
        self._device = next(model.parameters()).device
        layers = [m for m in compressed_layers(model) if m.indexer is not None]
        if not layers:
            raise ValueError("indexer training found no lightning indexer (attention.selection) in the model")
        self._handles = []
        for layer in layers:
            self._handles.append(layer.indexer.register_forward_hook(partial(self._on_indexer, layer)))
            self._handles.append(layer.attend.register_forward_hook(partial(self._on_attend, layer), with_kwargs=True))

    def _on_indexer(self, layer: CompressedAttention, module: nn.Module, args: Any, output: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return None
        self._pending[id(layer)] = (output[0], args[2], output[1])
        return (output[0], None) if self.dense else None  # None: keep the indexer's selection

    def _on_attend(
        self, layer: CompressedAttention, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any
    ) -> None:
        record = self._pending.pop(id(layer), None)
        if record is None:  # not training
            return
        queries, keys, selected = record
        call, lse = AttendCall.decode(args, kwargs), output[1]
        q, kc, q_start, stride = call.q, call.kc, call.q_start, call.stride
        # a checkpointed layer's replay in backward must compute the same loss (its saved tensors), then drops it
        loss = indexer_loss(q, kc, lse, queries, keys, None if self.dense else selected, q_start, stride)
        if self._open:
            recall = indexer_recall(q, kc, lse, selected, q_start, stride, layer.indexer.topk, self.dense)
            self._terms.append((loss, recall))

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
        """Whether 0-based optimizer step ``step`` belongs to the warm-up (only the indexer trains), which follows
        the ``dense_steps`` of dense training."""
        return self.cfg.dense_steps <= step < self.cfg.dense_stage

    def attends_densely(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` belongs to the dense stage (warm-up or dense training)."""
        return step < self.cfg.dense_stage

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every lightning indexer of ``model`` (the only ones the dense warm-up trains)."""
    return [p for m in compressed_layers(model) if m.indexer is not None for p in m.indexer.parameters()]


def has_indexer(model: nn.Module) -> bool:
    """Whether ``model`` has a compressed layer with a lightning indexer."""
    return any(m.indexer is not None for m in compressed_layers(model))
