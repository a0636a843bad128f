"""The fast, memory-bounded torch path of compressed joint attention (docs/attention.md, "implementations").

Same semantics as ``reference.joint_attention_reference`` (the oracle), computed by blocks of ``block`` queries:
a block scores only the entry prefix visible to its last query (grown by about ``block / stride`` per block; with
a top-k ``selected`` only each query's listed entries, gathered) and its local band as a slice of the exact keys
(``block + local_span - 1`` keys, no per-query copy), in one joint softmax with the sink logit. The G query heads
of a KV head share one matmul. The backward is a custom ``torch.autograd.Function`` that saves only the inputs,
the output, the log-sum-exps (with and without the sink) and, without a selection, each block's small mask
(blk x (band + partly visible entries) bools), and recomputes each block's probabilities
(flash-attention style, ``dS = P * (dP - rowsum(dO * O))``), so working memory is O(block * (entries + band)),
never O(T * entries).
The log-sum-exp is returned without a gradient (every consumer in ckv detaches it: the indexer's loss, the
oracle's selection). Computes in fp32 like the reference; returns the output in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ckv.attention.reference import check_selected
from ckv.geometry import (
    LocalWindow,
    compressed_mask,
    earliest_local_key,
    local_mask,
    local_span,
    local_start,
    visible_entries,
)

# working memory per query block that ``choose_block`` aims at (read at each call: a user may set it, or pass
# ``block`` to ``joint_attention_blocked``)
DEFAULT_BUDGET_BYTES = 64 * 2**20
MAX_BLOCK = 64  # the largest block ``choose_block`` picks: a block scores block + local_span - 1 band keys
MASKED = torch.finfo(torch.float32).min  # a masked score (the reference's): exp(MASKED - max) is 0 in a seen row


def working_bytes(
    block: int,
    n_entries: int,
    local_span: int,
    heads: int,
    head_dim: int,
    topk: Optional[int] = None,
    batch: int = 1,
    kv_heads: int = 1,
) -> int:
    """Peak working memory (bytes) of one query block of ``joint_attention_blocked``'s backward, the larger pass:
    three fp32 (batch, heads, block, columns) score-sized tensors (probabilities, dP, dS) and the block's bool mask,
    where columns = the entries scored (``n_entries``, or ``topk`` per query with a selection) + the band's
    ``block + local_span - 1`` keys + the sink; plus the scored keys and values with their gradients
    (fp32; with a selection gathered per query: (batch, block, topk, kv_heads, head_dim) each) and the block's
    queries, outputs and output gradients. All arguments are plain ints."""
    band = block + local_span - 1 if local_span > 0 else 0
    scored = n_entries if topk is None else min(topk, n_entries)
    columns = scored + band + 1
    scores = batch * heads * block * columns * (3 * 4 + 1)
    keys = batch * kv_heads * head_dim * 4 * (band + (n_entries if topk is None else block * scored))
    rows = 4 * batch * heads * block * head_dim * 4  # q, out, dO, dq
    return scores + 4 * keys + rows


def choose_block(
    n_queries: int,
    n_entries: int,
    local_span: int,
    heads: int,
    head_dim: int,
    topk: Optional[int] = None,
    batch: int = 1,
    kv_heads: int = 1,
    budget: Optional[int] = None,
) -> int:
    """The largest power-of-two query block up to ``MAX_BLOCK`` (and no larger than ``n_queries`` needs) whose
    ``working_bytes`` fit ``budget`` (None: ``DEFAULT_BUDGET_BYTES``); 1 when none does."""
    budget = DEFAULT_BUDGET_BYTES if budget is None else budget
    block = 1
    while block < min(n_queries, MAX_BLOCK) and (
        working_bytes(2 * block, n_entries, local_span, heads, head_dim, topk, batch, kv_heads) <= budget
    ):
        block *= 2
    return block


@dataclass(frozen=True)
class _Plan:
    """The integers of one call: positions, sizes and the rules' parameters (all from ``ckv.geometry``)."""

    stride: int
    local_window: LocalWindow
    q_start: int
    origin: int
    scale: float
    span: int  # local_span: the band's width
    k_start: int  # position of exact key 0
    n_entries: int
    block: int

    def blocks(self, Tq: int) -> list[tuple[int, int]]:
        return [(i, min(i + self.block, Tq)) for i in range(0, Tq, self.block)]

    def visible(self, i1: int) -> int:
        """Entries visible to the last query of a block ending (exclusive) at query index ``i1``."""
        return min(visible_entries(self.q_start + i1 - 1, self.stride), self.n_entries)

    def band(self, i0: int, i1: int) -> tuple[int, int]:
        """Exact-key indices ``c0 .. c1-1`` that some query of the block keeps (empty when c0 >= c1)."""
        if self.span == 0:
            return 0, 0
        first = max(local_start(self.q_start + i0, self.local_window, self.stride), self.origin, self.k_start)
        return first - self.k_start, i1 + self.q_start - self.k_start


