"""Rotary position embedding: full, partial (``rope_dims`` leading or trailing dims of each head) or none, with
dims paired as halves (HF Qwen3) or interleaved (DeepSeek-V4)."""

from __future__ import annotations

import torch
from torch import nn

from ckv.options.rope import PAIRINGS as ROPE_PAIRINGS
from ckv.options.rope import SIDES as ROPE_SIDES


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved counterpart of ``rotate_half``: (x0, x1, x2, x3, ..) -> (-x1, x0, -x3, x2, ..)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class Rotary(nn.Module):
    """Rotates ``rope_dims`` dims of every head at the given positions: ``x * cos + rot(x) * sin`` with
    ``inv_freq = theta ** (-2i / rope_dims)``. ``side`` picks the leading (HF Qwen3) or trailing (DeepSeek-V4)
    dims; ``pairing`` rotates dim ``i`` with ``i + rope_dims/2`` ("half", ``rotate_half``) or dim ``2i`` with
    ``2i+1`` ("interleaved", ``rotate_pairs``)."""

    def __init__(self, rope_dims: int, theta: float, side: str = "leading", pairing: str = "half") -> None:
        super().__init__()
        if side not in ROPE_SIDES or pairing not in ROPE_PAIRINGS:
            raise ValueError(f"side={side!r} must be one of {ROPE_SIDES}, pairing={pairing!r} one of {ROPE_PAIRINGS}")
        self.rope_dims, self.side, self.pairing = rope_dims, side, pairing
        inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dims, 2, dtype=torch.int64).float() / max(rope_dims, 1)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: (B, T, H, D); positions: (T,) int. Returns x rotated by ``positions`` (by ``-positions`` when
        ``inverse``), same shape and dtype."""
        r = self.rope_dims
        if r == 0:
            return x
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # (T, r/2)
        if self.pairing == "half":
            emb, rot = torch.cat((freqs, freqs), dim=-1), rotate_half  # (T, r)
        else:
            emb, rot = freqs.repeat_interleave(2, dim=-1), rotate_pairs
        cos = emb.cos().to(x.dtype)[None, :, None, :]  # (1, T, 1, r)
        sin = emb.sin().to(x.dtype)[None, :, None, :]
        if inverse:
            sin = -sin
        D = x.shape[-1]
        lead = 0 if self.side == "leading" else D - r  # first rotated dim
        xr = x[..., lead : lead + r]
        rotated = xr * cos + rot(xr) * sin
        if r == D:
            return rotated
        return torch.cat((x[..., :lead], rotated, x[..., lead + r :]), dim=-1)
