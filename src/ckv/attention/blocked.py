"""The fast, memory-bounded torch path of compressed joint attention (docs/attention.md, "implementations").

Same semantics as ``reference.joint_attention_reference`` (the oracle), computed by blocks of ``block`` queries:
a block scores only the entry prefix visible to its last query (grown by about ``block / stride`` per block; with
a top-k ``selected`` only each query's listed entries, gathered) and its local band as a slice of the exact keys
(``block + local_span - 1`` keys, no per-query copy), in one joint softmax with the sink logit. The G query heads
of a KV head share one matmul. The backward is a custom ``torch.autograd.Function`` that saves only the inputs,
the output and the log-sum-exp and recomputes each block's probabilities (flash-attention style,
``dS = P * (dP - rowsum(dO * O))``), so working memory is O(block * (entries + band)), never O(T * entries).
The log-sum-exp is returned without a gradient (every consumer in ckv detaches it: the indexer's loss, the
oracle's selection). Computes in fp32 like the reference; returns the output in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ckv.attention.reference import _earliest_local_key, check_selected
from ckv.geometry import LocalWindow, compressed_mask, local_mask, local_span, local_start, visible_entries

DEFAULT_BUDGET_BYTES = 64 * 2**20  # working memory per query block that ``choose_block`` aims at
MAX_BLOCK = 64  # the largest block ``choose_block`` picks: a block scores block + local_span - 1 band keys


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
    budget: int = DEFAULT_BUDGET_BYTES,
) -> int:
    """The largest power-of-two query block up to ``MAX_BLOCK`` (and no larger than ``n_queries`` needs) whose
    ``working_bytes`` fit ``budget``; 1 when none does."""
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
    mask: torch.Tensor  # (1|B, 1, blk, 1, n + nb) bool
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
        mask = torch.cat([compressed_mask(q_pos, n, plan.stride), mask_l], dim=-1)[None]  # (1, blk, n + nb)
        sel = None
    else:
        rows = selected[:, i0:i1]  # (B, blk, K)
        n = rows.shape[-1]
        visible = visible_entries(q_pos, plan.stride)[None, :, None]  # (1, blk, 1)
        listed = (rows >= 0) & (rows < visible)  # visible and listed; -1 is an empty slot
        mask = torch.cat([listed, mask_l.expand(rows.shape[0], -1, -1)], dim=-1)  # (B, blk, K + nb)
        sel = rows.clamp_min(0).long()
    return _Block(i0, i1, n, c0, c1, mask[:, None, :, None, :], sel)


class _Inputs:
    """The call's tensors in fp32, laid out for the block loop: queries (B, KV, Tq, G, D), entries and exact
    keys/values (B, KV, E|Tk, D), sinks (1, KV, 1, G) or None. ``vc`` / ``v`` None: tied to ``kc`` / ``k``."""

    def __init__(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: Optional[torch.Tensor],
        k: torch.Tensor,
        v: Optional[torch.Tensor],
        sinks: Optional[torch.Tensor],
    ) -> None:
        B, Tq, H, D = q.shape
        KV = k.shape[2]
        self.G = H // KV
        self.q = q.float().reshape(B, Tq, KV, self.G, D).permute(0, 2, 1, 3, 4)  # (B, KV, Tq, G, D)
        self.kc_e = kc.float()  # (B, E, KV, D): gathered by a selection
        self.vc_e = self.kc_e if vc is None else vc.float()
        self.kc, self.vc = (x.permute(0, 2, 1, 3) for x in (self.kc_e, self.vc_e))  # (B, KV, E, D)
        self.k = k.float().permute(0, 2, 1, 3)  # (B, KV, Tk, D)
        self.v = self.k if v is None else v.float().permute(0, 2, 1, 3)
        self.sinks = None if sinks is None else sinks.float().view(1, KV, 1, self.G)

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

    def scores(self, b: _Block, scale: float) -> torch.Tensor:
        """(B, KV, blk, G, n + nb) masked scores (-inf where masked)."""
        qb = self.q[:, :, b.i0 : b.i1]  # (B, KV, blk, G, D)
        B, KV, blk, G, D = qb.shape
        ke, kb = self.keys(b, "k")
        if b.sel is None:
            s = qb.reshape(B, KV, blk * G, D) @ torch.cat([ke, kb], dim=2).transpose(-1, -2)
            s = s.view(B, KV, blk, G, -1)
        else:
            s_e = qb @ ke.transpose(-1, -2)  # (B, KV, blk, G, K)
            s_b = (qb.reshape(B, KV, blk * G, D) @ kb.transpose(-1, -2)).view(B, KV, blk, G, -1)
            s = torch.cat([s_e, s_b], dim=-1)
        return s.mul_(scale).masked_fill_(~b.mask, float("-inf"))

    def apply(self, b: _Block, p: torch.Tensor) -> torch.Tensor:
        """Probabilities p (B, KV, blk, G, n + nb) times the block's values: (B, KV, blk, G, D)."""
        ve, vb = self.keys(b, "v")
        B, KV, blk, G, _ = p.shape
        if b.sel is None:
            o = p.reshape(B, KV, blk * G, -1) @ torch.cat([ve, vb], dim=2)
            return o.view(B, KV, blk, G, -1)
        o = p[..., : b.n] @ ve  # (B, KV, blk, G, D)
        return o + (p[..., b.n :].reshape(B, KV, blk * G, -1) @ vb).view(B, KV, blk, G, -1)


