"""Causal grouped-query attention through SDPA (flash-attn when installed, on CUDA, in fp16/bf16)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ckv.attention.base import AttentionBackend
from ckv.cache import FullLayerCache


@functools.lru_cache(maxsize=1)
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func  # type: ignore

        return flash_attn_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int = 0) -> torch.Tensor:
    """q: (B, Tq, H, D) at positions ``q_start..``; k, v: (B, Tk, KV, D) at positions ``0..Tk-1`` with
    ``Tk = q_start + Tq``. Returns (B, Tq, H, D)."""
    Tq, Tk = q.shape[1], k.shape[1]
    flash = _flash_attn_func()
    if flash is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash(q, k, v, causal=True)  # bottom-right aligned causal mask, native GQA
    G = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)  # (B, H, Tq, D)
    kt = k.transpose(1, 2).repeat_interleave(G, dim=1)  # (B, H, Tk, D)
    vt = v.transpose(1, 2).repeat_interleave(G, dim=1)
    if Tq == Tk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        q_pos = torch.arange(q_start, q_start + Tq, device=q.device)
        mask = torch.arange(Tk, device=q.device)[None, :] <= q_pos[:, None]  # (Tq, Tk)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(1, 2)


class FullAttention(AttentionBackend):
    """Full causal attention: every query sees every earlier token exactly."""

    kind = "full"
    impls = ("auto", "torch")
    features = ("gqa", "qk_norm", "rope_full", "rope_partial", "rope_none", "kv_cache", "flash_attn")

    def forward(self, x: torch.Tensor, cache: Optional[FullLayerCache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        q, k, v = self.project(x, torch.arange(start, start + T, device=x.device))
        if cache is not None:
            k, v = cache.append(k, v)
        out = causal_attention(q, k, v, q_start=start)  # (B, T, H, D)
        return self.o_proj(out.reshape(B, T, -1))

    def new_cache(self, batch_size: int) -> FullLayerCache:
        return FullLayerCache()