@dataclass
class _Block:
    """One query block's scored keys and values, its mask and its positions (rows: its queries x G heads)."""

    i0: int
    i1: int
    n: int  # dense: the entry prefix scored; with a selection: K, the listed entries per query
    c0: int
    c1: int
    full: int  # columns 0 .. full-1 are visible to every query of the block (dense: entries its first query sees)
    mask: torch.Tensor  # (1|B, 1, blk, 1, n + nb - full) bool: the visibility of the other columns
    sel: Optional[torch.Tensor]  # (B, blk, K) entry indices, -1 clamped to 0 (masked), or None


def _block(plan: _Plan, i0: int, i1: int, selected: Optional[torch.Tensor], device: torch.device) -> _Block:
    """The block of queries ``i0 .. i1-1``: which entries and band keys it scores, and the mask over them."""
    q_pos = torch.arange(plan.q_start + i0, plan.q_start + i1, device=device)
    c0, c1 = plan.band(i0, i1)
    c1 = max(c0, c1)
    k_pos = torch.arange(plan.k_start + c0, plan.k_start + c1, device=device)
    mask_l = local_mask(q_pos, k_pos, plan.local_window, plan.stride, plan.origin)  # (blk, nb)
    if selected is None:
        n = plan.visible(i1)
        full = min(visible_entries(plan.q_start + i0, plan.stride), n)
        mask = torch.cat([compressed_mask(q_pos, n, plan.stride, full), mask_l], dim=-1)[None]  # (1, blk, cols)
        sel = None
    else:
        rows = selected[:, i0:i1]  # (B, blk, K)
        n, full = rows.shape[-1], 0
        visible = visible_entries(q_pos, plan.stride)[None, :, None]  # (1, blk, 1)
        listed = (rows >= 0) & (rows < visible)  # visible and listed; -1 is an empty slot
        mask = torch.cat([listed, mask_l.expand(rows.shape[0], -1, -1)], dim=-1)  # (B, blk, K + nb)
        sel = rows.clamp_min(0).long()
    return _Block(i0, i1, n, c0, c1, full, mask[:, None, :, None, :], sel)


