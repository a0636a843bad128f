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

Memory: the scores are computed in query chunks (``chunked_top_k``), each chunk over the entries visible to its
last query, and each chunk's top-k is final (a query's row lies in one chunk), so neither ``(B, T, heads, E)`` nor
``(B, T, E)`` exists at once; a chunk's working memory (``index_working_bytes``) stays within ``WORKING_BYTES``
(a module constant, overridable per call by ``chunk``). The selection is the same for every chunk size.

Its inputs are detached: the selection is hard (no gradient flows through it) and the indexer learns only from its
own training loss (``ckv.train.indexer``), never from the language-model loss, which reaches every other
parameter as in dense attention. ``forward`` returns ``(queries, selected)``: the index queries and head weights
(``IndexQueries``, linear in T; ``index_scores`` turns them and the keys into scores for any range of queries or
any gathered entries) and the selection; the layer attends with whatever selection it returns, so a forward hook
may read the queries (and, from its arguments, the keys) and the selection or replace the selection (None: every
visible entry, the dense warm-up of training; an oracle selection for a study).

Ties are broken toward the lower entry index (the earlier entry): ``top_k`` lists what a stable sort of each row
would (by ``torch.topk`` and a fix of the rows tied at the k-th score, without sorting the row). transformers'
V4 calls ``torch.topk``, whose order among equal scores is unspecified; on CPU it depends on the tensor's shape,
so its chunked prefill can pick other entries than one forward where scores tie (typically at exactly 0 after the
ReLU). A decoding ckv layer scores a query's entries in the same order as a prefill, so it selects the same.

