"""Pooling of chunked-compressor windows into entries, the kernel and its launcher: one body, the forward and, with
``BWD``, the backward. The autograd Function and the wrapper are in ``pool``; the oracle is
``ckv.attention.reference.pool_reference``.

Each program pools ``BLOCK_E`` entries of one (batch, KV head): it loads the (BLOCK_E, W, D) payload tile once,
turns the window's gate logits (scalar: one per offset; vector: one per offset and channel) into softmax weights
over the *present* offsets (``present`` False marks window positions before position 0), or takes the uniform mean
over present offsets, and reduces over the window in fp32. Any ``window`` (including ``window > stride`` and non
powers of two) works: the window axis is padded to a power of two and masked. The backward recomputes the weights
from the logits (nothing but the inputs is saved) and writes d payload and d logits in the same single pass over
the tile.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["MEAN", "SCALAR", "VECTOR", "launch_pool", "pool_blocks", "pool_kernel"]

# GATE: uniform mean, one logit per offset, one logit per offset and channel (jit globals must be constexpr)
MEAN, SCALAR, VECTOR = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_TILE_ELEMENTS = 2048  # elements of one (BLOCK_E, BLOCK_W, BLOCK_D) tile (no spills on sm_90 at 4 warps)


@triton.jit
def pool_kernel(
    P,
    LOGIT,
    PRESENT,
    OUT,
    ALPHA,
    DOUT,
    DP,
    DLOGIT,
    E,
    W,
    KV,
    D,
    GATE: tl.constexpr,
    BWD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Forward (BWD=False): OUT (B, E, KV, D) = sum_w alpha * P, and ALPHA (B, E, W, KV, G) for gates.
    Backward (BWD=True): DP = alpha * DOUT, and for gates DLOGIT = alpha * (u - sum_w alpha * u) with
    u = DOUT * P (summed over channels for the scalar gate). P: (B, E, W, KV, D); PRESENT: (E, W) uint8."""
    b = tl.program_id(1) // KV
    kv = tl.program_id(1) % KV
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)[:, None, None]  # (BE, 1, 1)
    w = tl.arange(0, BLOCK_W)[None, :, None]  # (1, BW, 1)
    d = tl.arange(0, BLOCK_D)[None, None, :]  # (1, 1, BD)
    present = tl.load(PRESENT + e * W + w, mask=(e < E) & (w < W), other=0) != 0  # (BE, BW, 1)
    slot = ((b * E + e) * W + w).to(tl.int64) * KV + kv  # (BE, BW, 1): index of (b, e, w, kv)
    p_mask = present & (d < D)
    p = tl.load(P + slot * D + d, mask=p_mask, other=0.0).to(tl.float32)  # (BE, BW, BD)

    if GATE == MEAN:
        alpha = present.to(tl.float32) / tl.maximum(tl.sum(present.to(tl.float32), axis=1, keep_dims=True), 1.0)
    else:
        if GATE == SCALAR:
            logit_offs = slot  # (BE, BW, 1)
            logit_mask = present
            logit_store = (e < E) & (w < W)
        else:
            logit_offs = slot * D + d  # (BE, BW, BD)
            logit_mask = p_mask
            logit_store = (e < E) & (w < W) & (d < D)
        s = tl.load(LOGIT + logit_offs, mask=logit_mask, other=0.0).to(tl.float32)
        s = tl.where(logit_mask, s, float("-inf"))
        m = tl.max(s, axis=1, keep_dims=True)
        m = tl.where(m == float("-inf"), 0.0, m)  # a window with nothing present pools to 0, not NaN
        ex = tl.where(logit_mask, tl.exp(s - m), 0.0)
        alpha = ex / tl.maximum(tl.sum(ex, axis=1, keep_dims=True), 1e-30)  # (BE, BW, 1 | BD)

    if not BWD:
        pooled = tl.sum(alpha * p, axis=1)  # (BE, BD)
        e2 = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)[:, None]
        d2 = tl.arange(0, BLOCK_D)[None, :]
        out_offs = ((b * E + e2).to(tl.int64) * KV + kv) * D + d2
        tl.store(OUT + out_offs, pooled.to(OUT.dtype.element_ty), mask=(e2 < E) & (d2 < D))
        if GATE != MEAN:
            tl.store(ALPHA + logit_offs, alpha.to(ALPHA.dtype.element_ty), mask=logit_store)
    else:
        dout_offs = ((b * E + e).to(tl.int64) * KV + kv) * D + d  # (BE, 1, BD)
        dout = tl.load(DOUT + dout_offs, mask=(e < E) & (d < D), other=0.0).to(tl.float32)
        tl.store(DP + slot * D + d, (alpha * dout).to(DP.dtype.element_ty), mask=(e < E) & (w < W) & (d < D))
        if GATE != MEAN:
            u = dout * p  # (BE, BW, BD)
            if GATE == SCALAR:
                u = tl.sum(u, axis=2, keep_dims=True)  # (BE, BW, 1)
            dlogit = alpha * (u - tl.sum(alpha * u, axis=1, keep_dims=True))
            tl.store(DLOGIT + logit_offs, dlogit.to(DLOGIT.dtype.element_ty), mask=logit_store)


def pool_blocks(W: int, D: int) -> tuple[int, int, int]:
    """``(BLOCK_E, BLOCK_W, BLOCK_D)`` of a launch over windows of ``W`` offsets and ``D`` channels: the window and
    channel axes padded to powers of two, as many entries as fill a tile of 2048 elements."""
    block_w, block_d = triton.next_power_of_2(W), triton.next_power_of_2(D)
    return max(1, _TILE_ELEMENTS // (block_w * block_d)), block_w, block_d


def launch_pool(
    payload: torch.Tensor, logits: Optional[torch.Tensor], present_u8: torch.Tensor, dout: Optional[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Run the kernel forward (``dout is None``: returns pooled, alpha-or-None) or backward (returns d payload,
    d logits-or-None). All tensors contiguous."""
    B, E, W, KV, D = payload.shape
    gate = (MEAN if logits is None else SCALAR if logits.shape[-1] == 1 else VECTOR).value
    block_e, block_w, block_d = pool_blocks(W, D)
    grid = (triton.cdiv(E, block_e), B * KV)
    lg = logits if logits is not None else payload  # unused pointer when pooling is the mean
    if dout is None:
        out = payload.new_empty(B, E, KV, D)
        alpha = None if logits is None else payload.new_empty(logits.shape)
        if E:
            pool_kernel[grid](
                payload,
                lg,
                present_u8,
                out,
                alpha if alpha is not None else out,
                out,
                out,
                out,
                E,
                W,
                KV,
                D,
                GATE=gate,
                BWD=False,
                BLOCK_E=block_e,
                BLOCK_W=block_w,
                BLOCK_D=block_d,
            )
        return out, alpha
    dp = torch.empty_like(payload)
    dlogit = None if logits is None else torch.empty_like(logits)
    if E:
        pool_kernel[grid](
            payload,
            lg,
            present_u8,
            dout,
            dp,
            dout,
            dp,
            dlogit if dlogit is not None else dp,
            E,
            W,
            KV,
            D,
            GATE=gate,
            BWD=True,
            BLOCK_E=block_e,
            BLOCK_W=block_w,
            BLOCK_D=block_d,
        )
    return dp, dlogit
