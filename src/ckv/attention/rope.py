"""Rotary position embedding: full, partial (``rope_dims`` leading or trailing dims of each head) or none, with
dims paired as halves (HF Qwen3) or interleaved (DeepSeek-V4), optionally YaRN-scaled (DeepSeek-V4's compressed
layers)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ckv.options.rope import PAIRINGS as ROPE_PAIRINGS
from ckv.options.rope import SIDES as ROPE_SIDES
from ckv.options.rope import YarnConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved counterpart of ``rotate_half``: (x0, x1, x2, x3, ..) -> (-x1, x0, -x3, x2, ..)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def inverse_frequencies(rope_dims: int, theta: float, yarn: Optional[YarnConfig] = None) -> torch.Tensor:
    """(rope_dims / 2,) fp32: ``theta ** (-2i / rope_dims)``, or with ``yarn`` each blended with itself divided by
    ``yarn.factor`` by YaRN's linear ramp (``YarnConfig``; transformers' ``_compute_yarn_parameters``)."""
    base = theta ** (torch.arange(0, rope_dims, 2, dtype=torch.int64).float() / max(rope_dims, 1))
    if yarn is None:
        return 1.0 / base

    def correction_dim(rotations: float) -> float:  # the dim whose pair turns ``rotations`` times
        return rope_dims * math.log(yarn.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dims - 1)
    ramp = (torch.arange(rope_dims // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)
    extrapolated = 1 - ramp.clamp(0, 1)  # 1: the pair keeps its frequency, 0: divided by the factor
    return (1.0 / (yarn.factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated


class Rotary(nn.Module):
    """Rotates ``rope_dims`` dims of every head at the given positions: ``x * cos + rot(x) * sin`` with
    ``inv_freq = theta ** (-2i / rope_dims)`` (YaRN-scaled with ``yarn``, ``inverse_frequencies``). ``side`` picks
    the leading (HF Qwen3) or trailing (DeepSeek-V4) dims; ``pairing`` rotates dim ``i`` with ``i + rope_dims/2``
    ("half", ``rotate_half``) or dim ``2i`` with ``2i+1`` ("interleaved", ``rotate_pairs``)."""

    inv_freq: torch.Tensor  # (rope_dims / 2,) fp32, a buffer: the public surface of the module

    def __init__(
        self,
        rope_dims: int,
        theta: float,
        side: str = "leading",
        pairing: str = "half",
        yarn: Optional[YarnConfig] = None,
    ) -> None:
        super().__init__()
        if side not in ROPE_SIDES or pairing not in ROPE_PAIRINGS:
            raise ValueError(f"side={side!r} must be one of {ROPE_SIDES}, pairing={pairing!r} one of {ROPE_PAIRINGS}")
        self.rope_dims, self.side, self.pairing = rope_dims, side, pairing
        self.register_buffer("inv_freq", inverse_frequencies(rope_dims, theta, yarn), persistent=False)

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
