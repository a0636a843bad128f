"""Rotary position embedding: full, partial (the leading ``rope_dims`` dims of each head) or none."""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """Rotates the leading ``rope_dims`` dims of every head at the given positions (HF Qwen3's convention:
    ``x * cos + rotate_half(x) * sin`` with ``inv_freq = theta ** (-2i / rope_dims)``)."""

    def __init__(self, rope_dims: int, theta: float) -> None:
        super().__init__()
        self.rope_dims = rope_dims
        inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dims, 2, dtype=torch.int64).float() / max(rope_dims, 1)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (B, T, H, D); positions: (T,) int. Returns x rotated, same shape and dtype."""
        r = self.rope_dims
        if r == 0:
            return x
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # (T, r/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, r)
        cos = emb.cos().to(x.dtype)[None, :, None, :]  # (1, T, 1, r)
        sin = emb.sin().to(x.dtype)[None, :, None, :]
        xr = x[..., :r]
        rotated = xr * cos + rotate_half(xr) * sin
        if r == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., r:]), dim=-1)