class _Inputs:
    """The call's tensors in fp32, laid out for the block loop: queries (B, KV, Tq, G, D), entries and exact
    keys/values (B, KV, E|Tk, D), sinks (1, KV, 1, G) or None. ``vc`` / ``v`` None: tied to ``kc`` / ``k``.
    The queries are multiplied by ``scale`` once (so the scores need no pass of their own)."""

    def __init__(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: Optional[torch.Tensor],
        k: torch.Tensor,
        v: Optional[torch.Tensor],
        sinks: Optional[torch.Tensor],
        scale: float,
    ) -> None:
        B, Tq, H, D = q.shape
        KV = k.shape[2]
        self.G = H // KV
        self.q = (q.float() * scale).reshape(B, Tq, KV, self.G, D).permute(0, 2, 1, 3, 4)  # (B, KV, Tq, G, D)
        self.kc_e = kc.float()  # (B, E, KV, D): gathered by a selection
        self.vc_e = self.kc_e if vc is None else vc.float()
        self.kc, self.vc = (x.permute(0, 2, 1, 3) for x in (self.kc_e, self.vc_e))  # (B, KV, E, D)
        self.k = k.float().permute(0, 2, 1, 3)  # (B, KV, Tk, D)
        self.v = self.k if v is None else v.float().permute(0, 2, 1, 3)
        self.sinks = None if sinks is None else sinks.float().view(1, KV, 1, self.G)
        self.tied = vc is None and v is None  # values are the keys: a dense block's columns are concatenated once

    def keys(self, b: _Block, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's scored entries and band of ``which`` ("k" or "v"): entries (B, KV, n, D) dense or
        (B, KV, blk, K, D) gathered, band (B, KV, nb, D)."""
        entries, exact = (self.kc, self.k) if which == "k" else (self.vc, self.v)
        band = exact[:, :, b.c0 : b.c1]
        if b.sel is None:
            return entries[:, :, : b.n], band
        rows = self.kc_e if which == "k" else self.vc_e
        gathered = rows[torch.arange(rows.shape[0], device=b.sel.device)[:, None, None], b.sel]  # (B, blk, K, KV, D)
        return gathered.permute(0, 3, 1, 2, 4), band

    def columns(self, b: _Block) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense block's scored keys and values, entries then band, (B, KV, n + nb, D) each (one tensor twice
        with tied K = V)."""
        kcat = torch.cat(self.keys(b, "k"), dim=2)
        return kcat, kcat if self.tied else torch.cat(self.keys(b, "v"), dim=2)

    def scores(self, b: _Block, kcat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, KV, blk, G, n + nb) masked scores (``MASKED`` where masked); ``kcat``: a dense block's ``columns``
        keys."""
        qb = self.q[:, :, b.i0 : b.i1]  # (B, KV, blk, G, D)
        B, KV, blk, G, D = qb.shape
        if b.sel is None:
            s = qb.reshape(B, KV, blk * G, D) @ kcat.transpose(-1, -2)
            s = s.view(B, KV, blk, G, -1)
        else:
            ke, kb = self.keys(b, "k")
            s_e = qb @ ke.transpose(-1, -2)  # (B, KV, blk, G, K)
            s_b = (qb.reshape(B, KV, blk * G, D) @ kb.transpose(-1, -2)).view(B, KV, blk, G, -1)
            s = torch.cat([s_e, s_b], dim=-1)
        s[..., b.full :].masked_fill_(~b.mask, MASKED)
        return s

    def apply(self, b: _Block, p: torch.Tensor, vcat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Probabilities p (B, KV, blk, G, n + nb) times the block's values: (B, KV, blk, G, D); ``vcat``: a dense
        block's ``columns`` values."""
        B, KV, blk, G, _ = p.shape
        if b.sel is None:
            o = p.reshape(B, KV, blk * G, -1) @ vcat
            return o.view(B, KV, blk, G, -1)
        ve, vb = self.keys(b, "v")
        o = p[..., : b.n] @ ve  # (B, KV, blk, G, D)
        return o + (p[..., b.n :].reshape(B, KV, blk * G, -1) @ vb).view(B, KV, blk, G, -1)


def _softmax(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's probabilities over its columns, the sink left out (``torch.softmax``: one fused pass; uniform in
    a row that sees nothing, which ``_share`` weighs 0), and their log-sum-exp (B, KV, blk, G) (-inf in such a row):
    ``max(s) - log(max(p))``. No data-dependent branch (``torch.compile`` traces it whole)."""
    if not s.shape[-1]:
        return s, s.new_full(s.shape[:-1], float("-inf"))
    m = s.amax(dim=-1)
    p = torch.softmax(s, dim=-1)
    return p, torch.where(m == MASKED, float("-inf"), m - p.amax(dim=-1).log())


def _share(columns: torch.Tensor, sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """From the columns' log-sum-exp (B, KV, blk, G): the joint log-sum-exp with the sink's logit, and the weight
    of each row's ``_softmax`` probabilities in the joint softmax, ``exp(columns - lse)``: 1 without a sink, the
    columns' share of the probability with one, 0 in a row that sees no column."""
    lse = columns if sink is None else torch.logaddexp(columns, sink.expand_as(columns))
    return lse, torch.where(columns == float("-inf"), 0.0, torch.exp(columns - lse))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, KV, blk, G, X) -> (B, KV, blk * G, X): the G query heads of a KV head folded into the matmul's rows."""
    B, KV, blk, G, X = x.shape
    return x.reshape(B, KV, blk * G, X)


