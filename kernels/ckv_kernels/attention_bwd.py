"""Joint attention, the key pass of the backward: ``key_kernel`` computes dk, dv of one source (compressed entries
or exact keys) and ``run_key`` launches it. dq and delta come first from the query pass rerun with ``BWD``
(``attention_fwd``); the top-k path has its own dkc/dvc kernel (``attention_select``) and uses this pass for the
exact keys. The oracle is ``ckv.attention.reference.joint_attention_reference``.

One program per ``BLOCK_N`` keys of one source, query chunk and (batch, KV head): it walks the row tiles that can
see its keys (compressed: from the first query that sees the tile's first entry to the end, masked only where
visibility changes; local: the ``span`` queries after each key), recomputes P and dP transposed and accumulates
dk, dv in fp32. When there are few key tiles the compressed pass splits the queries into chunks whose fp32 partial
sums are added afterwards in a fixed order. Every output element is written by exactly one program: no atomics,
deterministic, no uninitialised memory.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ckv_kernels._common import INTERPRET, autotune
from ckv_kernels.attention_common import (
    INTERPRETER_CONFIG,
    LOG2E,
    Problem,
    load,
    prune_rows,
    rows,
    tile_config,
    visible,
)

__all__ = ["KEY_CONFIGS", "key_kernel", "run_key"]

# Candidates for Hopper as for the query pass (attention_fwd.QUERY_CONFIGS).
KEY_CONFIGS = [
    tile_config(64, 32, 8, 2),
    tile_config(32, 64, 8, 2),
    tile_config(32, 32, 8, 2),
    tile_config(16, 64, 8, 2),
    tile_config(32, 32, 4, 3),
]


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    i, row, row_ok = rows(i0, Tq, H, kv, G, G_PAD, BLOCK_M)
    d = tl.arange(0, D)
    q_offs = row[:, None] * D + d[None, :]
    q = load(Q + q_offs, row_ok[:, None], UPCAST)  # (BLOCK_M, D); padded rows are 0 and contribute 0
    do = load(DO + q_offs, row_ok[:, None], UPCAST)
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    p = tl.exp2(tl.dot(key, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
    if MASKED:
        vis = visible(q_start + i[None, :], cols[:, None], E, stride, k_start, span, COMPRESSED, TAIL)
        p = tl.where(vis & row_ok[None, :], p, 0.0)
    dv += tl.dot(p.to(do.dtype), do)
    ds = p * (tl.dot(val, tl.trans(do)) - delta[None, :])
    dk += tl.dot(ds.to(q.dtype), q)
    return dk, dv


@autotune(
    KEY_CONFIGS,
    INTERPRETER_CONFIG,
    key=["Tq", "n_keys", "chunk", "D", "G_PAD", "TAIL", "COMPRESSED"],
    prune=prune_rows,
)
@triton.jit
def key_kernel(
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
    ``split_stride`` elements apart; the rest as in query_kernel."""
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
    key = load(KEY + offs, cols[:, None] < n_keys, UPCAST)
    val = load(VAL + offs, cols[:, None] < n_keys, UPCAST)
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


def _key_chunk(prob: Problem, n_keys: int, device: torch.device) -> int:
    """Queries per program of the compressed dk/dv pass (a multiple of 128). With few key tiles (short
    compressed axis, few KV heads) the queries are split over up to 16 programs per tile so the GPU fills
    up; their fp32 partial sums are added in a fixed order (deterministic). The interpreter splits long
    inputs too, so that tests cover the path."""
    tiles = triton.cdiv(n_keys, 64) * prob.B * prob.KV
    wanted = 4 if INTERPRET else triton.cdiv(2 * _multiprocessors(device), tiles)
    n = max(1, min(wanted, 16, triton.cdiv(prob.Tq, 128)))
    return triton.cdiv(triton.cdiv(prob.Tq, n), 128) * 128


def run_key(
    prob: Problem,
    q: torch.Tensor,
    key: torch.Tensor,
    val: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    compressed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dk, dv of one source (compressed entries or exact keys)."""
    n_keys = key.shape[1]
    chunk = _key_chunk(prob, n_keys, q.device) if compressed else triton.cdiv(prob.Tq, 128) * 128
    n_chunks = triton.cdiv(prob.Tq, chunk)
    if n_chunks == 1:
        dkey, dval, split_stride = torch.empty_like(key), torch.empty_like(val), 0
    else:  # fp32 partial sums, one slice per chunk, every element written
        dkey = key.new_empty((n_chunks, *key.shape), dtype=torch.float32)
        dval, split_stride = torch.empty_like(dkey), key.numel()
    key_kernel[lambda meta: (triton.cdiv(n_keys, meta["BLOCK_N"]), n_chunks, prob.B * prob.KV)](
        q,
        key,
        val,
        do,
        lse,
        delta,
        dkey,
        dval,
        prob.Tq,
        n_keys,
        prob.E,
        prob.KV,
        prob.q_start,
        prob.k_start,
        prob.stride,
        prob.span,
        chunk,
        split_stride,
        prob.sm_scale * LOG2E,
        prob.sm_scale,
        G=prob.G,
        G_PAD=prob.g_pad,
        D=prob.D,
        TAIL=prob.tail,
        COMPRESSED=compressed,
        UPCAST=prob.upcast,
    )
    if n_chunks > 1:
        dkey, dval = dkey.sum(0).to(key.dtype), dval.sum(0).to(val.dtype)
    return dkey, dval
