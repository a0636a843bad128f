"""What every attention option group shares: the sizes its accounting reads, and the contributions it declares.

An option group (``RopeConfig``, ``GateConfig``, ``MixingConfig``, ``GridConfig``, ...) is a small dataclass held
by ``AttentionConfig`` under its ``name``. It validates its own fields on construction, checks what it needs of
the rest of the attention config in ``check_with`` and of the model's sizes in ``check_model``, and declares
beside its definition what it adds to one layer: parameters, forward FLOPs (per pooled entry and per token) and
decode-cache state. The attention backends sum these declarations; nothing else recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # annotations only: the config module imports the groups
    from ckv.config import AttentionConfig, ModelConfig


@dataclass(frozen=True)
class Dims:
    """The sizes of one compressed-attention layer that an option's accounting reads.

    ``maps`` is the number of payload/gate maps per compressor branch (``window`` offset-specific maps, one per
    stride block for per-series maps, or 1 shared); ``branches`` is 2 (separate K and V compressors) or 1 (tied)."""

    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    window: int
    stride: int
    maps: int
    branches: int


class OptionGroup:
    """Base of the attention option groups: no contribution unless a group declares one.

    ``name`` is the group's key in ``AttentionConfig`` (and its Hydra group under ``conf/attention/<name>/``)."""

    name: ClassVar[str]

    def check_with(self, attention: AttentionConfig) -> None:
        """Raise ConfigError naming the field if this group cannot work with the rest of ``attention``."""

    def check_model(self, config: ModelConfig) -> None:
        """Raise ConfigError naming the field if this group cannot work with the model's sizes."""

    def num_params(self, dims: Dims) -> int:
        """Parameters this group adds to one layer."""
        return 0

    def flops_per_entry(self, dims: Dims) -> float:
        """Forward FLOPs this group adds per pooled entry of one layer (all compressor branches)."""
        return 0.0

    def flops_per_token(self, dims: Dims) -> float:
        """Forward FLOPs this group adds per token of one layer, independent of the sequence length."""
        return 0.0

    def cache_history(self, dims: Dims) -> int:
        """Hidden states before a window that the decode cache keeps in addition to the window's own."""
        return 0