def _softmax(s: torch.Tensor, sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's unnormalised probabilities p = exp(s - m) (0 where masked), their normaliser (B, KV, blk, G)
    (sink included) and the log-sum-exp (-inf where a row sees nothing and there is no sink)."""
    m = s.amax(dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
    if sink is not None:
        m = torch.maximum(m, sink)
    m = m.masked_fill(m == float("-inf"), 0.0)  # a row that sees nothing: p = 0 below
    p = torch.exp(s - m[..., None])
    denom = p.sum(dim=-1)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    lse = torch.where(denom > 0, m + denom.clamp_min(1e-30).log(), float("-inf"))
    return p, denom.clamp_min(1e-30), lse


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, KV, blk, G, X) -> (B, KV, blk * G, X): the G query heads of a KV head folded into the matmul's rows."""
    B, KV, blk, G, X = x.shape
    return x.reshape(B, KV, blk * G, X)


class _JointAttention(torch.autograd.Function):
    """Forward by query blocks; backward recomputes each block's probabilities from the saved log-sum-exp."""

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
        x = _Inputs(q, kc, vc, k, v, sinks)
        KV, G = x.q.shape[1], x.G
        out = q.new_empty(B, KV, Tq, G, D, dtype=torch.float32)
        lse = q.new_empty(B, KV, Tq, G, dtype=torch.float32)
        for i0, i1 in plan.blocks(Tq):
            b = _block(plan, i0, i1, selected, q.device)
            p, denom, lse[:, :, i0:i1] = _softmax(x.scores(b, plan.scale), x.sinks)
            out[:, :, i0:i1] = x.apply(b, p).div_(denom[..., None])
        out = out.permute(0, 2, 1, 3, 4).reshape(B, Tq, H, D)  # (B, Tq, H, D) fp32
        lse = lse.permute(0, 2, 1, 3).reshape(B, Tq, H)
        ctx.save_for_backward(q, kc, vc, k, v, sinks, selected, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, _: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        q, kc, vc, k, v, sinks, selected, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        B, Tq, H, D = q.shape
        x = _Inputs(q, kc, vc, k, v, sinks)
        KV, G, E = x.q.shape[1], x.G, kc.shape[1]
        to_blocks = lambda t: t.float().reshape(B, Tq, KV, G, -1).permute(0, 2, 1, 3, 4)  # noqa: E731
        d_out, out = to_blocks(d_out), to_blocks(out)  # (B, KV, Tq, G, D)
        lse = to_blocks(lse)[..., 0]  # (B, KV, Tq, G)
        lse = lse.masked_fill(lse == float("-inf"), 0.0)  # rows that see nothing: every p is 0
        dq = torch.zeros_like(x.q)  # (B, KV, Tq, G, D)
        dkc, dvc = torch.zeros_like(x.kc_e), torch.zeros_like(x.kc_e)  # (B, E, KV, D)
        dk, dv = torch.zeros_like(x.k), torch.zeros_like(x.v)  # (B, KV, Tk, D)
        dsinks = None if sinks is None else torch.zeros_like(x.sinks)
        for i0, i1 in plan.blocks(Tq):
            b = _block(plan, i0, i1, selected, q.device)
            qb, do = x.q[:, :, i0:i1], d_out[:, :, i0:i1]  # (B, KV, blk, G, D)
            lse_b = lse[:, :, i0:i1]
            p = torch.exp(x.scores(b, plan.scale) - lse_b[..., None])  # (B, KV, blk, G, n + nb), normalised
            delta = (do * out[:, :, i0:i1]).sum(-1)  # (B, KV, blk, G)
            if dsinks is not None:  # the sink's column: p_sink * (0 - delta)
                dsinks -= (torch.exp(x.sinks - lse_b) * delta).sum(dim=(0, 2), keepdim=True)
            ke, kb = x.keys(b, "k")
            ve, vb = x.keys(b, "v")
            n = b.n
            if b.sel is None:
                kcat, vcat = torch.cat([ke, kb], dim=2), torch.cat([ve, vb], dim=2)  # (B, KV, n + nb, D)
                ds = _rows(p) * (_rows(do) @ vcat.transpose(-1, -2) - _rows(delta[..., None]))  # (B, KV, rows, C)
                ds.mul_(plan.scale)
                dq[:, :, i0:i1] = (ds @ kcat).view_as(qb)
                dk_cat = ds.transpose(-1, -2) @ _rows(qb)  # (B, KV, n + nb, D)
                dv_cat = _rows(p).transpose(-1, -2) @ _rows(do)
                dkc[:, :n] += dk_cat[:, :, :n].transpose(1, 2)
                dvc[:, :n] += dv_cat[:, :, :n].transpose(1, 2)
                dk[:, :, b.c0 : b.c1] += dk_cat[:, :, n:]
                dv[:, :, b.c0 : b.c1] += dv_cat[:, :, n:]
                continue
            pe, pb = p[..., :n], _rows(p[..., n:])  # (B, KV, blk, G, K), (B, KV, rows, nb)
            ds_e = pe * (do @ ve.transpose(-1, -2) - delta[..., None])
            ds_b = pb * (_rows(do) @ vb.transpose(-1, -2) - _rows(delta[..., None]))
            ds_e.mul_(plan.scale)
            ds_b.mul_(plan.scale)
            dq[:, :, i0:i1] = ds_e @ ke + (ds_b @ kb).view_as(qb)
            dk[:, :, b.c0 : b.c1] += ds_b.transpose(-1, -2) @ _rows(qb)
            dv[:, :, b.c0 : b.c1] += pb.transpose(-1, -2) @ _rows(do)
            flat = (b.sel + torch.arange(B, device=q.device)[:, None, None] * E).flatten()  # (B * blk * K,)
            for grad, part in ((dkc, ds_e.transpose(-1, -2) @ qb), (dvc, pe.transpose(-1, -2) @ do)):
                src = part.permute(0, 2, 3, 1, 4).reshape(-1, KV, D)  # (B * blk * K, KV, D)
                grad.view(B * E, KV, D).index_add_(0, flat, src)
        dq = dq.permute(0, 2, 1, 3, 4).reshape(B, Tq, H, D).to(q.dtype)
        ds = None if dsinks is None else dsinks.reshape(H).to(sinks.dtype)
        if vc is None:  # tied: the values' gradient is the keys'
            dkc, dvc = dkc + dvc, None
        if v is None:
            dk, dv = dk + dv, None
        back = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        dk, dv = (None if g is None else g.permute(0, 2, 1, 3) for g in (dk, dv))  # (B, Tk, KV, D)
        return dq, back(dkc, kc), back(dvc, vc), back(dk, k), back(dv, v), ds, None, None


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
    earliest = _earliest_local_key(q_start, Tq, span, local_window, stride, origin)
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
