"""DeepSeek-V4's low-rank query path (``attention.query``; null: one full-rank query map)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ckv.checks import check_int
from ckv.options.base import Dims, OptionGroup


@dataclass
class QueryConfig(OptionGroup):
    """Queries through a rank-``lora_rank`` latent: ``latent = RMSNorm(A x)`` (a down-projection ``A`` to
    ``lora_rank`` dims and a weighted RMSNorm), then ``q = B latent`` (the up-projection to the heads), V4's
    ``q_a_proj``, ``q_a_norm``, ``q_b_proj``; the per-head query norm and RoPE follow as without it. The lightning
    indexer (``attention.selection``) reads its queries from the same latent.

    An option group rather than a field: like the other groups it is off by default (null), validates itself and
    declares its own shares here, which replace the full-rank map's ``d * H * D`` parameters by
    ``lora_rank * (d + 1 + H * D)`` (and the same maps' FLOPs: ``2 * lora_rank * (d + H * D)`` per token instead of
    ``2 * d * H * D``); it also sets the width of the latent the indexer reads (``Dims.query_latent``)."""

    name: ClassVar[str] = "query"
    flop_line: ClassVar[str] = "projections"  # it replaces the full-rank query map: its saving is the projections'
    lora_rank: int = 64

    def __post_init__(self) -> None:
        check_int("attention.query.lora_rank", self.lora_rank, minimum=1)

    def num_params(self, dims: Dims) -> int:
        full = dims.d_model * dims.n_heads * dims.head_dim  # the full-rank map it replaces
        return self.lora_rank * (dims.d_model + 1 + dims.n_heads * dims.head_dim) - full

    def flops_per_token(self, dims: Dims) -> float:
        full = dims.d_model * dims.n_heads * dims.head_dim
        return 2.0 * (self.lora_rank * (dims.d_model + dims.n_heads * dims.head_dim) - full)

    def activation_elements_per_token(self, dims: Dims) -> float:
        return 2.0 * self.lora_rank  # the latent before and after its norm
