"""DeepSeek-V4's lightning indexer (``attention.selection``, docs/attention.md "Top-k selection"): it scores every
visible compressed entry for each query and selects the ``topk`` highest, the entries the query then attends to
(``joint_attention(..., selected=...)``) next to its exact local window and sinks.

The indexer has its own compressor branch at ``selection.head_dim`` (one key per entry, pooled over the layer's
windows with the layer's maps, gate and mixing, then its norm and RoPE at the entry's position: the layer builds
and pools it, ``CompressedAttention.index_keys``), index queries mapped from the query latent and rotated at the
query's position, and one weight per index head from the input. The score of entry ``s`` for the query at ``t`` is

    I[t, s] = sum_h w_h(t) * relu(q_h(t) . k_s) / sqrt(head_dim),    w(t) = W x_t / sqrt(heads)

in fp32 (V4's ``DeepseekV4IndexerScorer``), ``-inf`` where ``s`` is not visible to ``t`` (``geometry.compressed_mask``:
``(s+1) S - 1 <= t`` in the layer's grid coordinates).

Its inputs are detached: the selection is hard (no gradient flows through it) and the indexer learns only from its
own training loss (``ckv.train.indexer``), never from the language-model loss, which reaches every other
parameter as in dense attention. ``forward`` returns ``(scores, selected)`` and the layer attends with whatever
selection it returns, so a forward hook may read the scores and the selection or replace the selection (None:
every visible entry, the dense warm-up of training; an oracle selection for a study).

Ties are broken toward the lower entry index (the earlier entry): ``top_k`` sorts each row stably. transformers'
V4 calls ``torch.topk``, whose order among equal scores is unspecified; on CPU it depends on the tensor's shape,
so its chunked prefill can pick other entries than one forward where scores tie (typically at exactly 0 after the
ReLU). A decoding ckv layer scores a query's entries in the same order as a prefill, so it selects the same.

``attention.selection.by: oracle`` replaces the indexer by the main attention's own ranking (``oracle_selection``):
each query keeps the entries on which the layer's dense joint softmax puts the most probability, summed over query
heads, the very target the indexer's loss fits. No module, no parameters; the same ``selected`` tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ckv.attention.rope import Rotary
from ckv.config import ModelConfig
from ckv.geometry import compressed_mask
from ckv.norm import RMSNorm


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(B, Tq, min(k, E)) int64: each row's ``k`` highest-scoring entries of ``scores`` (B, Tq, E), best first,
    ties to the lower index; ``-1`` marks a slot whose score is ``-inf`` (fewer than ``k`` entries visible)."""
    K = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :K]
    picked = scores.gather(-1, order)
    return torch.where(picked == float("-inf"), torch.full_like(order, -1), order)


def entry_logits(q: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
    """(B, Tq, H, E) fp32: ``q_h . k_s / sqrt(D)`` for queries q (B, Tq, H, D) and entries kc (B, E, KV, D) of a
    grouped-query layer (head ``h`` reads KV head ``h // (H / KV)``), the joint softmax's entry logits."""
    B, T, H, D = q.shape
    E, KV = kc.shape[1], kc.shape[2]
    qg = q.float().reshape(B, T, KV, H // KV, D)
    return torch.einsum("btkgd,bekd->btkge", qg, kc.float()).reshape(B, T, H, E) * D**-0.5


@torch.no_grad()
def oracle_selection(
    q: torch.Tensor, kc: torch.Tensor, lse: torch.Tensor, q_start: int, stride: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's selection (``attention.selection.by: oracle``): queries q (B, Tq, H, D) at grid positions
    ``q_start ..``, entries kc (B, E, KV, D) and ``lse`` (B, Tq, H), the log-sum-exp of the layer's DENSE joint
    softmax (every visible entry, local window and sinks). Returns the scores (B, Tq, E) fp32, the probability mass
    ``sum_h exp(q_h . k_s / sqrt(D) - lse_h)`` on each visible entry (``-inf`` where not visible), and their
    ``top_k`` (B, Tq, min(k, E)) (ties to the lower index). Without gradients: the selection is hard."""
    T, E = q.shape[1], kc.shape[1]
    mass = torch.exp(entry_logits(q, kc) - lse.float()[..., None]).sum(2)  # (B, T, E)
    visible = compressed_mask(torch.arange(q_start, q_start + T, device=q.device), E, stride)  # (T, E)
    scores = mass.masked_fill(~visible, float("-inf"))
    return scores, top_k(scores, k)


class LightningIndexer(nn.Module):
    """Index queries, head weights and scoring of DeepSeek-V4's lightning indexer; ``compressor`` is its own
    compressor branch (a ``Compressor`` at ``kv_heads=1, head_dim=selection.head_dim``, built by the layer) and
    ``norm`` the pooled keys' RMSNorm (before or after pooling, as the layer's ``compressed_norm``; none without
    ``qk_norm``). ``rotary`` rotates index queries and keys (the layer's theta, side, pairing and YaRN, over the
    indexer's ``SelectionConfig.rotated_dims``)."""

    def __init__(self, config: ModelConfig, compressor: nn.Module) -> None:
        super().__init__()
        a, s = config.attention, config.attention.selection
        self.topk, self.heads, self.head_dim = s.topk, s.heads, s.head_dim
        self.compressor = compressor
        self.norm = RMSNorm(s.head_dim, config.norm_eps) if a.qk_norm else None
        theta = config.rope_theta if a.rope.theta is None else a.rope.theta
        rotated = s.rotated_dims(a.rope.mode, a.rope.dims)
        self.rotary = Rotary(rotated, theta, side=a.rope.side, pairing=a.rope.pairing, yarn=a.rope.yarn)
        latent = config.d_model if a.query is None else a.query.lora_rank
        self.q_proj = nn.Linear(latent, s.heads * s.head_dim, bias=False)  # index queries from the query latent
        self.weights_proj = nn.Linear(config.d_model, s.heads, bias=False)  # one weight per index head

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Its compressor as the layer's, the query and head-weight maps Normal(0, std), the norm's gain 1."""
        self.compressor.init_weights(std)
        self.q_proj.weight.normal_(0.0, std)
        self.weights_proj.weight.normal_(0.0, std)
        if self.norm is not None:
            self.norm.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        latent: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        q_start: int,
        stride: int,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x (B, Tq, d) the layer's input and ``latent`` (B, Tq, r) its query latent (both detached by the layer)
        at real ``positions`` (Tq,), grid positions ``q_start ..``; ``keys`` (B, E, head_dim) the indexer's keys of
        entries ``0 .. E-1``. Returns the scores (B, Tq, E) fp32 (``-inf`` where not visible) and the selection
        (B, Tq, min(topk, E)) int64 (``top_k``)."""
        B, T, _ = x.shape
        q = self.rotary(self.q_proj(latent).view(B, T, self.heads, self.head_dim), positions)  # (B, T, Hi, Di)
        w = self.weights_proj(x).float() * self.heads**-0.5  # (B, T, Hi)
        dots = torch.einsum("bthd,bed->bthe", q.float(), keys.float())  # (B, T, Hi, E)
        scores = (torch.relu(dots) * self.head_dim**-0.5 * w[..., None]).sum(2)  # (B, T, E)
        q_pos = torch.arange(q_start, q_start + T, device=x.device)
        visible = compressed_mask(q_pos, keys.shape[1], stride)  # (T, E)
        scores = scores.masked_fill(~visible, float("-inf")) + 0.0  # + 0.0: -0.0 (a negative weight x 0) -> 0.0
        return scores, top_k(scores, self.topk)
