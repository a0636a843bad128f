"""What every attention option group shares: the sizes its accounting reads, and the contributions it declares.

An option group (``RopeConfig``, ``GateConfig``, ``MixingConfig``, ``GridConfig``, ...) is a small dataclass held
by an attention kind's config under its ``name``. It validates its own fields on construction, checks them against
plain values, never against the config that holds it: the compressor's stride in ``check_stride``, the model's
layer and head counts in ``check_model``. It declares beside its definition what it adds to one layer (from
``Dims``): parameters, forward FLOPs (per pooled entry and per token) and decode-cache state. The attention
backends sum these declarations; nothing else recomputes them.

A group whose shares scale with the compressor's branches (``per_branch``: the gate, token mixing) is counted
again for every extra branch another group adds (``compressor_branches``: the lightning indexer's own compressor,
pooled over the same windows with the layer's maps, gate and mixing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Dims:
    """The sizes of one compressed-attention layer that an option's accounting reads.

    ``maps`` is the number of payload/gate maps per compressor branch (``window`` offset-specific maps, one per
    stride block for per-series maps, or 1 shared); ``branches`` is 2 (separate K and V compressors) or 1 (tied);
    ``query_latent`` is the width of the query latent (the low-rank query path's rank; ``d_model`` without one)."""

    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    window: int
    stride: int
    maps: int
    branches: int
    query_latent: int = 0


class OptionGroup:
    """Base of the attention option groups: no contribution unless a group declares one.

    ``name`` is the group's key in the attention config (and its Hydra group under ``conf/attention/<name>/``)."""

    name: ClassVar[str]
    per_branch: ClassVar[bool] = False  # its shares scale with ``dims.branches`` (counted for extra branches too)
    # the ``LayerFlops`` line its FLOPs (and those of the compressor branches it adds) are counted on
    flop_line: ClassVar[str] = "compressor"

    def check_stride(self, stride: int) -> None:
        """Raise ConfigError naming the field if this group cannot work with the compressor's ``stride``."""

    def check_model(self, n_layers: int, kv_heads: int, head_dim: int) -> None:
        """Raise ConfigError naming the field if this group cannot work with a model of ``n_layers`` layers,
        ``kv_heads`` KV heads (the attention's, or the model's) and heads of ``head_dim`` dims."""

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

    def compressor_branches(self, dims: Dims) -> list[Dims]:
        """Extra compressor branches this group adds to the layer, as the ``Dims`` of each (``branches=1``): each
        pools the same windows with the layer's maps and per-branch groups, and the decode cache keeps its
        ``kv_heads * head_dim`` elements per finished entry."""
        return []

    def attended_entries(self, visible: int) -> int:
        """Compressed entries a query attends when ``visible`` entries are visible to it (all of them)."""
        return visible

    def flops_per_scored_entry(self, dims: Dims) -> float:
        """Forward FLOPs this group spends per (query, visible entry) pair, e.g. to score entries for selection."""
        return 0.0

    def activation_elements_per_token(self, dims: Dims) -> float:
        """Activation elements autograd saves per token for this group's own maps (``ckv.train.plan``)."""
        return 0.0
