"""Joint attention, the query pass: the dense kernel ``query_kernel`` and its launcher ``run_query``. The forward
stores the output and the log-sum-exp; the backward reruns the same kernel with ``BWD`` for dq (the top-k kernel of
``attention_select`` is built from the same steps). The oracle is ``ckv.attention.reference.joint_attention_reference``.

One program per row tile (``attention_common``) and (batch, KV head), heaviest tiles first: one online softmax (log2
domain) runs over (a) compressed entries ``0 .. n_hi`` in ``BLOCK_N`` tiles, where ``n_hi`` is the last entry
visible to the tile's last query; tiles visible to every row skip masking, and (b) the band of exact keys from the
first row's local start to the last row's position, masked per element. The dq pass recomputes P from the saved
log-sum-exp, computes ``delta = rowsum(dO * O)`` itself and stores it for the dk/dv pass (``attention_bwd``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ckv_kernels._common import autotune
from ckv_kernels.attention_common import (
    INTERPRETER_CONFIG,
    Problem,
    load,
    local_lo,
    prune_rows,
    rows,
    tile_config,
    visible,
)

__all__ = ["QUERY_CONFIGS", "local_band", "query_finish", "query_kernel", "query_start", "query_step", "run_query"]

# Candidates for Hopper, kept to those that compile for sm_90 (bf16, D=128) without register spills, or nearly
# (benchmarks/kernel_resources.py); the autotuner picks per (length, group, mode, dtype). Untimed on a GPU so far.
QUERY_CONFIGS = [
    tile_config(128, 64, 8, 3),
    tile_config(128, 64, 8, 2),
    tile_config(64, 64, 8, 2),
    tile_config(64, 32, 4, 2),
    tile_config(128, 32, 8, 2),
]


@triton.jit
def query_step(
    acc,
    m_i,
    l_i,
    q,
    do,
    t,
    KEY,
    VAL,
    cols,
    n_cols,
    row_stride,
    E,
    stride,
    k_start,
    span,
    qk_scale,
    D: tl.constexpr,
    MASKED: tl.constexpr,
    COMPRESSED: tl.constexpr,
    TAIL: tl.constexpr,
    BWD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One key tile for a row tile. Forward: online-softmax update of (acc, m, l). Backward (BWD): m holds the
    log-sum-exp (log2 units), l holds delta, acc accumulates dS @ K."""
    d = tl.arange(0, D)
    offs = cols[:, None] * row_stride + d[None, :]
    key = load(KEY + offs, cols[:, None] < n_cols, UPCAST)  # (BLOCK_N, D)
    val = load(VAL + offs, cols[:, None] < n_cols, UPCAST)
    s = tl.dot(q, tl.trans(key)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    if MASKED:
        s = tl.where(visible(t[:, None], cols[None, :], E, stride, k_start, span, COMPRESSED, TAIL), s, float("-inf"))
    if BWD:
        p = tl.exp2(s - m_i[:, None])
        ds = p * (tl.dot(do, tl.trans(val)) - l_i[:, None])
        acc += tl.dot(ds.to(key.dtype), key)
        m_new = m_i
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        corr = tl.exp2(m_i - m_new)
        l_i = l_i * corr + tl.sum(p, 1)
        acc = acc * corr[:, None] + tl.dot(p.to(val.dtype), val)
    return acc, m_new, l_i


@triton.jit
def query_start(
    Q,
    O,
    DO,
    LSE,
    DELTA,
    SINK,
    q_offs,
    row,
    row_ok,
    kv,
    H,
    G: tl.constexpr,
    D: tl.constexpr,
    BWD: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Load a row tile's queries and start its pass. Forward: acc = 0 and (m, l) empty or, with HAS_SINK, the
    head's sink logit (a column of value 0: m = the logit in log2 units, l = 1), so LSE includes it and the
    backward, which recomputes P from LSE, needs nothing more. BWD: also dO; computes and stores delta =
    rowsum(dO * O); m = the log-sum-exp (log2 units; 0 for rows that see nothing), l = delta."""
    q = load(Q + q_offs, row_ok[:, None], UPCAST)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if BWD:
        do = load(DO + q_offs, row_ok[:, None], UPCAST)
        delta = tl.sum(do.to(tl.float32) * load(O + q_offs, row_ok[:, None], UPCAST).to(tl.float32), 1)
        tl.store(DELTA + row, delta, mask=row_ok)
        lse = tl.load(LSE + row, mask=row_ok, other=0.0)
        m_i = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # log2 units; rows seeing nothing: 0
        l_i = delta
    else:
        do = q  # unused in the forward
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINK:  # row % H is the row's head
            m_i = tl.load(SINK + tl.where(row_ok, row % H, kv * G)) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    return q, do, acc, m_i, l_i


@triton.jit
def local_band(
    acc,
    m_i,
    l_i,
    q,
    do,
    t,
    K,
    V,
    t_first,
    t_last,
    Tk,
    E,
    KV,
    stride,
    k_start,
    span,
    qk_scale,
    D: tl.constexpr,
    TAIL: tl.constexpr,
    BWD: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The band of exact keys the local windows of queries ``t_first .. t_last`` cover, masked per element;
    K, V point at this (batch, KV head)."""
    c_lo = tl.maximum(local_lo(t_first, stride, span, TAIL) - k_start, 0)
    for c0 in range(c_lo, t_last - k_start + 1, BLOCK_N):
        acc, m_i, l_i = query_step(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            K,
            V,
            c0 + tl.arange(0, BLOCK_N),
            Tk,
            KV * D,
            E,
            stride,
            k_start,
            span,
            qk_scale,
            D,
            True,
            False,
            TAIL,
            BWD,
            UPCAST,
        )
    return acc, m_i, l_i


@triton.jit
def query_finish(acc, m_i, l_i, O, LSE, DQ, q_offs, row, row_ok, sm_scale, BWD: tl.constexpr):
    """Store the forward's output and log-sum-exp (rows that saw nothing: 0 and -inf), or with BWD, dq."""
    if BWD:
        tl.store(DQ + q_offs, (acc * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    else:
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that see nothing: acc = 0, output 0
        tl.store(O + q_offs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))  # x ln 2
        tl.store(LSE + row, lse, mask=row_ok)


@autotune(QUERY_CONFIGS, INTERPRETER_CONFIG, key=["Tq", "E", "D", "G_PAD", "TAIL", "BWD"], prune=prune_rows)
@triton.jit
def query_kernel(
    Q,
    KC,
    VC,
    K,
    V,
    O,
    LSE,
    DO,
    DQ,
    DELTA,
    SINK,
    Tq,
    Tk,
    E,
    KV,
    q_start,
    k_start,
    stride,
    span,
    qk_scale,
    sm_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    TAIL: tl.constexpr,
    LOCAL: tl.constexpr,
    BWD: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Forward (O, LSE) or, with BWD, the dq pass (DQ, DELTA) for one row tile of one (batch, KV head).
    Q, O, DO, DQ: (B, Tq, H, D); KC, VC: (B, E, KV, D); K, V: (B, Tk, KV, D); LSE, DELTA: (B, Tq, H) fp32;
    SINK (H,) fp32, read with HAS_SINK (``query_start``)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    H = KV * G
    tile = tl.cdiv(Tq, BLOCK_Q) - 1 - tl.program_id(0)  # the last rows see the most entries: start them first
    b = tl.program_id(1) // KV
    kv = tl.program_id(1) % KV
    i0 = tile * BLOCK_Q
    i, row, row_ok = rows(i0, Tq, H, kv, G, G_PAD, BLOCK_M)
    t = q_start + i
    d = tl.arange(0, D)
    plane = (b * Tq).to(tl.int64) * H  # first row of this batch in the (B, Tq, H) planes
    Q, O, DO, DQ, LSE, DELTA = Q + plane * D, O + plane * D, DO + plane * D, DQ + plane * D, LSE + plane, DELTA + plane
    q_offs = row[:, None] * D + d[None, :]  # int32 inside one batch: few registers across the loops
    q, do, acc, m_i, l_i = query_start(
        Q, O, DO, LSE, DELTA, SINK, q_offs, row, row_ok, kv, H, G, D, BWD, UPCAST, HAS_SINK, BLOCK_M
    )

    # (a) compressed entries: tiles every row sees unmasked, then the tiles where visibility changes
    t_first = q_start + i0
    t_last = q_start + tl.minimum(i0 + BLOCK_Q, Tq) - 1
    n_hi = tl.minimum((t_last + 1) // stride, E)
    n_all = (tl.minimum((t_first + 1) // stride, E) // BLOCK_N) * BLOCK_N
    kc_base = (b * E).to(tl.int64) * KV * D + kv * D
    for j0 in range(0, n_all, BLOCK_N):
        acc, m_i, l_i = query_step(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            KC + kc_base,
            VC + kc_base,
            j0 + tl.arange(0, BLOCK_N),
            n_hi,
            KV * D,
            E,
            stride,
            k_start,
            span,
            qk_scale,
            D,
            False,
            True,
            TAIL,
            BWD,
            UPCAST,
        )
    for j0 in range(n_all, n_hi, BLOCK_N):
        acc, m_i, l_i = query_step(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            KC + kc_base,
            VC + kc_base,
            j0 + tl.arange(0, BLOCK_N),
            n_hi,
            KV * D,
            E,
            stride,
            k_start,
            span,
            qk_scale,
            D,
            True,
            True,
            TAIL,
            BWD,
            UPCAST,
        )
    # (b) the band of exact keys the tile's local windows cover
    if LOCAL:
        k_base = (b * Tk).to(tl.int64) * KV * D + kv * D
        acc, m_i, l_i = local_band(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            K + k_base,
            V + k_base,
            t_first,
            t_last,
            Tk,
            E,
            KV,
            stride,
            k_start,
            span,
            qk_scale,
            D,
            TAIL,
            BWD,
            UPCAST,
            BLOCK_N,
        )
    query_finish(acc, m_i, l_i, O, LSE, DQ, q_offs, row, row_ok, sm_scale, BWD)


def run_query(
    prob: Problem,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dq: torch.Tensor,
    delta: torch.Tensor,
    bwd: bool,
    sinks: Optional[torch.Tensor] = None,
) -> None:
    """Forward (o, lse) or, with ``bwd``, the dq pass (dq, delta) of the dense path."""
    tensors, geometry, flags = prob.query_arguments((q, kc, vc, k, v, o, lse, do, dq, delta), bwd, sinks)
    query_kernel[lambda meta: (triton.cdiv(prob.Tq, meta["BLOCK_M"] // prob.g_pad), prob.B * prob.KV)](
        *tensors, prob.Tq, prob.Tk, prob.E, prob.KV, *geometry, G_PAD=prob.g_pad, **flags
    )
