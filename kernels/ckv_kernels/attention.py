"""Joint attention over chunk-compressed entries and an exact local window: Triton kernels, launcher,
autograd Function and public wrapper. The oracle is ``ckv.attention.reference.joint_attention_reference``.

Tiling (docs/kernels.md has the full picture):
- Rows. A tile packs ``BLOCK_Q = BLOCK_M // G_PAD`` consecutive query positions times the ``G`` query heads of
  one KV head (``G_PAD``: G rounded up to a power of two, padded heads masked), so each K/V tile loaded serves
  the whole GQA group. Row ``r`` is query ``i0 + r // G_PAD``, head ``kv * G + r % G_PAD``.
- Forward / dq (``_query_kernel``, one program per row tile and (batch, KV head), heaviest tiles first): one
  online softmax (log2 domain) runs over (a) compressed entries ``0 .. n_hi`` in ``BLOCK_N`` tiles, where
  ``n_hi`` is the last entry visible to the tile's last query; tiles visible to every row skip masking, and
  (b) the band of exact keys from the first row's local start to the last row's position, masked per element.
  The forward stores the output and the log-sum-exp; the dq pass recomputes P from the saved log-sum-exp,
  computes ``delta = rowsum(dO * O)`` itself and stores it for the dk/dv pass.
- dk/dv (``_key_kernel``, one program per ``BLOCK_N`` keys of one source, query chunk and (batch, KV head)):
  walks the row tiles that can see its keys (compressed: from the first query that sees the tile's first entry
  to the end, masked only where visibility changes; local: the ``span`` queries after each key), recomputes P
  and dP transposed and accumulates dk, dv in fp32. When there are few key tiles the compressed pass splits
  the queries into chunks whose fp32 partial sums are added afterwards in a fixed order. Every output element
  is written by exactly one program: no atomics, deterministic, no uninitialised memory.
- Top-k selection (``selected``): ``_select_query_kernel`` (forward / dq) runs one program per query position and
  (batch, KV head), its G heads as rows, gathering the position's selected entries (rows sorted ascending,
  ``_prepare_selection``) before the same local band; ``_select_entry_kernel`` computes dkc/dvc per entry over the
  positions that selected it (the inverse map, ``_selection_csr``), in a fixed order: no atomics either. The exact
  keys' dk/dv is the dense ``_key_kernel``'s local pass.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ckv_kernels._common import INTERPRET, autotune, check_float, check_runnable, upcast_loads

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634  # log2(e); the kernels write the literal (jit globals must be constexpr)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _prune_rows(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """A row tile must hold at least one query position of the whole (padded) GQA group."""
    g_pad = kwargs.get("G_PAD", named_args.get("G_PAD"))
    return [c for c in configs if c.kwargs["BLOCK_M"] >= g_pad]  # both lists hold BLOCK_M = 64 >= any G_PAD


def _cfg(m: int, n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)


# Candidates for Hopper, kept to those that compile for sm_90 (bf16, D=128) without register spills, or nearly
# (benchmarks/kernel_resources.py); the autotuner picks per (length, group, mode, dtype). Untimed on a GPU so far.
_QUERY_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2), _cfg(64, 64, 8, 2), _cfg(64, 32, 4, 2), _cfg(128, 32, 8, 2)]
_KEY_CONFIGS = [_cfg(64, 32, 8, 2), _cfg(32, 64, 8, 2), _cfg(32, 32, 8, 2), _cfg(16, 64, 8, 2), _cfg(32, 32, 4, 3)]
_INTERPRETER_CONFIG = _cfg(64, 32, 4, 1)
# Top-k selection: one position per program (``_select_query_kernel``: gathered entries, BLOCK_N per step) and one
# entry per program (``_select_entry_kernel``: BLOCK_M (position, head) rows per step). All compile for sm_90
# without spills (benchmarks/kernel_resources.py); untimed on a GPU.
_SELECT_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=2) for n, w in ((64, 4), (32, 4), (64, 8))]
_SELECT_INTERPRETER_CONFIG = triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)
_ENTRY_CONFIGS = [
    triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=2) for m, w in ((32, 4), (64, 8), (32, 8), (16, 4))
]
_ENTRY_INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=1)


@triton.jit
def _local_lo(t, stride, span, TAIL: tl.constexpr):
    """First exact key position of the local window of the query at t (may exceed t: empty window): the last
    ``span`` tokens, or in TAIL mode the tokens of t's unfinished stride block (``ckv.geometry.local_start``).
    Plain arithmetic, so the launcher evaluates it in Python too (``_local_lo.fn``)."""
    if TAIL:
        return ((t + 1) // stride) * stride
    return t - span + 1


@triton.jit
def _visible(t, col, E, stride, k_start, span, COMPRESSED: tl.constexpr, TAIL: tl.constexpr):
    """Whether column ``col`` (entry index, or exact-key index at position ``k_start + col``) is visible to the
    query at position ``t`` (geometry.compressed_mask / local_mask); t and col broadcast."""
    if COMPRESSED:
        return col < tl.minimum((t + 1) // stride, E)
    p = k_start + col
    return (p >= _local_lo(t, stride, span, TAIL)) & (p <= t)


@triton.jit
def _rows(i0, Tq, H, kv, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row layout of a tile starting at query index i0: query index, offset of the (query, head) row inside
    one batch's (Tq, H) plane, and validity."""
    r = tl.arange(0, BLOCK_M)
    i = i0 + r // G_PAD
    g = r % G_PAD
    return i, i * H + kv * G + g, (i < Tq) & (g < G)


