"""Top-k selection of compressed entries (``attention.selection``; null: every visible entry is attended, dense
selection): by DeepSeek-V4's lightning indexer, or by the main attention's own scores (an oracle for studies)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ckv.checks import ConfigError, check_choice, check_int
from ckv.options.base import Dims, OptionGroup
from ckv.options.rope import RopeConfig

BY = ("indexer", "oracle")  # what ranks the entries: the lightning indexer, or the main attention's dense mass
# how the selection's index queries and keys are fake-quantised, and the block of head_dim dims sharing one scale:
# fp8 (e4m3) in blocks of 128 as DeepSeek-V3.2's indexer (``act_quant(q, block_size=128)``), fp4 (e2m1) in
# blocks of 32 as the MXFP4 format
QUANT_BLOCK = {"none": 0, "fp8": 128, "fp4": 32}


@dataclass
class SelectionConfig(OptionGroup):
    """V4's lightning indexer (``ckv.attention.indexer``): each query attends to the ``topk`` visible entries it
    scores highest, ``sum_h w_h * relu(q_h . k_s)`` over ``heads`` index heads of ``head_dim`` dims, next to its
    local window and sinks. ``k_s`` comes from the indexer's own compressor branch at ``head_dim`` (one key per
    entry, pooled over the layer's windows with the layer's maps, gate and mixing, then its norm and RoPE);
    ``q_h`` from the query latent (``attention.query``; the layer's input without it); ``w_h`` from the input.
    Defaults: V4-Flash's 512 entries, 64 heads of 128 dims.

    Shares: the index-query map (``query_latent * heads * head_dim``) and the head-weight map (``d * heads``) here,
    the compressor branch through the backend (``compressor_branches``); ``2 * heads * (head_dim + 1)`` FLOPs per
    (query, visible entry) to score; attention over ``min(visible, topk)`` entries per query; the decode cache
    keeps the indexer's ``head_dim`` key per finished entry.

    ``by``: ``indexer`` (the above) or ``oracle``: each query keeps the ``topk`` visible entries on which the
    layer's own DENSE joint softmax (every visible entry, the local window and the sinks in one softmax) puts the
    most probability summed over query heads, ``sum_h exp(q_h . k_s / sqrt(D) - lse_h)``: the target the indexer's
    training loss fits (``ckv.train.indexer``), so the oracle is a perfect indexer, and a study can tell "the
    indexer picks wrong" from "top-k itself loses the record". It has no parameters (no indexer module: ``heads``
    and ``head_dim`` are unused), no extra cache, and costs one dense attention pass per layer for its log-sum-exp
    (``flops_per_scored_entry``: ``4 H D`` per (query, visible entry); the local window's share is not counted).

    ``quant``: ``none`` (fp32 scores), ``fp8`` or ``fp4``: the scores that select read index queries and keys
    fake-quantised to that format with one fp32 scale per block of ``QUANT_BLOCK`` head dims (the whole head when
    ``head_dim`` is smaller), as the real models serve their indexer (``ckv.attention.indexer.fake_quant``); the
    indexer's training loss stays fp32. Indexer only."""

    name: ClassVar[str] = "selection"
    flop_line: ClassVar[str] = "indexer"
    topk: int = 512
    heads: int = 64
    head_dim: int = 128
    by: str = "indexer"
    quant: str = "none"

    def __post_init__(self) -> None:
        for field in ("topk", "heads", "head_dim"):
            check_int(f"attention.selection.{field}", getattr(self, field), minimum=1)
        check_choice("attention.selection.by", self.by, BY)
        check_choice("attention.selection.quant", self.quant, tuple(QUANT_BLOCK))
        if self.quant != "none" and self.oracle:
            raise ConfigError(
                f"attention.selection.quant={self.quant!r} quantises the lightning indexer, but by='oracle' has none"
            )
        block = QUANT_BLOCK[self.quant]
        if block and self.head_dim > block and self.head_dim % block:
            raise ConfigError(
                f"attention.selection.head_dim={self.head_dim} must be a multiple of quant={self.quant!r}'s block of "
                f"{block} dims (or at most {block})"
            )

    @property
    def oracle(self) -> bool:
        """Whether the main attention's own scores select (no indexer module)."""
        return self.by == "oracle"

    def check_rope(self, rope: RopeConfig) -> None:
        """Raise ConfigError if the indexer's keys cannot hold the rotated dims of the layer's ``rope``."""
        if self.oracle:
            return
        rotated = self.rotated_dims(rope.mode, rope.dims)
        if rotated > self.head_dim or rotated % 2:
            raise ConfigError(
                f"attention.selection.head_dim={self.head_dim} must hold the indexer's rotated dims ({rotated}: "
                f"attention.rope mode={rope.mode!r}, dims={rope.dims}) and be even when every dim rotates"
            )

    def rotated_dims(self, mode: str, dims: int | None) -> int:
        """How many of the indexer's ``head_dim`` dims rotate: all (``full``), the layer's ``dims`` (``partial``,
        V4: its ``qk_rope_head_dim``), or none."""
        return {"full": self.head_dim, "partial": dims or 0, "none": 0}[mode]

    def branch(self, dims: Dims) -> Dims:
        """The indexer's compressor branch: one key of ``head_dim`` per entry."""
        return dataclasses.replace(dims, kv_heads=1, head_dim=self.head_dim, branches=1)

    def latent(self, dims: Dims) -> int:
        """Width of the query latent the index queries are mapped from."""
        return dims.query_latent or dims.d_model

    def num_params(self, dims: Dims) -> int:
        if self.oracle:
            return 0
        return self.latent(dims) * self.heads * self.head_dim + dims.d_model * self.heads

    def flops_per_token(self, dims: Dims) -> float:
        if self.oracle:
            return 0.0
        return 2.0 * (self.latent(dims) * self.heads * self.head_dim + dims.d_model * self.heads)

    def compressor_branches(self, dims: Dims) -> list[Dims]:
        return [] if self.oracle else [self.branch(dims)]

    def attended_entries(self, visible: int) -> int:
        return min(visible, self.topk)

    def flops_per_scored_entry(self, dims: Dims) -> float:
        if self.oracle:  # the dense pass: q . k_s and p . v_s per query head
            return 4.0 * dims.n_heads * dims.head_dim
        return 2.0 * self.heads * (self.head_dim + 1)  # q_h . k_s per head, then the weighted sum over heads

    def activation_elements_per_token(self, dims: Dims) -> float:
        if self.oracle:  # computed without gradients: nothing kept for backward
            return 0.0
        return 2.0 * self.heads * self.head_dim + self.heads  # index queries before and after RoPE, head weights
