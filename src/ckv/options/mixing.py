"""Token mixing before pooling (``attention.mixing``; null: none)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from ckv.checks import ConfigError, check_int
from ckv.options.base import Dims, OptionGroup

if TYPE_CHECKING:
    from ckv.config import AttentionConfig


@dataclass
class MixingConfig(OptionGroup):
    """A causal depthwise convolution over each compressor branch's input, ``m_t = h_t + sum_k w_k h_{t-k}``
    with ``kernel`` taps (2..stride; null: the stride), so a window's first token carries its predecessors.
    Per branch: ``kernel * d_model`` parameters and ``2 * kernel * d_model`` FLOPs per token; the decode cache
    keeps ``kernel - 1`` hidden states before the next window."""

    name: ClassVar[str] = "mixing"
    per_branch: ClassVar[bool] = True
    kernel: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kernel is not None:
            check_int("attention.mixing.kernel", self.kernel, minimum=2)

    def check_with(self, attention: AttentionConfig) -> None:
        if self.kernel is not None and self.kernel > attention.stride:
            raise ConfigError(f"attention.mixing.kernel={self.kernel} must be <= attention.stride={attention.stride}")
        if self.kernel is None and attention.stride < 2:
            raise ConfigError("attention.mixing needs attention.stride >= 2 (a kernel of 2..stride taps)")

    def taps(self, stride: int) -> int:
        """The kernel's taps at ``stride`` (the stride itself when ``kernel`` is null)."""
        return stride if self.kernel is None else self.kernel

    def num_params(self, dims: Dims) -> int:
        return dims.branches * self.taps(dims.stride) * dims.d_model

    def flops_per_token(self, dims: Dims) -> float:
        return dims.branches * 2.0 * self.taps(dims.stride) * dims.d_model

    def cache_history(self, dims: Dims) -> int:
        return self.taps(dims.stride) - 1
