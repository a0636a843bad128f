"""Pooling of chunked-compressor windows into entries: the public wrapper ``pool`` (input checks) and its
``autograd.Function``; the kernel and its launcher are in ``pool_kernel``. The oracle is
``ckv.attention.reference.pool_reference``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ckv_kernels._common import check_float, check_runnable
from ckv_kernels.pool_kernel import launch_pool

__all__ = ["PoolFunction", "pool"]


class PoolFunction(torch.autograd.Function):
    """Autograd for the pooling kernel; alpha is returned for analyses and is not differentiable."""

    @staticmethod
    def forward(ctx, payload: torch.Tensor, logits: Optional[torch.Tensor], present: torch.Tensor):
        present_u8 = present.to(torch.uint8).contiguous()
        pooled, alpha = launch_pool(payload, logits, present_u8, None)
        ctx.save_for_backward(payload, logits, present_u8)
        if alpha is not None:
            ctx.mark_non_differentiable(alpha)
        return pooled, alpha

    @staticmethod
    def backward(ctx, dpooled: torch.Tensor, _dalpha: Optional[torch.Tensor]):
        payload, logits, present_u8 = ctx.saved_tensors
        dp, dlogit = launch_pool(payload, logits, present_u8, dpooled.contiguous())
        return dp, dlogit, None


def pool(
    payload: torch.Tensor, logits: Optional[torch.Tensor], present: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool each window of the chunked compressor into one entry (Triton; same contract as
    ``ckv.attention.reference.pool_reference``).

    payload: (B, E, W, KV, D), W = window length, any W >= 1 and any D; logits: (B, E, W, KV, G) with G = 1
    (scalar gate) or G = D (vector gate), or None for the uniform mean over present offsets; present: (E, W)
    bool, False for window positions before position 0.
    Returns pooled (B, E, KV, D) in payload's dtype (fp32 accumulation) and the weights alpha, summing to 1 over
    present offsets: (B, E, W, KV, G) for gates, (1, E, W, 1, 1) for the mean. A window with no present offset
    pools to 0. Gradients flow to payload and logits.
    """
    if payload.dim() != 5:
        raise ValueError(f"payload must be (B, E, W, KV, D), got shape {tuple(payload.shape)}")
    B, E, W, KV, D = payload.shape
    check_float("payload", payload)
    if tuple(present.shape) != (E, W) or present.dtype != torch.bool:
        raise ValueError(
            f"present must be a bool tensor of shape (E, W) = {(E, W)}, got {present.dtype} {tuple(present.shape)}"
        )
    tensors = [payload, present]
    if logits is not None:
        check_float("logits", logits)
        if logits.dim() != 5 or tuple(logits.shape[:4]) != (B, E, W, KV) or logits.shape[4] not in (1, D):
            raise ValueError(
                f"logits must be (B, E, W, KV, 1 or D) = {(B, E, W, KV)} + (1 | {D}), got {tuple(logits.shape)}"
            )
        tensors.append(logits)
    check_runnable(*tensors)
    pooled, alpha = PoolFunction.apply(payload.contiguous(), None if logits is None else logits.contiguous(), present)
    if alpha is None:  # the mean's weights depend on the geometry only (as in the reference)
        alpha = (present / present.sum(-1, keepdim=True).clamp_min(1)).to(payload.dtype)[None, :, :, None, None]
    return pooled, alpha
