"""The learned pooling gate (``attention.gate``; null: uniform averaging over the window's present offsets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ckv.checks import check_bool, check_choice
from ckv.options.base import Dims, OptionGroup

KINDS = ("scalar", "vector")


@dataclass
class GateConfig(OptionGroup):
    """A learned softmax gate over each window's offsets: logits ``s_i = Z_i h_i + b_i`` (maps ``Z`` per
    ``attention.offset_maps``: one per offset, one per stride-block series, or one shared), weights
    ``alpha = softmax_i(s_i)`` over the present offsets. ``kind``: one weight per KV head (``scalar``) or per
    channel (``vector``); ``bias``: the offset-specific bias ``b_i``. Per branch: ``maps * d_model * g`` map
    parameters plus ``window * g`` bias (``g`` = KV heads, or KV heads x head_dim), and ``2 * d_model * g`` FLOPs
    per pooled offset."""

    name: ClassVar[str] = "gate"
    per_branch: ClassVar[bool] = True
    kind: str = "scalar"
    bias: bool = True

    def __post_init__(self) -> None:
        check_choice("attention.gate.kind", self.kind, KINDS)
        check_bool("attention.gate.bias", self.bias)

    def gate_dim(self, kv_heads: int, head_dim: int) -> int:
        """Gate logits per token: one per KV head (scalar) or one per channel (vector)."""
        return kv_heads if self.kind == "scalar" else kv_heads * head_dim

    def num_params(self, dims: Dims) -> int:
        g = self.gate_dim(dims.kv_heads, dims.head_dim)
        return dims.branches * (dims.maps * dims.d_model * g + (dims.window * g if self.bias else 0))

    def flops_per_entry(self, dims: Dims) -> float:
        return dims.branches * dims.window * 2.0 * dims.d_model * self.gate_dim(dims.kv_heads, dims.head_dim)