class _JointAttention(torch.autograd.Function):
    """Forward by query blocks; backward recomputes each block's probabilities (``torch.softmax`` of its scores,
    times the columns' share of the probability beside the sink, from the saved log-sum-exps)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: Optional[torch.Tensor],
        k: torch.Tensor,
        v: Optional[torch.Tensor],
        sinks: Optional[torch.Tensor],
        selected: Optional[torch.Tensor],
        plan: _Plan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, Tq, H, D = q.shape
        x = _Inputs(q, kc, vc, k, v, sinks, plan.scale)
        KV, G = x.q.shape[1], x.G
        out = q.new_empty(B, KV, Tq, G, D, dtype=torch.float32)
        lse = q.new_empty(B, KV, Tq, G, dtype=torch.float32)
        columns = q.new_empty(B, KV, Tq, G, dtype=torch.float32)  # the log-sum-exp without the sink
        # a dense block's mask is small (blk x (band + partly visible entries)): the backward reuses them; a
        # selection's blocks (masks and indices O(blk * K)) are built one at a time, here and in the backward
        blocks = []
        for i0, i1 in plan.blocks(Tq):
            b = _block(plan, i0, i1, selected, q.device)
            if selected is None:
                blocks.append(b)
            kcat, vcat = x.columns(b) if b.sel is None else (None, None)
            p, columns[:, :, i0:i1] = _softmax(x.scores(b, kcat))
            lse[:, :, i0:i1], share = _share(columns[:, :, i0:i1], x.sinks)
            out[:, :, i0:i1] = x.apply(b, p, vcat).mul_(share[..., None])
        out = out.permute(0, 2, 1, 3, 4).reshape(B, Tq, H, D)  # (B, Tq, H, D) fp32
        lse = lse.permute(0, 2, 1, 3).reshape(B, Tq, H)
        ctx.save_for_backward(q, kc, vc, k, v, sinks, selected, out, lse, columns)
        ctx.plan, ctx.blocks = plan, blocks
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, _: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        q, kc, vc, k, v, sinks, selected, out, lse, columns = ctx.saved_tensors
        plan: _Plan = ctx.plan
        B, Tq, H, D = q.shape
        x = _Inputs(q, kc, vc, k, v, sinks, plan.scale)  # scaled queries: dK = dS^T (scale q), dq = scale dS K
        KV, G, E = x.q.shape[1], x.G, kc.shape[1]
        to_blocks = lambda t: t.float().reshape(B, Tq, KV, G, -1).permute(0, 2, 1, 3, 4)  # noqa: E731
        d_out, out = to_blocks(d_out), to_blocks(out)  # (B, KV, Tq, G, D)
        lse = to_blocks(lse)[..., 0]  # (B, KV, Tq, G)
        share = _share(columns, x.sinks)[1]  # (B, KV, Tq, G): each row's weight of its softmax over the columns
        dq = torch.zeros_like(x.q)  # (B, KV, Tq, G, D)
        dkc, dvc = torch.zeros_like(x.kc_e), torch.zeros_like(x.kc_e)  # (B, E, KV, D)
        dk, dv = torch.zeros_like(x.k), torch.zeros_like(x.v)  # (B, KV, Tk, D)
        dsinks = None if sinks is None else torch.zeros_like(x.sinks)
        blocks = (
            ctx.blocks if selected is None else (_block(plan, i0, i1, selected, q.device) for i0, i1 in plan.blocks(Tq))
        )
        for b in blocks:
            i0, i1 = b.i0, b.i1
            qb, do = x.q[:, :, i0:i1], d_out[:, :, i0:i1]  # (B, KV, blk, G, D)
            delta = (do * out[:, :, i0:i1]).sum(-1)  # (B, KV, blk, G)
            if dsinks is not None:  # the sink's column: p_sink * (0 - delta)
                dsinks -= (torch.exp(x.sinks - lse[:, :, i0:i1]) * delta).sum(dim=(0, 2), keepdim=True)
            # the columns' P is share * p: dS = P (dP - delta) = p ((share dO) V^T - share delta), dV = p^T (share dO)
            do = do * share[:, :, i0:i1, :, None]
            delta = delta * share[:, :, i0:i1]
            n = b.n
            if b.sel is None:
                kcat, vcat = x.columns(b)  # (B, KV, n + nb, D)
                s = x.scores(b, kcat)  # (B, KV, blk, G, n + nb)
                p = torch.softmax(s, dim=-1) if s.shape[-1] else s
                ds = (_rows(do) @ vcat.transpose(-1, -2)).sub_(_rows(delta[..., None])).mul_(_rows(p))  # (B, KV, r, C)
                dq[:, :, i0:i1] = (ds @ kcat).view_as(qb)
                dk_cat = ds.transpose(-1, -2) @ _rows(qb)  # (B, KV, n + nb, D)
                dv_cat = _rows(p).transpose(-1, -2) @ _rows(do)
                dkc[:, :n] += dk_cat[:, :, :n].transpose(1, 2)
                dvc[:, :n] += dv_cat[:, :, :n].transpose(1, 2)
                dk[:, :, b.c0 : b.c1] += dk_cat[:, :, n:]
                dv[:, :, b.c0 : b.c1] += dv_cat[:, :, n:]
                continue
            s = x.scores(b)  # (B, KV, blk, G, K + nb)
            p = torch.softmax(s, dim=-1) if s.shape[-1] else s
            ke, kb = x.keys(b, "k")
            ve, vb = x.keys(b, "v")
            pe, pb = p[..., :n], _rows(p[..., n:])  # (B, KV, blk, G, K), (B, KV, rows, nb)
            ds_e = (do @ ve.transpose(-1, -2)).sub_(delta[..., None]).mul_(pe)
            ds_b = (_rows(do) @ vb.transpose(-1, -2)).sub_(_rows(delta[..., None])).mul_(pb)
            dq[:, :, i0:i1] = ds_e @ ke + (ds_b @ kb).view_as(qb)
            dk[:, :, b.c0 : b.c1] += ds_b.transpose(-1, -2) @ _rows(qb)
            dv[:, :, b.c0 : b.c1] += pb.transpose(-1, -2) @ _rows(do)
            flat = (b.sel + torch.arange(B, device=q.device)[:, None, None] * E).flatten()  # (B * blk * K,)
            for grad, part in ((dkc, ds_e.transpose(-1, -2) @ qb), (dvc, pe.transpose(-1, -2) @ do)):
                src = part.permute(0, 2, 3, 1, 4).reshape(-1, KV, D)  # (B * blk * K, KV, D)
                grad.view(B * E, KV, D).index_add_(0, flat, src)
        dq = dq.mul_(plan.scale).permute(0, 2, 1, 3, 4).reshape(B, Tq, H, D).to(q.dtype)
        d_sinks = None if dsinks is None else dsinks.reshape(H).to(sinks.dtype)
        if vc is None:  # tied: the values' gradient is the keys'
            dkc, dvc = dkc + dvc, None
        if v is None:
            dk, dv = dk + dv, None
        back = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        dk, dv = (None if g is None else g.permute(0, 2, 1, 3) for g in (dk, dv))  # (B, Tk, KV, D)
        return dq, back(dkc, kc), back(dvc, vc), back(dk, k), back(dv, v), d_sinks, None, None


def joint_attention_blocked(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    local_window: LocalWindow,
    q_start: int = 0,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    origin: int = 0,
    selected: Optional[torch.Tensor] = None,
    block: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.joint_attention_reference`` (see there for shapes and semantics) by blocks of ``block``
    queries (None: ``choose_block`` within ``DEFAULT_BUDGET_BYTES``); returns out (B, Tq, H, D) in q's dtype and
    the log-sum-exp (B, Tq, H) fp32, which carries no gradient. Differentiable in q, kc, vc, k, v and sinks."""
    B, Tq, H, D = q.shape
    E, KV, Tk = kc.shape[1], k.shape[2], k.shape[1]
    if H % KV:
        raise ValueError(f"{H} query heads are not a multiple of {KV} KV heads")
    if block is not None and block < 1:
        raise ValueError(f"block={block} must be >= 1")
    span = local_span(local_window, stride)
    k_start = q_start + Tq - Tk
    earliest = earliest_local_key(q_start, Tq, span, local_window, stride, origin)
    if earliest is not None and earliest < k_start:
        raise ValueError(f"exact keys start at position {k_start}, but a local window reaches further back")
    topk = None
    if selected is not None:
        check_selected(selected, B, Tq, E)
        topk = selected.shape[-1]
    if block is None:
        block = choose_block(Tq, E, span, H, D, topk, B, KV)
    scale = D**-0.5 if scale is None else scale
    plan = _Plan(stride, local_window, q_start, origin, scale, span, k_start, E, block)
    # tied K = V (the same tensor twice) travels once: torch.compile refuses a tensor passed twice to a Function
    return _JointAttention.apply(q, kc, None if vc is kc else vc, k, None if v is k else v, sinks, selected, plan)