@triton.jit
def _load(ptrs, mask, UPCAST: tl.constexpr):
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:  # the interpreter reads bf16 as raw bits unless converted right away
        x = x.to(tl.float32)
    return x


@triton.jit
def _query_step(
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
    key = _load(KEY + offs, cols[:, None] < n_cols, UPCAST)  # (BLOCK_N, D)
    val = _load(VAL + offs, cols[:, None] < n_cols, UPCAST)
    s = tl.dot(q, tl.trans(key)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    if MASKED:
        s = tl.where(_visible(t[:, None], cols[None, :], E, stride, k_start, span, COMPRESSED, TAIL), s, float("-inf"))
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
def _query_start(
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
    q = _load(Q + q_offs, row_ok[:, None], UPCAST)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if BWD:
        do = _load(DO + q_offs, row_ok[:, None], UPCAST)
        delta = tl.sum(do.to(tl.float32) * _load(O + q_offs, row_ok[:, None], UPCAST).to(tl.float32), 1)
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
def _local_band(
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
    c_lo = tl.maximum(_local_lo(t_first, stride, span, TAIL) - k_start, 0)
    for c0 in range(c_lo, t_last - k_start + 1, BLOCK_N):
        acc, m_i, l_i = _query_step(
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
def _query_finish(acc, m_i, l_i, O, LSE, DQ, q_offs, row, row_ok, sm_scale, BWD: tl.constexpr):
    """Store the forward's output and log-sum-exp (rows that saw nothing: 0 and -inf), or with BWD, dq."""
    if BWD:
        tl.store(DQ + q_offs, (acc * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    else:
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that see nothing: acc = 0, output 0
        tl.store(O + q_offs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))  # x ln 2
        tl.store(LSE + row, lse, mask=row_ok)


@autotune(_QUERY_CONFIGS, _INTERPRETER_CONFIG, key=["Tq", "E", "D", "G_PAD", "TAIL", "BWD"], prune=_prune_rows)
@triton.jit
def _query_kernel(
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
    SINK (H,) fp32, read with HAS_SINK (``_query_start``)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    H = KV * G
    tile = tl.cdiv(Tq, BLOCK_Q) - 1 - tl.program_id(0)  # the last rows see the most entries: start them first
    b = tl.program_id(1) // KV
    kv = tl.program_id(1) % KV
    i0 = tile * BLOCK_Q
    i, row, row_ok = _rows(i0, Tq, H, kv, G, G_PAD, BLOCK_M)
    t = q_start + i
    d = tl.arange(0, D)
    plane = (b * Tq).to(tl.int64) * H  # first row of this batch in the (B, Tq, H) planes
    Q, O, DO, DQ, LSE, DELTA = Q + plane * D, O + plane * D, DO + plane * D, DQ + plane * D, LSE + plane, DELTA + plane
    q_offs = row[:, None] * D + d[None, :]  # int32 inside one batch: few registers across the loops
    q, do, acc, m_i, l_i = _query_start(
        Q, O, DO, LSE, DELTA, SINK, q_offs, row, row_ok, kv, H, G, D, BWD, UPCAST, HAS_SINK, BLOCK_M
    )

    # (a) compressed entries: tiles every row sees unmasked, then the tiles where visibility changes
    t_first = q_start + i0
    t_last = q_start + tl.minimum(i0 + BLOCK_Q, Tq) - 1
    n_hi = tl.minimum((t_last + 1) // stride, E)
    n_all = (tl.minimum((t_first + 1) // stride, E) // BLOCK_N) * BLOCK_N
    kc_base = (b * E).to(tl.int64) * KV * D + kv * D
    for j0 in range(0, n_all, BLOCK_N):
        acc, m_i, l_i = _query_step(
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
        acc, m_i, l_i = _query_step(
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
        acc, m_i, l_i = _local_band(
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
    _query_finish(acc, m_i, l_i, O, LSE, DQ, q_offs, row, row_ok, sm_scale, BWD)


@autotune(_SELECT_CONFIGS, _SELECT_INTERPRETER_CONFIG, key=["Tq", "E", "K_SEL", "D", "G_PAD", "TAIL", "BWD"])
@triton.jit
def _select_query_kernel(
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
    SEL,
    COUNT,
    Tq,
    Tk,
    E,
    KV,
    K_SEL,
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
    BLOCK_N: tl.constexpr,
):
    """Forward or dq pass of ``_query_kernel`` with top-k selection, for ONE query position and the G heads of
    one (batch, KV head): G_PAD >= 16 rows (heads padded, masked: tl.dot needs 16), since no two positions share
    their entries. SEL (B, Tq, K_SEL) int32: each row's entries in ascending order, the COUNT (B, Tq) int32
    visible ones first; (a) gathers those ``BLOCK_N`` at a time, (b) is the dense kernel's local band."""
    H = KV * G
    i0 = Tq - 1 - tl.program_id(0)  # later positions see more entries: start them first
    b = tl.program_id(1) // KV
    kv = tl.program_id(1) % KV
    i, row, row_ok = _rows(i0, Tq, H, kv, G, G_PAD, G_PAD)  # i = i0 on every row
    t = q_start + i
    d = tl.arange(0, D)
    plane = (b * Tq).to(tl.int64) * H
    Q, O, DO, DQ, LSE, DELTA = Q + plane * D, O + plane * D, DO + plane * D, DQ + plane * D, LSE + plane, DELTA + plane
    q_offs = row[:, None] * D + d[None, :]
    q, do, acc, m_i, l_i = _query_start(
        Q, O, DO, LSE, DELTA, SINK, q_offs, row, row_ok, kv, H, G, D, BWD, UPCAST, HAS_SINK, G_PAD
    )

    # (a) the selected entries, gathered; slots past the count read as entry E (masked)
    sel_base = (b * Tq + i0).to(tl.int64) * K_SEL
    n_sel = tl.load(COUNT + b * Tq + i0)
    kc_base = (b * E).to(tl.int64) * KV * D + kv * D
    for s0 in range(0, n_sel, BLOCK_N):
        slots = s0 + tl.arange(0, BLOCK_N)
        cols = tl.load(SEL + sel_base + slots, mask=slots < n_sel, other=E)
        acc, m_i, l_i = _query_step(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            KC + kc_base,
            VC + kc_base,
            cols,
            E,
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
    # (b) the band of exact keys of this position's local window
    if LOCAL:
        k_base = (b * Tk).to(tl.int64) * KV * D + kv * D
        t0 = q_start + i0
        acc, m_i, l_i = _local_band(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            K + k_base,
            V + k_base,
            t0,
            t0,
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
    _query_finish(acc, m_i, l_i, O, LSE, DQ, q_offs, row, row_ok, sm_scale, BWD)


@triton.jit
def _key_step(
    dk,
    dv,
    key,
    val,
    Q,
    DO,
    LSE,
    DELTA,
    i0,
    Tq,
    H,
    kv,
    q_start,
    cols,
    E,
    stride,
    k_start,
    span,
    qk_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    MASKED: tl.constexpr,
    COMPRESSED: tl.constexpr,
    TAIL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One row tile's contribution to dk, dv of a key tile (everything transposed: keys x rows). Q, DO, LSE,
    DELTA point at this batch's planes."""
    i, row, row_ok = _rows(i0, Tq, H, kv, G, G_PAD, BLOCK_M)
    d = tl.arange(0, D)
    q_offs = row[:, None] * D + d[None, :]
    q = _load(Q + q_offs, row_ok[:, None], UPCAST)  # (BLOCK_M, D); padded rows are 0 and contribute 0
    do = _load(DO + q_offs, row_ok[:, None], UPCAST)
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    p = tl.exp2(tl.dot(key, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
    if MASKED:
        vis = _visible(q_start + i[None, :], cols[:, None], E, stride, k_start, span, COMPRESSED, TAIL)
        p = tl.where(vis & row_ok[None, :], p, 0.0)
    dv += tl.dot(p.to(do.dtype), do)
    ds = p * (tl.dot(val, tl.trans(do)) - delta[None, :])
    dk += tl.dot(ds.to(q.dtype), q)
    return dk, dv


@autotune(
    _KEY_CONFIGS,
    _INTERPRETER_CONFIG,
    key=["Tq", "n_keys", "chunk", "D", "G_PAD", "TAIL", "COMPRESSED"],
    prune=_prune_rows,
)
@triton.jit
def _key_kernel(
    Q,
    KEY,
    VAL,
    DO,
    LSE,
    DELTA,
    DKEY,
    DVAL,
    Tq,
    n_keys,
    E,
    KV,
    q_start,
    k_start,
    stride,
    span,
    chunk,
    split_stride,
    qk_scale,
    sm_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    TAIL: tl.constexpr,
    COMPRESSED: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dk, dv of BLOCK_N keys of one source (compressed entries, or exact keys) of one (batch, KV head), from
    the queries of chunk ``program_id(1)`` (query indices ``[c * chunk, (c + 1) * chunk)``, chunk a multiple
    of 128). KEY, VAL: (B, n_keys, KV, D); DKEY, DVAL: that shape, or (n_chunks, ...) partial sums at
    ``split_stride`` elements apart; the rest as in _query_kernel."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    H = KV * G
    c0 = tl.program_id(0) * BLOCK_N
    b = tl.program_id(2) // KV
    kv = tl.program_id(2) % KV
    cols = c0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    base = (b * n_keys).to(tl.int64) * KV * D + kv * D  # this (batch, KV head); int32 offsets inside
    offs = cols[:, None] * (KV * D) + d[None, :]
    KEY, VAL = KEY + base, VAL + base
    key = _load(KEY + offs, cols[:, None] < n_keys, UPCAST)
    val = _load(VAL + offs, cols[:, None] < n_keys, UPCAST)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    plane = (b * Tq).to(tl.int64) * H
    Q, DO, LSE, DELTA = Q + plane * D, DO + plane * D, LSE + plane, DELTA + plane
    if COMPRESSED:  # entry j is seen from position (j+1)*stride - 1 on; all of the tile from (c0+BLOCK_N)*stride - 1
        i_lo = tl.maximum((c0 + 1) * stride - 1 - q_start, 0)
        i_mask_end = tl.minimum(tl.maximum((c0 + BLOCK_N) * stride - 1 - q_start, 0), Tq)
    else:  # the exact key at p is seen by queries p .. p + span - 1
        i_lo = tl.maximum(k_start + c0 - q_start, 0)
        i_mask_end = tl.minimum(tl.maximum(k_start + c0 + BLOCK_N - 1 + span - q_start, 0), Tq)
    # row tiles start at multiples of BLOCK_Q (so none straddles two chunks); rows before i_lo are masked
    chunk_lo = tl.program_id(1) * chunk
    chunk_hi = tl.minimum(chunk_lo + chunk, Tq)
    i_first = tl.maximum((i_lo // BLOCK_Q) * BLOCK_Q, chunk_lo)
    i_mid = tl.maximum(tl.cdiv(i_mask_end, BLOCK_Q) * BLOCK_Q, i_first)
    for i0 in range(i_first, tl.minimum(i_mid, chunk_hi), BLOCK_Q):
        dk, dv = _key_step(
            dk,
            dv,
            key,
            val,
            Q,
            DO,
            LSE,
            DELTA,
            i0,
            Tq,
            H,
            kv,
            q_start,
            cols,
            E,
            stride,
            k_start,
            span,
            qk_scale,
            G,
            G_PAD,
            D,
            True,
            COMPRESSED,
            TAIL,
            UPCAST,
            BLOCK_M,
        )
    if COMPRESSED:
        for i0 in range(i_mid, chunk_hi, BLOCK_Q):
            dk, dv = _key_step(
                dk,
                dv,
                key,
                val,
                Q,
                DO,
                LSE,
                DELTA,
                i0,
                Tq,
                H,
                kv,
                q_start,
                cols,
                E,
                stride,
                k_start,
                span,
                qk_scale,
                G,
                G_PAD,
                D,
                False,
                COMPRESSED,
                TAIL,
                UPCAST,
                BLOCK_M,
            )
    out = base + tl.program_id(1).to(tl.int64) * split_stride
    tl.store(DKEY + out + offs, (dk * sm_scale).to(DKEY.dtype.element_ty), mask=cols[:, None] < n_keys)
    tl.store(DVAL + out + offs, dv.to(DVAL.dtype.element_ty), mask=cols[:, None] < n_keys)


@autotune(_ENTRY_CONFIGS, _ENTRY_INTERPRETER_CONFIG, key=["Tq", "E", "D", "G_PAD"], prune=_prune_rows)
@triton.jit
def _select_entry_kernel(
    Q,
    KC,
    VC,
    DO,
    LSE,
    DELTA,
    DKC,
    DVC,
    OFFSETS,
    TOKENS,
    Tq,
    E,
    KV,
    qk_scale,
    sm_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dkc, dvc of ONE compressed entry ``program_id(0)`` of one (batch, KV head) under top-k selection: the sum
    over the query positions that selected it (and see it), in ascending order, ``BLOCK_M // G_PAD`` positions
    x G heads per step. TOKENS[OFFSETS[b*E + e] : OFFSETS[b*E + e + 1]] (int32) are those positions (indices into
    Tq), OFFSETS (B*E + 1,) int64. One entry per program: scores are dot products with one key (no tl.dot), and
    the program writes its entry's gradients alone, zeros when no query selected it (no atomics)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    H = KV * G
    e = tl.program_id(0)
    b = tl.program_id(1) // KV
    kv = tl.program_id(1) % KV
    d = tl.arange(0, D)
    entry = ((b * E + e).to(tl.int64) * KV + kv) * D
    key = _load(KC + entry + d, d < D, UPCAST).to(tl.float32)  # (D,)
    val = _load(VC + entry + d, d < D, UPCAST).to(tl.float32)
    plane = (b * Tq).to(tl.int64) * H
    Q, DO, LSE, DELTA = Q + plane * D, DO + plane * D, LSE + plane, DELTA + plane
    lo = tl.load(OFFSETS + b * E + e)
    hi = tl.load(OFFSETS + b * E + e + 1)
    dk = tl.zeros([D], dtype=tl.float32)
    dv = tl.zeros([D], dtype=tl.float32)
    r = tl.arange(0, BLOCK_M)
    g = r % G_PAD
    for s0 in range(lo, hi, BLOCK_Q):
        slot = s0 + r // G_PAD
        ok = (slot < hi) & (g < G)
        i = tl.load(TOKENS + slot, mask=ok, other=0)
        row = i * H + kv * G + g
        q_offs = row[:, None] * D + d[None, :]
        q = _load(Q + q_offs, ok[:, None], UPCAST).to(tl.float32)  # (BLOCK_M, D)
        do = _load(DO + q_offs, ok[:, None], UPCAST).to(tl.float32)
        lse = tl.load(LSE + row, mask=ok, other=0.0) * 1.4426950408889634  # finite: these rows see the entry
        delta = tl.load(DELTA + row, mask=ok, other=0.0)
        p = tl.where(ok, tl.exp2(tl.sum(q * key[None, :], 1) * qk_scale - lse), 0.0)  # (BLOCK_M,)
        ds = p * (tl.sum(do * val[None, :], 1) - delta)
        dv += tl.sum(p[:, None] * do, 0)
        dk += tl.sum(ds[:, None] * q, 0)
    tl.store(DKC + entry + d, (dk * sm_scale).to(DKC.dtype.element_ty))
    tl.store(DVC + entry + d, dv.to(DVC.dtype.element_ty))


def _first_needed_key(q_start: int, Tq: int, stride: int, span: int, tail: bool, origin: int = 0) -> Optional[int]:
    """Earliest exact-key position any query's local window holds, or None when no window holds a key.
    Window starts never decrease with the query position, so it is the first query's window start (no earlier
    than ``origin``, the first position that exists); in tail mode that window is empty when the first query
    closes a stride block, and the next query's window then starts at the same position, ``q_start + 1``."""
    if span == 0 or Tq == 0:
        return None
    return max(int(_local_lo.fn(q_start, stride, span, tail)), origin)


def _check_inputs(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stride: int,
    local_span: int,
    tail: bool,
    q_start: int,
    origin: int = 0,
) -> None:
    """Raise a clear error on any input the kernels do not support."""
    for name, t in (("q", q), ("kc", kc), ("vc", vc), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-d (B, T, heads, head_dim), got shape {tuple(t.shape)}")
        check_float(name, t, q.dtype)
    B, Tq, H, D = q.shape
    if kc.shape != vc.shape or k.shape != v.shape:
        raise ValueError(
            f"kc {tuple(kc.shape)} must match vc {tuple(vc.shape)}, k {tuple(k.shape)} must match v {tuple(v.shape)}"
        )
    KV = kc.shape[2]
    if kc.shape[0] != B or k.shape[0] != B or k.shape[2] != KV or kc.shape[3] != D or k.shape[3] != D:
        raise ValueError(
            f"inconsistent shapes: q {tuple(q.shape)}, kc {tuple(kc.shape)}, k {tuple(k.shape)} "
            "(expected (B, Tq, H, D), (B, E, KV, D), (B, Tk, KV, D))"
        )
    if H % KV:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads {KV}")
    if triton.next_power_of_2(H // KV) > 64:
        raise ValueError(f"GQA group H/KV={H // KV} is larger than the supported 64")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={D} is not supported by the Triton kernels; supported: {SUPPORTED_HEAD_DIMS}")
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride={stride!r} must be an integer >= 1")
    if not isinstance(local_span, int) or isinstance(local_span, bool) or local_span < 0:
        raise ValueError(f"local_span={local_span!r} must be an integer >= 0")
    if not isinstance(tail, bool):
        raise ValueError(f"tail={tail!r} must be a bool")
    if tail and local_span != stride - 1:
        raise ValueError(f"tail mode keeps at most stride - 1 = {stride - 1} exact keys, got local_span={local_span}")
    if not isinstance(origin, int) or isinstance(origin, bool) or origin < 0:
        raise ValueError(f"origin={origin!r} must be an integer >= 0")
    if not isinstance(q_start, int) or isinstance(q_start, bool) or q_start < origin:
        raise ValueError(f"q_start={q_start!r} must be an integer >= {origin} (origin)")
    k_start = q_start + Tq - k.shape[1]
    if k_start < origin:
        raise ValueError(
            f"{k.shape[1]} exact keys end at position {q_start + Tq - 1}, so they would start before "
            f"the first position {origin}"
        )
    first = _first_needed_key(q_start, Tq, stride, local_span, tail, origin)
    if first is not None and first < k_start:
        raise ValueError(f"exact keys start at position {k_start}, but a local window reaches back to {first}")
    check_runnable(q, kc, vc, k, v)


def _prepare_selection(
    selected: torch.Tensor, B: int, Tq: int, E: int, q_start: int, stride: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``selected`` (B, Tq, K) and turn it into what the kernels read: each row's entries in ascending order,
    int32, empty slots (-1) as E, so that the entries its position sees come first; and their count (B, Tq) int32.
    One host sync (the check). K = 0 becomes one empty slot (the kernels never get an empty tensor)."""
    if selected.dtype not in (torch.int64, torch.int32) or selected.dim() != 3 or tuple(selected.shape[:2]) != (B, Tq):
        raise ValueError(
            f"selected must be an int64 or int32 tensor (B, Tq, K) = ({B}, {Tq}, K), got {selected.dtype} "
            f"{tuple(selected.shape)}"
        )
    if selected.device != device:
        raise ValueError(f"selected is on {selected.device}, the other inputs on {device}")
    if selected.shape[2] == 0:
        selected = selected.new_full((B, Tq, 1), -1)
    sel = selected.to(torch.int32, copy=True)  # out-of-range values (int32 may wrap them) are reported below
    sel = sel.masked_fill_(sel < 0, E).sort(dim=-1).values  # (B, Tq, K)
    if sel.numel():
        lo, hi = selected.min(), selected.max()
        repeated = ((sel[..., 1:] == sel[..., :-1]) & (sel[..., 1:] < E)).any()
        if ((lo < -1) | (hi >= E) | repeated).item():
            if lo < -1 or hi >= E:
                raise ValueError(
                    f"selected holds indices {lo.item()} .. {hi.item()}; allowed: -1 (empty slot) .. E-1 = {E - 1}"
                )
            raise ValueError("selected repeats an entry index within a row (each selected entry counts once)")
    visible = torch.clamp((torch.arange(q_start + 1, q_start + Tq + 1, device=device)) // stride, max=E)  # (Tq,)
    count = (sel < visible[None, :, None]).sum(-1, dtype=torch.int32)  # (B, Tq)
    return sel.contiguous(), count


def _selection_csr(sel: torch.Tensor, count: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection inverted for the dkc/dvc pass: the positions (indices into Tq) that see and selected entry e
    of batch b are ``tokens[offsets[b*E + e] : offsets[b*E + e + 1]]``, ascending. A stable sort of the key
    ``b*E + entry`` over every (b, position, slot), unused slots keyed ``B*E`` (last); no host sync.
    Returns offsets (B*E + 1,) int64 and tokens (B*Tq*K,) int32."""
    B, Tq, K = sel.shape
    used = torch.arange(K, device=sel.device) < count[..., None]  # (B, Tq, K)
    batch = torch.arange(B, device=sel.device, dtype=torch.int32)[:, None, None] * E
    keys, order = (sel + batch).masked_fill_(~used, B * E).flatten().sort(stable=True)  # int32 keys, int64 order
    tokens = order.div_(K, rounding_mode="floor").remainder_(Tq).to(torch.int32)  # in place: one int64 buffer
    offsets = torch.searchsorted(keys, torch.arange(B * E + 1, device=sel.device, dtype=keys.dtype))
    return offsets, tokens


class _Problem:
    """Sizes and geometry of one call, turned into kernel arguments once."""

    def __init__(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        k: torch.Tensor,
        stride: int,
        local_span: int,
        tail: bool,
        q_start: int,
        scale: Optional[float],
    ) -> None:
        self.B, self.Tq, H, self.D = q.shape
        self.E, self.KV, self.Tk = kc.shape[1], kc.shape[2], k.shape[1]
        self.G = H // self.KV
        self.g_pad = triton.next_power_of_2(self.G)
        self.stride, self.q_start = stride, q_start
        self.k_start = q_start + self.Tq - self.Tk
        self.tail, self.span = tail, local_span
        self.sm_scale = self.D**-0.5 if scale is None else float(scale)
        self.upcast = upcast_loads(q.dtype)

    def query_grid(self, meta: dict) -> tuple[int, int]:
        return triton.cdiv(self.Tq, meta["BLOCK_M"] // self.g_pad), self.B * self.KV

    def key_chunk(self, n_keys: int, device: torch.device) -> int:
        """Queries per program of the compressed dk/dv pass (a multiple of 128). With few key tiles (short
        compressed axis, few KV heads) the queries are split over up to 16 programs per tile so the GPU fills
        up; their fp32 partial sums are added in a fixed order (deterministic). The interpreter splits long
        inputs too, so that tests cover the path."""
        tiles = triton.cdiv(n_keys, 64) * self.B * self.KV
        wanted = 4 if INTERPRET else triton.cdiv(2 * _multiprocessors(device), tiles)
        n = max(1, min(wanted, 16, triton.cdiv(self.Tq, 128)))
        return triton.cdiv(triton.cdiv(self.Tq, n), 128) * 128

    def run_query(
        self,
        q,
        kc,
        vc,
        k,
        v,
        o,
        lse,
        do,
        dq,
        delta,
        bwd: bool,
        sinks: Optional[torch.Tensor] = None,
        selection: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> None:
        """Forward or dq pass; with ``selection`` = (sorted indices, counts) from ``_prepare_selection``, the
        top-k kernel (one position per program)."""
        tensors = (q, kc, vc, k, v, o, lse, do, dq, delta, lse if sinks is None else sinks)  # SINK unread without
        geometry = (self.q_start, self.k_start, self.stride, self.span, self.sm_scale * LOG2E, self.sm_scale)
        flags = dict(
            G=self.G,
            D=self.D,
            TAIL=self.tail,
            LOCAL=self.span > 0,
            BWD=bwd,
            UPCAST=self.upcast,
            HAS_SINK=sinks is not None,
        )
        if selection is None:
            _query_kernel[self.query_grid](
                *tensors, self.Tq, self.Tk, self.E, self.KV, *geometry, G_PAD=self.g_pad, **flags
            )
            return
        sel, count = selection
        _select_query_kernel[(self.Tq, self.B * self.KV)](
            *tensors,
            sel,
            count,
            self.Tq,
            self.Tk,
            self.E,
            self.KV,
            sel.shape[2],
            *geometry,
            G_PAD=max(16, self.g_pad),  # tl.dot needs 16 rows
            **flags,
        )

    def run_key(self, q, key, val, do, lse, delta, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """dk, dv of one source (compressed entries or exact keys)."""
        n_keys = key.shape[1]
        chunk = self.key_chunk(n_keys, q.device) if compressed else triton.cdiv(self.Tq, 128) * 128
        n_chunks = triton.cdiv(self.Tq, chunk)
        if n_chunks == 1:
            dkey, dval, split_stride = torch.empty_like(key), torch.empty_like(val), 0
        else:  # fp32 partial sums, one slice per chunk, every element written
            dkey = key.new_empty((n_chunks, *key.shape), dtype=torch.float32)
            dval, split_stride = torch.empty_like(dkey), key.numel()
        _key_kernel[lambda meta: (triton.cdiv(n_keys, meta["BLOCK_N"]), n_chunks, self.B * self.KV)](
            q,
            key,
            val,
            do,
            lse,
            delta,
            dkey,
            dval,
            self.Tq,
            n_keys,
            self.E,
            self.KV,
            self.q_start,
            self.k_start,
            self.stride,
            self.span,
            chunk,
            split_stride,
            self.sm_scale * LOG2E,
            self.sm_scale,
            G=self.G,
            G_PAD=self.g_pad,
            D=self.D,
            TAIL=self.tail,
            COMPRESSED=compressed,
            UPCAST=self.upcast,
        )
        if n_chunks > 1:
            dkey, dval = dkey.sum(0).to(key.dtype), dval.sum(0).to(val.dtype)
        return dkey, dval

    def run_select_entries(self, q, kc, vc, do, lse, delta, sel, count) -> tuple[torch.Tensor, torch.Tensor]:
        """dkc, dvc under top-k selection: each entry sums over the positions that selected it (``_selection_csr``),
        one program per (entry, batch, KV head), every entry written."""
        offsets, tokens = _selection_csr(sel, count, self.E)
        dkc, dvc = torch.empty_like(kc), torch.empty_like(vc)
        _select_entry_kernel[(self.E, self.B * self.KV)](
            q,
            kc,
            vc,
            do,
            lse,
            delta,
            dkc,
            dvc,
            offsets,
            tokens,
            self.Tq,
            self.E,
            self.KV,
            self.sm_scale * LOG2E,
            self.sm_scale,
            G=self.G,
            G_PAD=self.g_pad,
            D=self.D,
            UPCAST=self.upcast,
        )
        return dkc, dvc


class JointAttentionFunction(torch.autograd.Function):
    """Autograd for the joint-attention kernels. Saves the inputs, the output and the log-sum-exp; the backward
    recomputes P. The log-sum-exp output is not differentiable."""

    @staticmethod
    def forward(ctx, q, kc, vc, k, v, sinks, prob: _Problem, sel, count):
        o = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)  # (B, Tq, H)
        sinks32 = None if sinks is None else sinks.detach().float().contiguous()
        selection = None if sel is None else (sel, count)
        if prob.Tq:  # DO, DQ, DELTA unused
            prob.run_query(q, kc, vc, k, v, o, lse, o, o, lse, bwd=False, sinks=sinks32, selection=selection)
        ctx.save_for_backward(q, kc, vc, k, v, o, lse, sinks32, sel, count)
        ctx.prob = prob
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kc, vc, k, v, o, lse, sinks, sel, count = ctx.saved_tensors
        prob: _Problem = ctx.prob
        do = do.contiguous()
        if prob.Tq == 0:
            dsink = None if sinks is None else torch.zeros_like(sinks, dtype=ctx.sinks_dtype)
            return tuple(torch.zeros_like(t) for t in (q, kc, vc, k, v)) + (dsink, None, None, None)
        dq, delta = torch.empty_like(q), torch.empty_like(lse)
        selection = None if sel is None else (sel, count)
        prob.run_query(q, kc, vc, k, v, o, lse, do, dq, delta, bwd=True, selection=selection)  # dq, delta
        # d sink_h = -sum over (batch, query) of P(sink) * delta, P(sink) = exp(sink_h - lse)
        dsink = None if sinks is None else (-(sinks - lse).exp() * delta).sum((0, 1)).to(ctx.sinks_dtype)
        if not prob.E:
            dkc, dvc = torch.zeros_like(kc), torch.zeros_like(vc)
        elif sel is None:
            dkc, dvc = prob.run_key(q, kc, vc, do, lse, delta, compressed=True)
        else:
            dkc, dvc = prob.run_select_entries(q, kc, vc, do, lse, delta, sel, count)
        if prob.span and prob.Tk:
            dk, dv = prob.run_key(q, k, v, do, lse, delta, compressed=False)
        else:  # no local window: exact keys get no gradient
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        return dq, dkc, dvc, dk, dv, dsink, None, None, None


def joint_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    local_span: int,
    tail: bool = False,
    q_start: int = 0,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    origin: int = 0,
    selected: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over visible compressed entries and the exact keys of each query's local window (Triton;
    same contract as ``ckv.attention.reference.joint_attention_reference``).

    q: (B, Tq, H, D) at positions ``q_start .. q_start+Tq-1``; kc, vc: (B, E, KV, D) compressed entries
    ``0..E-1`` (entry j visible from position ``(j+1)*stride - 1``); k, v: (B, Tk, KV, D) exact keys at
    positions ``q_start+Tq-Tk ..``. The exact local window of the query at t is its last ``local_span`` tokens
    ``[t - local_span + 1, t]`` (0 = none), or with ``tail`` the tokens of its unfinished stride block
    ``[((t+1) // stride) * stride, t]`` (then ``local_span`` must be ``stride - 1``, the widest such block); the
    caller derives both from the geometry (``ckv.geometry.local_span``). H % KV == 0 with H/KV <= 64; D in
    SUPPORTED_HEAD_DIMS; all inputs fp32, fp16 or bf16 (one dtype), accumulation in fp32.
    ``sinks`` (H,), any float dtype: one extra logit per head whose probability is dropped (DeepSeek-V4).
    Returns out (B, Tq, H, D) in q's dtype (0 where a query sees nothing) and the log-sum-exp (B, Tq, H) fp32,
    sinks included (-inf where a query sees nothing and there are no sinks). Differentiable in q, kc, vc, k, v
    and sinks. ``origin``: the first position that exists (0; a layer with a shifted grid passes every position
    in its grid coordinates, where real position 0 is ``origin``). The kernels derive query and key positions
    from ``q_start`` and ``Tk`` alone and never read a key before ``k_start >= origin``, so ``origin`` only
    bounds the input checks.
    ``selected`` (B, Tq, K) int64 or int32: top-k selection, as in the reference (each row lists the entries its
    position attends to, shared by its heads, -1 = empty slot; an entry counts iff visible and listed; a repeated
    index or one outside -1 .. E-1 raises ValueError). Checking it costs one host sync.
    """
    _check_inputs(q, kc, vc, k, v, stride, local_span, tail, q_start, origin)
    if sinks is not None:
        check_float("sinks", sinks)
        if sinks.shape != (q.shape[2],) or sinks.device != q.device:
            raise ValueError(
                f"sinks must have shape (H,) = ({q.shape[2]},) on {q.device}, got "
                f"{tuple(sinks.shape)} on {sinks.device}"
            )
    sel, count = (None, None)
    if selected is not None:
        sel, count = _prepare_selection(selected, q.shape[0], q.shape[1], kc.shape[1], q_start, stride, q.device)
    prob = _Problem(q, kc, k, stride, local_span, tail, q_start, scale)
    q, kc, vc, k, v = (t.contiguous() for t in (q, kc, vc, k, v))
    return JointAttentionFunction.apply(q, kc, vc, k, v, sinks, prob, sel, count)