``attention.selection.by: oracle`` replaces the indexer by the main attention's own ranking (``oracle_selection``):
each query keeps the entries on which the layer's dense joint softmax puts the most probability, summed over query
heads, the very target the indexer's loss fits. No module, no parameters; the same ``selected`` tensor, computed
in query chunks the same way (``oracle_scores`` per chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
from torch import nn

from ckv.attention.compressor import Compressor
from ckv.attention.rope import Rotary
from ckv.config import ModelConfig
from ckv.geometry import compressed_mask, visible_entries
from ckv.norm import RMSNorm
from ckv.options.selection import QUANT_BLOCK

# the working memory of one query chunk of index scores, oracle scores or indexer loss (``query_chunk``)
WORKING_BYTES = 128 * 2**20


def index_working_bytes(batch: int, chunk: int, heads: int, entries: int) -> int:
    """Bytes one query chunk of ``chunked_top_k`` holds at most: two fp32 ``(batch, chunk, heads, entries)``
    copies of the per-head dots (for the oracle ``heads`` is the query heads and the copies are the logits and their
    exponential; the indexer weighs its product in place: one), the fp32 scores ``(batch, chunk, entries)`` and, in
    the rows ``top_k`` fixes (tied at the k-th score), a copy with its masks and int32 count (12 bytes more per
    score), and the bool visibility ``(chunk, entries)``."""
    return batch * chunk * entries * (8 * heads + 16) + chunk * entries


def index_peak_bytes(batch: int, chunk: int, heads: int, entries: int) -> int:
    """Bytes one query chunk of the indexer's selection (``LightningIndexer.forward``, without gradients) holds at
    its peak, what the memory estimate counts (``CompressedAccounting.index_bytes``; ``index_working_bytes`` is the
    looser bound its chunk is sized by): the fp32 scores ``(batch, chunk, entries)`` and the larger of
    ``index_scores``'s moment (one fp32 ``(batch, chunk, heads, entries)`` copy of the dots, which it ReLUs and
    weighs in place and keeps referenced while it sums the heads and masks the scores) and ``top_k``'s fix of the
    rows tied at the k-th score (after the dots are freed: a copy with its masks and int32 count, 12 bytes per
    score), plus the bool visibility and its negation ``(chunk, entries)``."""
    return batch * chunk * entries * (4 + max(4 * heads, 12)) + 2 * chunk * entries


def kl_working_bytes(batch: int, chunk: int, heads: int, index_heads: int, entries: int, gathered: int = 0) -> int:
    """Bytes one query chunk of the indexer's KL holds at once, in its forward or its recomputation in backward:
    two fp32 ``(batch, chunk, heads, entries)`` copies of the main attention's logits (the target), five of the
    indexer's ``(batch, chunk, index_heads, entries)`` dots (product, ReLU, weighted copy and two gradients), ten
    fp32 ``(batch, chunk, entries)`` rows (target, scores, masks, log-softmax and their gradients) and ``gathered``
    fp32 elements per (query, entry) copied per query (the sparse stage's selected entries: ``KV * D`` main keys,
    and ``2 * head_dim`` for the index keys and their gradient). ``entries``: the visible entries (dense stage) or
    the top-k (sparse stage)."""
    return 4 * batch * chunk * entries * (2 * heads + 5 * index_heads + 10 + gathered)


def query_chunk(per_query_bytes: int, n_queries: int, chunk: Optional[int] = None) -> int:
    """Queries per chunk: ``chunk`` when given (>= 1), else as many as fit ``WORKING_BYTES`` at
    ``per_query_bytes`` each, at least 1 and at most ``n_queries``."""
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"query chunk={chunk} must be >= 1")
        return chunk
    return max(1, min(n_queries, WORKING_BYTES // max(per_query_bytes, 1)))


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of fp4 (e2m1)


def fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x (..., D) fp32 rounded to ``fmt`` (``QUANT_BLOCK``: ``none``, ``fp8`` e4m3, ``fp4`` e2m1) with one fp32
    scale per block of ``min(block, D)`` consecutive elements of the last dim, ``block amax / format max`` (448 for
    e4m3, 6 for e2m1): each block's largest magnitude maps to the format's largest. fp8 rounds to nearest even
    (torch's cast); fp4 to the nearest magnitude of ``FP4_VALUES``, a tie to the smaller one. Returns fp32."""
    if fmt == "none":
        return x
    D = x.shape[-1]
    block = min(QUANT_BLOCK[fmt], D)
    blocks = x.float().reshape(*x.shape[:-1], D // block, block)
    top = 448.0 if fmt == "fp8" else FP4_VALUES[-1]
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
    y = blocks / scale
    if fmt == "fp8":
        y = y.to(torch.float8_e4m3fn).float()
    else:
        values = torch.tensor(FP4_VALUES, device=x.device)
        y = values[torch.bucketize(y.abs(), (values[1:] + values[:-1]) / 2)] * y.sign()
    return (y * scale).reshape(x.shape)


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(B, Tq, min(k, E)) int64: each row's ``k`` highest-scoring entries of ``scores`` (B, Tq, E) (no NaN), best
    first, ties to the lower index (a stable descending sort's first ``k``); ``-1`` marks a slot whose score is
    ``-inf`` (fewer than ``k`` entries visible).

    Without sorting the row: ``torch.topk`` finds the ``k + 1`` highest scores (its order among equal scores is
    unspecified). Where the ``k``-th and the ``(k+1)``-th differ, the ``k`` highest are the only entries scoring at
    least the ``k``-th; where they are equal and finite (a tie at the threshold ``v``), the row keeps every entry
    above ``v`` and the lowest-indexed entries equal to ``v`` (a cumulative count); where the ``k``-th is ``-inf``
    the row lists every visible entry and the rest are ``-1`` slots. Then the ``k`` picks, listed by index, are
    sorted stably by score, best first. Reads whether any row ties (a host sync on an accelerator, like the
    layer's ``check_selected`` of the selection)."""
    B, T, E = scores.shape
    K = min(k, E)
    if 0 < K < E:
        values, picks = torch.topk(scores, K + 1, dim=-1)  # (B, Tq, K + 1) descending
        picks = picks[..., :K].sort(dim=-1).values  # (B, Tq, K) by index
        threshold = values[..., K - 1 : K]  # (B, Tq, 1) the k-th highest score
        tied = ((values[..., K:] == threshold) & (threshold > float("-inf")))[..., 0]  # (B, Tq)
        if bool(tied.any()):
            rows = scores[tied]  # (n, E)
            v = threshold[tied]  # (n, 1)
            above = rows > v
            equal = rows == v
            keep = above | (equal & (equal.cumsum(-1, dtype=torch.int32) <= K - above.sum(-1, keepdim=True)))  # K a row
            picks[tied] = keep.nonzero()[:, 1].view(-1, K)
    else:
        picks = torch.arange(K, device=scores.device).expand(B, T, K)  # every entry (or none)
    picked = scores.gather(-1, picks)  # (B, Tq, K)
    best = picked.sort(dim=-1, descending=True, stable=True)
    order = picks.gather(-1, best.indices)
    return torch.where(best.values == float("-inf"), torch.full_like(order, -1), order)


def chunked_top_k(
    scores_of: Callable[[int, int, int], torch.Tensor],
    n_queries: int,
    n_entries: int,
    q_start: int,
    stride: int,
    k: int,
    chunk: int,
) -> torch.Tensor:
    """``top_k`` of the scores of ``n_queries`` queries at grid positions ``q_start ..`` over ``n_entries``
    entries, ``chunk`` queries at a time: ``scores_of(t0, t1, n)`` returns the scores (B, t1 - t0, n) of queries
    ``t0 .. t1-1`` over entries ``0 .. n-1`` (``-inf`` where not visible), ``n`` the entries visible to the
    chunk's last query (the others are ``-inf`` for the whole chunk, so leaving them out changes no row). Returns
    (B, Tq, min(k, E)) int64, the same as ``top_k`` of the whole (B, Tq, E) scores."""
    K = min(k, n_entries)
    parts = []
    for t0 in range(0, max(n_queries, 1), chunk):  # no query: one empty chunk, for the (B, 0, K) shape
        t1 = min(n_queries, t0 + chunk)
        n = min(n_entries, visible_entries(q_start + t1 - 1, stride))
        picked = top_k(scores_of(t0, t1, n), k)  # (B, t1 - t0, min(k, n))
        parts.append(nn.functional.pad(picked, (0, K - picked.shape[-1]), value=-1))
    return torch.cat(parts, dim=1)


def entry_logits(q: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
    """(B, Tq, H, E) fp32: ``q_h . k_s / sqrt(D)`` for queries q (B, Tq, H, D) and entries kc (B, E, KV, D) shared
    by every query, or kc (B, Tq, E, KV, D) gathered per query, of a grouped-query layer (head ``h`` reads KV head
    ``h // (H / KV)``): the joint softmax's entry logits."""
    B, T, H, D = q.shape
    KV = kc.shape[-2]
    qg = q.float().reshape(B, T, KV, H // KV, D)
    spec = "btkgd,bekd->btkge" if kc.dim() == 4 else "btkgd,btekd->btkge"
    return torch.einsum(spec, qg, kc.float()).reshape(B, T, H, kc.shape[-3]) * D**-0.5


def oracle_scores(q: torch.Tensor, kc: torch.Tensor, lse: torch.Tensor, q_start: int, stride: int) -> torch.Tensor:
    """(B, Tq, E) fp32, the oracle's scores: for queries q (B, Tq, H, D) at grid positions ``q_start ..``, entries
    kc (B, E, KV, D) and ``lse`` (B, Tq, H), the log-sum-exp of the layer's DENSE joint softmax (every visible
    entry, local window and sinks), the probability mass ``sum_h exp(q_h . k_s / sqrt(D) - lse_h)`` on each visible
    entry, ``-inf`` where not visible."""
    mass = torch.exp(entry_logits(q, kc) - lse.float()[..., None]).sum(2)  # (B, Tq, E)
    visible = compressed_mask(torch.arange(q_start, q_start + q.shape[1], device=q.device), kc.shape[1], stride)
    return mass.masked_fill(~visible, float("-inf"))


@torch.no_grad()
def oracle_selection(
    q: torch.Tensor,
    kc: torch.Tensor,
    lse: torch.Tensor,
    q_start: int,
    stride: int,
    k: int,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """The oracle's selection (``attention.selection.by: oracle``): the ``top_k`` (B, Tq, min(k, E)) of
    ``oracle_scores`` (ties to the lower index), in query chunks (``chunk``, default from ``WORKING_BYTES``).
    Without gradients: the selection is hard."""
    B, T, H, _ = q.shape
    E = kc.shape[1]
    c = query_chunk(index_working_bytes(B, 1, H, E), T, chunk)

    def scores_of(t0: int, t1: int, n: int) -> torch.Tensor:
        return oracle_scores(q[:, t0:t1], kc[:, :n], lse[:, t0:t1], q_start + t0, stride)

    return chunked_top_k(scores_of, T, E, q_start, stride, k, c)


class IndexQueries(NamedTuple):
    """The lightning indexer's per-query inputs to its scores: ``q`` (B, Tq, heads, head_dim) fp32 index queries
    (rotated at their positions) and ``w`` (B, Tq, heads) fp32 head weights (``W x / sqrt(heads)``)."""

    q: torch.Tensor
    w: torch.Tensor

    def span(self, t0: int, t1: int) -> IndexQueries:
        """The queries ``t0 .. t1-1``."""
        return IndexQueries(self.q[:, t0:t1], self.w[:, t0:t1])


def index_scores(
    queries: IndexQueries, keys: torch.Tensor, q_start: Optional[int] = None, stride: Optional[int] = None
) -> torch.Tensor:
    """(B, Tq, E) fp32: ``sum_h w_h relu(q_h . k_s) / sqrt(head_dim)`` of ``queries`` over keys (B, E, head_dim)
    shared by every query, or (B, Tq, E, head_dim) gathered per query. With ``q_start`` and ``stride`` (shared keys
    ``0 .. E-1``, queries at grid positions ``q_start ..``): ``-inf`` where an entry is not visible."""
    q, w = queries
    spec = "bthd,bed->bthe" if keys.dim() == 3 else "bthd,bted->bthe"
    dots = torch.einsum(spec, q, keys.float())  # (B, Tq, Hi, E)
    scale = q.shape[-1] ** -0.5
    if dots.requires_grad:
        weighted = torch.relu(dots) * scale * w[..., None]
    else:  # the same operations in place: no further (B, Tq, Hi, E) copy (the selection's scores)
        weighted = dots.relu_().mul_(scale).mul_(w[..., None])
    scores = weighted.sum(2)  # (B, Tq, E)
    if q_start is None:
        return scores
    visible = compressed_mask(torch.arange(q_start, q_start + q.shape[1], device=q.device), keys.shape[1], stride)
    return scores.masked_fill_(~visible, float("-inf")).add_(0.0)  # + 0.0: -0.0 (a negative weight x 0) -> 0.0


class LightningIndexer(nn.Module):
    """Index queries, head weights and scoring of DeepSeek-V4's lightning indexer; ``compressor`` is its own
    compressor branch (a ``Compressor`` at ``kv_heads=1, head_dim=selection.head_dim``, built by the layer) and
    ``norm`` the pooled keys' RMSNorm (before or after pooling, as the layer's ``compressed_norm``; none without
    ``qk_norm``). ``rotary`` rotates index queries and keys (the layer's theta, side, pairing and YaRN, over the
    indexer's ``SelectionConfig.rotated_dims``). Public surface: ``compressor``, ``topk`` and ``quant`` (both settable:
    ``ckv.analysis.selection`` sweeps them), the methods; the rest is private to ``ckv.attention``."""

    compressor: Compressor
    topk: int
    quant: str

    def __init__(self, config: ModelConfig, compressor: Compressor) -> None:
        super().__init__()
        a, s = config.attention, config.attention.selection
        self.topk, self.heads, self.head_dim, self.quant = s.topk, s.heads, s.head_dim, s.quant
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
        chunk: Optional[int] = None,
    ) -> tuple[IndexQueries, Optional[torch.Tensor]]:
        """x (B, Tq, d) the layer's input and ``latent`` (B, Tq, r) its query latent (both detached by the layer)
        at real ``positions`` (Tq,), grid positions ``q_start ..``; ``keys`` (B, E, head_dim) the indexer's keys of
        entries ``0 .. E-1``. Returns the index queries (``IndexQueries``, with their graph to the indexer's maps)
        and the selection (B, Tq, min(topk, E)) int64: the ``top_k`` of ``index_scores``, computed in query chunks
        (``chunk``, default from ``WORKING_BYTES``) without gradients, from queries and keys ``fake_quant``-ised
        to ``selection.quant`` (the returned queries are not)."""
        B, T, _ = x.shape
        q = self.rotary(self.q_proj(latent).view(B, T, self.heads, self.head_dim), positions)  # (B, T, Hi, Di)
        queries = IndexQueries(q.float(), self.weights_proj(x).float() * self.heads**-0.5)  # w: (B, T, Hi)
        E = keys.shape[1]
        c = query_chunk(index_working_bytes(B, 1, self.heads, E), T, chunk)
        scored = IndexQueries(fake_quant(queries.q.detach(), self.quant), queries.w.detach())
        scored_keys = fake_quant(keys.detach().float(), self.quant)  # (B, E, Di)

        def scores_of(t0: int, t1: int, n: int) -> torch.Tensor:
            return index_scores(scored.span(t0, t1), scored_keys[:, :n], q_start + t0, stride)

        with torch.no_grad():
            selected = chunked_top_k(scores_of, T, E, q_start, stride, self.topk, c)
        return queries, selected
