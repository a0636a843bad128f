"""Token mixing before pooling (``attention.mixing``; null: none): its config, its module and its accounting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import nn

from ckv.checks import ConfigError, check_choice, check_int
from ckv.options.base import Dims, OptionGroup

INITS = ("normal", "zero")


@dataclass
class MixingConfig(OptionGroup):
    """A causal depthwise convolution over each compressor branch's input, ``m_t = h_t + sum_k w_k h_{t-k}``
    with ``kernel`` taps (2..stride; null: the stride), so a window's first token carries its predecessors.
    ``init``: the taps start from Normal(0, init_std) like every map (``normal``) or at 0 (``zero``: the mixed
    model starts as its unmixed twin exactly). Per branch: ``kernel * d_model`` parameters and
    ``2 * kernel * d_model`` FLOPs per token; the decode cache keeps ``kernel - 1`` hidden states before the next
    window."""

    name: ClassVar[str] = "mixing"
    per_branch: ClassVar[bool] = True
    kernel: Optional[int] = None
    init: str = "normal"

    def __post_init__(self) -> None:
        if self.kernel is not None:
            check_int("attention.mixing.kernel", self.kernel, minimum=2)
        check_choice("attention.mixing.init", self.init, INITS)

    def check_stride(self, stride: int) -> None:
        if self.kernel is not None and self.kernel > stride:
            raise ConfigError(f"attention.mixing.kernel={self.kernel} must be <= attention.stride={stride}")
        if self.kernel is None and stride < 2:
            raise ConfigError("attention.mixing needs attention.stride >= 2 (a kernel of 2..stride taps)")

    def taps(self, stride: int) -> int:
        """The kernel's taps at ``stride`` (the stride itself when ``kernel`` is null)."""
        return stride if self.kernel is None else self.kernel

    def build(self, d_model: int, stride: int) -> CausalMixing:
        """The module one compressor branch applies to its input."""
        return CausalMixing(d_model, self.taps(stride), init=self.init)

    def num_params(self, dims: Dims) -> int:
        return dims.branches * self.taps(dims.stride) * dims.d_model

    def flops_per_token(self, dims: Dims) -> float:
        return dims.branches * 2.0 * self.taps(dims.stride) * dims.d_model

    def cache_history(self, dims: Dims) -> int:
        return self.taps(dims.stride) - 1


class CausalMixing(nn.Module):
    """``m_t = h_t + sum_{k=0}^{K-1} w_k * h_{t-k}`` per channel (``K = kernel`` taps), with zero history before
    the first hidden state given. The residual ``h_t`` keeps the map near the identity at the model's small normal
    init (exactly the identity with ``init="zero"``), so a mixed compressor starts close to its unmixed twin.
    ``weight`` is (K, d), tap ``k`` multiplying the token ``k`` steps back."""

    def __init__(self, d_model: int, kernel: int, init: str = "normal") -> None:
        super().__init__()
        self.kernel, self.init = kernel, init
        self.weight = nn.Parameter(torch.empty(kernel, d_model))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        if self.init == "zero":
            self.weight.zero_()
        else:
            self.weight.normal_(0.0, std)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, T, d) consecutive hidden states; returns (B, T, d). Rows ``0..K-2`` see zeros before row 0:
        they are exact only when row 0 is position 0 (callers keep ``K - 1`` extra states otherwise)."""
        T = h.shape[1]
        padded = nn.functional.pad(h, (0, 0, self.kernel - 1, 0))  # (B, T + K - 1, d), zeros before row 0
        out = h
        for k in range(self.kernel):  # tap k reads the token k steps back
            out = out + self.weight[k] * padded[:, self.kernel - 1 - k : self.kernel - 1 - k + T]
        return out
