"""What the joint-attention passes share (``attention_fwd``, ``attention_bwd``, ``attention_select``): the head
dims they support, the pieces of their autotuning, the jit building blocks that restate the geometry
(``local_lo``, ``visible``) and lay out a tile's rows (``rows``, ``load``), and ``Problem``, one call's sizes and
geometry turned into kernel arguments.

Rows (docs/kernels.md has the full picture): a tile packs ``BLOCK_Q = BLOCK_M // G_PAD`` consecutive query
positions times the ``G`` query heads of one KV head (``G_PAD``: G rounded up to a power of two, padded heads
masked), so each K/V tile loaded serves the whole GQA group. Row ``r`` is query ``i0 + r // G_PAD``, head
``kv * G + r % G_PAD``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ckv_kernels._common import upcast_loads

__all__ = [
    "INTERPRETER_CONFIG",
    "LOG2E",
    "SUPPORTED_HEAD_DIMS",
    "Problem",
    "load",
    "local_lo",
    "prune_rows",
    "rows",
    "tile_config",
    "visible",
]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634  # log2(e); the kernels write the literal (jit globals must be constexpr)


def prune_rows(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """A row tile must hold at least one query position of the whole (padded) GQA group."""
    g_pad = kwargs.get("G_PAD", named_args.get("G_PAD"))
    return [c for c in configs if c.kwargs["BLOCK_M"] >= g_pad]  # both lists hold BLOCK_M = 64 >= any G_PAD


def tile_config(m: int, n: int, warps: int, stages: int) -> triton.Config:
    """An autotune config of ``BLOCK_M`` rows and ``BLOCK_N`` keys per tile."""
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)


# The one config of the dense query and key kernels under the interpreter (it can neither benchmark nor run several).
INTERPRETER_CONFIG = tile_config(64, 32, 4, 1)


@triton.jit
def local_lo(t, stride, span, TAIL: tl.constexpr):
    """First exact key position of the local window of the query at t (may exceed t: empty window): the last
    ``span`` tokens, or in TAIL mode the tokens of t's unfinished stride block (``ckv.geometry.local_start``).
    Plain arithmetic, so the launcher evaluates it in Python too (``local_lo.fn``)."""
    if TAIL:
        return ((t + 1) // stride) * stride
    return t - span + 1


@triton.jit
def visible(t, col, E, stride, k_start, span, COMPRESSED: tl.constexpr, TAIL: tl.constexpr):
    """Whether column ``col`` (entry index, or exact-key index at position ``k_start + col``) is visible to the
    query at position ``t`` (geometry.compressed_mask / local_mask); t and col broadcast."""
    if COMPRESSED:
        return col < tl.minimum((t + 1) // stride, E)
    p = k_start + col
    return (p >= local_lo(t, stride, span, TAIL)) & (p <= t)


@triton.jit
def rows(i0, Tq, H, kv, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row layout of a tile starting at query index i0: query index, offset of the (query, head) row inside
    one batch's (Tq, H) plane, and validity."""
    r = tl.arange(0, BLOCK_M)
    i = i0 + r // G_PAD
    g = r % G_PAD
    return i, i * H + kv * G + g, (i < Tq) & (g < G)


@triton.jit
def load(ptrs, mask, UPCAST: tl.constexpr):
    """``tl.load`` with 0 where masked, converted to fp32 with UPCAST."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:  # the interpreter reads bf16 as raw bits unless converted right away
        x = x.to(tl.float32)
    return x


class Problem:
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

    def query_arguments(
        self, tensors: tuple[torch.Tensor, ...], bwd: bool, sinks: Optional[torch.Tensor]
    ) -> tuple[tuple, tuple, dict]:
        """What the query kernels (dense and top-k) take besides their own: ``tensors`` = (q, kc, vc, k, v, o,
        lse, do, dq, delta) with the sink pointer appended, the geometry, and the constexpr flags."""
        tensors = (*tensors, tensors[6] if sinks is None else sinks)  # SINK unread without sinks
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
        return tensors, geometry, flags
