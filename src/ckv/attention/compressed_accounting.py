"""The compressed backend's accounting, from the config alone (``AttentionBackend``'s interface, docs/attention.md
"Accounting"): parameters, FLOPs per token, the decode cache's parts, prefill and training working memory, and
activations. ``CompressedAttention`` (``attention/compressed.py``) subclasses ``CompressedAccounting``.
``joint_working_bytes`` (the joint softmax's working memory) also prices a layer that reads another layer's entries
(cross-layer KV sharing).
"""

from __future__ import annotations

from typing import Optional

import torch

from ckv.attention.base import AttentionBackend, LayerFlops
from ckv.attention.blocked import choose_block, working_bytes
from ckv.attention.dispatch import REFERENCE_MAX_SCORES, resolve_impl, triton_available
from ckv.attention.indexer import index_peak_bytes, index_working_bytes, kl_working_bytes, query_chunk
from ckv.config import ConfigError, ModelConfig
from ckv.geometry import (
    grid_origin,
    local_keep,
    local_span,
    local_start,
    num_entries,
    pending_keep,
    shifted_origin,
    visible_entries,
)
from ckv.options import Dims


def layer_grids(config: ModelConfig, layer_idx: int) -> list[tuple[int, slice]]:
    """The window grids of layer ``layer_idx``: ``(origin, KV heads)`` for each, its grid coordinate of real
    position 0 (``geometry.grid_origin``) and the KV heads it serves. One grid for every KV head, or with
    ``attention.grid.per: kv_head`` one per KV head."""
    origins = [grid_origin(o, config.attention.stride) for o in config.grid_offsets(layer_idx)]
    if len(origins) == 1:
        return [(origins[0], slice(0, config.kv_heads))]
    return [(P, slice(h, h + 1)) for h, P in enumerate(origins)]


def entry_origins(config: ModelConfig, origin: int) -> list[int]:
    """The origins of the sets of entries a grid at ``origin`` attends to: its own, and with dual-offset
    compression (``attention.dual_offset``, not a multiple of the stride) the grid moved by that offset
    (``geometry.shifted_origin``)."""
    a = config.attention
    if not a.dual_offset:
        return [origin]
    return [origin, shifted_origin(origin, a.dual_offset, a.stride)]


def joint_working_bytes(
    impl: str,
    device: torch.device,
    chunk: int,
    entries: int,
    local: int,
    config: ModelConfig,
    *,
    topk: Optional[int] = None,
    sink: bool = False,
    bytes_per_element: int = 4,
) -> float:
    """Working memory of one joint softmax of ``chunk`` queries over ``entries`` entries and a band of ``local``
    exact keys, with ``config``'s heads and head size, by the implementation ``impl`` runs as on ``device``
    (``resolve_impl``: ``auto`` picks by the call's size off CUDA): with the reference four fp32 copies of the
    ``(H, chunk, entries + local [+ sink])`` scores (scores, their concatenation with the local window's, the
    masked copy, ``exp``) and each query's local keys and values, gathered; with the fast path one query block's
    (``blocked.choose_block``, ``blocked.working_bytes``: the backward's pass, the larger); with the Triton kernels
    none (they read the band in place)."""
    if impl != "triton":  # resolve_impl refuses triton off CUDA outside the interpreter: the estimate does not run it
        impl = resolve_impl(impl, device, chunk * (entries + local))
    H, KV, D = config.n_heads, config.kv_heads, config.head_dim
    if impl == "triton":
        return 0.0
    if impl == "torch":
        sizes = (entries, local, H, D, topk, 1, KV)
        return float(working_bytes(choose_block(chunk, *sizes), *sizes))
    gathered = 2 * chunk * local * KV * D  # each query's local keys and values
    return bytes_per_element * (4 * H * chunk * (entries + local + (1 if sink else 0)) + gathered)


class CompressedAccounting(AttentionBackend):
    """The figures of a compressed attention layer from its config (per layer; the option groups declare their
    own shares), which ``ckv.flops``, ``ckv.train.plan`` and the memory estimates ask for: ``num_params``,
    ``flops_per_token`` (over ``entry_pairs``), ``kv_elements_per_token`` / ``kv_bytes_per_token`` (the parts of
    ``CompressedLayerCache``), ``prefill_bytes``, ``working_bytes``, ``activation_elements_per_token``."""

    @staticmethod
    def dims(config: ModelConfig) -> Dims:
        """The sizes the option groups' accounting reads."""
        a = config.attention
        maps = {"specific": a.window, "series": a.window // a.stride}.get(a.offset_maps, 1)
        return Dims(
            d_model=config.d_model,
            n_heads=config.n_heads,
            kv_heads=config.kv_heads,
            head_dim=config.head_dim,
            window=a.window,
            stride=a.stride,
            maps=maps,
            branches=1 if a.tied_kv else 2,
            query_latent=config.d_model if a.query is None else a.query.lora_rank,
        )

    @classmethod
    def extra_branches(cls, config: ModelConfig) -> list[Dims]:
        """The compressor branches option groups add beside the layer's K/V branches (the indexer's), as ``Dims``."""
        dims = cls.dims(config)
        return [b for g in config.attention.groups() for b in g.compressor_branches(dims)]

    @classmethod
    def num_params(cls, config: ModelConfig) -> int:
        """Projections, each compressor branch's payload maps and key norm (the layer's K/V and the groups' extra
        branches), the sinks, and the groups' shares (per-branch groups once more for each extra branch)."""
        a, dims, extra = config.attention, cls.dims(config), cls.extra_branches(config)
        payload = sum(b.branches * b.maps * b.d_model * b.kv_heads * b.head_dim for b in (dims, *extra))
        norm = sum(b.head_dim for b in (dims, *extra)) if a.qk_norm else 0  # each branch's compressed-key RMSNorm
        sinks = config.n_heads if a.sink else 0  # one attention-sink logit per query head
        groups = sum(g.num_params(dims) for g in a.groups())
        groups += sum(g.num_params(b) for b in extra for g in a.groups() if g.per_branch)
        return cls.projection_params(config) + payload + norm + sinks + groups

    @classmethod
    def entry_pairs(cls, config: ModelConfig, seq_len: int, layer_idx: int = 0) -> tuple[int, int]:
        """Over ``seq_len`` tokens of layer ``layer_idx``, summed over its query heads: the (query, key) pairs
        scored (each query's attended entries, ``min(visible, topk)`` with selection, plus its local window's
        exact keys) and the (query, visible entry) pairs, each grid in its own coordinates (with dual-offset
        compression, the moved grid's visible entries too)."""
        a, G = config.attention, config.n_heads // config.kv_heads
        pairs, visible_pairs = 0, 0
        for P, heads in layer_grids(config, layer_idx):  # grid coordinates g = t + P, present from P
            q_heads = G * (heads.stop - heads.start)
            for t in range(seq_len):  # real positions
                local = t + P - max(local_start(t + P, a.local_window, a.stride), P) + 1
                visible = sum(
                    min(visible_entries(t + Pi, a.stride), num_entries(seq_len + Pi, a.stride))
                    for Pi in entry_origins(config, P)
                )
                attended = visible
                for group in a.groups():
                    attended = group.attended_entries(attended)
                pairs += q_heads * (attended + max(local, 0))
                visible_pairs += q_heads * visible
        return pairs, visible_pairs

    @classmethod
    def visible_pairs(cls, config: ModelConfig, seq_len: int, layer_idx: int = 0) -> float:
        """(query, key) pairs a query head scores over ``seq_len`` tokens in layer ``layer_idx`` (the mean over
        its query heads, which differ only when KV heads have grids of their own): each query's attended entries
        (every visible one, or its top-k with selection) plus its local window's exact keys."""
        return cls.entry_pairs(config, seq_len, layer_idx)[0] / config.n_heads

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int, layer_idx: int = 0) -> LayerFlops:
        """Attention over the scored pairs (``entry_pairs``), counted in the layer's grid coordinates
        (``ckv.geometry``). The compressor maps every entry's ``window`` hidden states (absent ones too: they are
        computed as zeros) through each branch's payload maps and sums them, plus the groups' shares. Each group's
        shares go on its ``flop_line``: the layer's K/V branches and the gate and mixing on ``compressor``; the
        low-rank query path's on ``projections`` (it replaces the full-rank query map); selection's (the
        indexer's own branch with the per-branch groups once more, its maps, and its scoring of every visible
        entry) on ``indexer``."""
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        a, dims = config.attention, cls.dims(config)
        # entries pooled, weighted by the share of KV heads each grid serves (useful work only)
        n_entries = sum(
            num_entries(seq_len + Pi, a.stride) * (heads.stop - heads.start) / config.kv_heads
            for P, heads in layer_grids(config, layer_idx)
            for Pi in entry_origins(config, P)
        )
        pairs, visible = cls.entry_pairs(config, seq_len, layer_idx)
        visible /= config.n_heads  # the indexer scores per query, not per query head
        per_branch = [g for g in a.groups() if g.per_branch]

        def pooling(b: Dims) -> float:  # per entry: a branch's payload maps and its weighted sum, its groups
            payload = b.window * 2.0 * b.d_model * b.kv_heads * b.head_dim + 2.0 * b.window * b.kv_heads * b.head_dim
            return b.branches * payload + sum(g.flops_per_entry(b) for g in per_branch)

        lines = {"projections": cls.projection_flops(config), "compressor": pooling(dims), "indexer": 0.0}
        lines["compressor"] += sum(g.flops_per_entry(dims) for g in a.groups() if not g.per_branch)
        lines["compressor"] *= n_entries / seq_len
        for g in a.groups():
            extra = g.compressor_branches(dims)
            share = sum(pooling(b) for b in extra) * n_entries / seq_len
            share += g.flops_per_token(dims) + sum(p.flops_per_token(b) for b in extra for p in per_branch)
            share += g.flops_per_scored_entry(dims) * visible / seq_len
            lines[g.flop_line] += share
        return LayerFlops(attention=4.0 * config.head_dim * pairs / seq_len, **lines)

    @classmethod
    def kv_elements_per_token(
        cls, config: ModelConfig, seq_len: Optional[int] = None, layer_idx: int = 0
    ) -> dict[str, float]:
        """At ``seq_len``, by the parts of ``CompressedLayerCache``: ``entries`` (each finished entry's key, and a
        value unless tied; the key's rotated dims apart as ``entries.rope``), ``index`` (each extra branch's key
        per finished entry: the indexer's), ``local`` (the exact keys and values the next query's local window
        needs; rotated dims as ``local.rope``) and ``pending`` (the hidden states of the unfinished window plus the
        groups' history), divided by ``seq_len``. Long-sequence figure: one entry per ``stride`` tokens."""
        if seq_len is None:
            return {part: n / config.attention.stride for part, n in cls._kv_elements(config, None, layer_idx).items()}
        return {part: n / seq_len for part, n in cls._kv_elements(config, seq_len, layer_idx).items()}

    @classmethod
    def _kv_elements(cls, config: ModelConfig, seq_len: Optional[int], layer_idx: int) -> dict[str, float]:
        """``kv_elements_per_token`` times ``seq_len`` (``None``: one entry's worth, nothing else)."""
        a, dims = config.attention, cls.dims(config)
        rope = dims.kv_heads * config.rope_dims  # a key's rotated dims
        per_local = dims.kv_heads * dims.head_dim * (1 if a.tied_kv else 2)
        per_index = sum(b.kv_heads * b.head_dim for b in cls.extra_branches(config))
        if seq_len is None:
            entries, local, pending = float(len(entry_origins(config, 0))), 0.0, 0.0  # per set of entries
        elif seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        else:
            history = sum(g.cache_history(dims) for g in a.groups())
            entries = local = pending = 0.0
            for P, heads in layer_grids(config, layer_idx):  # one sub-cache per grid: its heads' share, own pending
                share, origins = (heads.stop - heads.start) / config.kv_heads, entry_origins(config, P)
                local += share * local_keep(seq_len + P, a.local_window, a.stride, origin=P)
                entries += share * sum(num_entries(seq_len + Pi, a.stride) for Pi in origins)  # the moved grid's too
                # the states the next entry of each grid attended needs (dual-offset compression: both grids')
                keep = max(pending_keep(seq_len + Pi, a.window, a.stride, origin=Pi) for Pi in origins) + history
                pending += min(keep, seq_len) * dims.d_model
        return {
            "entries": entries * (per_local - rope),
            "entries.rope": entries * rope,
            "index": entries * per_index,
            "local": local * (per_local - rope),
            "local.rope": local * rope,
            "pending": pending,
        }

    @classmethod
    def kv_bytes_per_token(
        cls, config: ModelConfig, seq_len: Optional[int] = None, layer_idx: int = 0, bytes_per_element: int = 2
    ) -> float:
        """Every part of ``kv_elements_per_token`` at ``bytes_per_element``."""
        total = sum(cls._kv_elements(config, seq_len, layer_idx).values())
        return total * bytes_per_element / (config.attention.stride if seq_len is None else seq_len)

    @classmethod
    def prefill_bytes(
        cls, config: ModelConfig, chunk: int, seq_len: int, device: torch.device, bytes_per_element: int = 4
    ) -> float:
        """The chunk's pooled windows plus the joint softmax's working memory (``joint_working_bytes`` over the
        entries of ``seq_len`` tokens and the local window). Dual-offset compression's second pass (the moved
        grid's entries, no local window) runs after the first and pools and scores no more than it: the peak is
        the first's."""
        a = config.attention
        topk = a.selection.topk if a.selection is not None else None
        E, L = num_entries(seq_len, a.stride), local_span(a.local_window, a.stride)
        joint = joint_working_bytes(
            a.impl, device, chunk, E, L, config, topk=topk, sink=a.sink, bytes_per_element=bytes_per_element
        )
        return cls._pooled_bytes(config, chunk, bytes_per_element) + joint

    @classmethod
    def _pooled_bytes(cls, config: ModelConfig, chunk: int, bytes_per_element: int = 4) -> float:
        """The windows of hidden states a chunk of ``chunk`` queries pools, per compressor branch."""
        a = config.attention
        return bytes_per_element * cls.dims(config).branches * (chunk // a.stride + 1) * a.window * config.d_model

    @classmethod
    def index_bytes(cls, config: ModelConfig, chunk: int, seq_len: int) -> float:
        """The lightning indexer's working memory for ``chunk`` queries over ``seq_len`` tokens (0 without one): one
        of its own query chunks (the chunk ``indexer.query_chunk`` sizes by ``indexer.index_working_bytes`` from
        ``WORKING_BYTES``) at what it holds there, ``indexer.index_peak_bytes``: one fp32 ``(chunk, heads,
        entries)`` copy of the dots (``index_scores`` ReLUs and weighs them in place; with under three heads
        ``top_k``'s fix of tied rows, 12 bytes per score, is the larger) and the fp32 ``(chunk, entries)`` scores.
        The CPU measurement (``tests/eval/test_memory.py``, ``ckv_compressed_indexer``, where the indexer sets the
        peak) is 1.00-1.02x the estimate; counting ``index_working_bytes``' two copies plus a third, 0.36x."""
        s = config.attention.selection
        if s is None or s.oracle:
            return 0.0
        E = num_entries(seq_len, config.attention.stride)
        c = min(chunk, query_chunk(index_working_bytes(1, 1, s.heads, E), chunk))
        return float(index_peak_bytes(1, c, s.heads, E))

    @classmethod
    def kl_bytes(cls, config: ModelConfig, tokens: int, seq_len: int) -> float:
        """The indexer loss's working memory over ``tokens`` queries of a ``seq_len``-token sequence in training (0
        without an indexer): one of its query chunks (``attention.indexer.kl_working_bytes``), the larger of the dense
        stage (every visible entry) and the sparse one (the top-k, their keys gathered)."""
        a, s = config.attention, config.attention.selection
        if s is None or s.oracle:
            return 0.0
        H, E = config.n_heads, num_entries(seq_len, a.stride)
        stages = ((E, 0), (min(s.topk, E), config.kv_heads * config.head_dim + 2 * s.head_dim))  # (entries, gathered)
        worst = 0
        for entries, gathered in stages:
            c = min(tokens, query_chunk(kl_working_bytes(1, 1, H, s.heads, entries, gathered), tokens))
            worst = max(worst, kl_working_bytes(1, c, H, s.heads, entries, gathered))
        return float(worst)

    @classmethod
    def working_bytes(cls, config: ModelConfig, seq_len: int, device: torch.device) -> dict[str, float]:
        """The joint softmax's working memory for the whole sequence (``prefill_bytes`` less its pooled windows:
        autograd keeps those), the indexer's scores (``index_bytes``) and its loss's logits (``kl_bytes``)."""
        a = config.attention
        parts = {"attention": cls.prefill_bytes(config, seq_len, seq_len, device) - cls._pooled_bytes(config, seq_len)}
        if a.selection is not None and not a.selection.oracle:
            parts.update({"index scores": cls.index_bytes(config, seq_len, seq_len), "KL logits": cls.kl_bytes(
                config, seq_len, seq_len)})  # fmt: skip
        return parts

    @classmethod
    def prefill_note(cls, config: ModelConfig, device: torch.device) -> str:
        notes = {
            "reference": "torch reference: 4 fp32 copies of (B, H, c, entries + local window) scores",
            "torch": "fast torch path: one query block's scores at a time (blocked.working_bytes)",
            "triton": "Triton kernels: no score matrix",
        }
        impl = config.attention.impl
        if impl == "auto" and not (device.type == "cuda" and triton_available()):
            return (
                f"ckv compressed attention, auto: the {notes['reference']} up to {REFERENCE_MAX_SCORES:,} per "
                f"(B, H), else the {notes['torch']}"
            )
        return "ckv compressed attention, " + notes[resolve_impl(impl, device) if impl != "triton" else "triton"]

    @classmethod
    def activation_elements_per_token(cls, config: ModelConfig) -> float:
        """Projections as every backend, plus each token's share of the pooled windows: ``window / stride``
        copies of the hidden state and, per branch, a payload and its normalised copy (``2 KV D``; extra branches
        gather their own copy of the windows), plus the groups' own activations."""
        a, dims, extra = config.attention, cls.dims(config), cls.extra_branches(config)
        pooled = sum(b.d_model + b.branches * 2 * b.kv_heads * b.head_dim for b in (dims, *extra))
        groups = sum(g.activation_elements_per_token(dims) for g in a.groups())
        return super().activation_elements_per_token(config) + a.window / a.stride * pooled + groups

    @classmethod
    def phase_stride(cls, config: ModelConfig) -> Optional[int]:
        return config.attention.stride

    @classmethod
    def shared_kv(cls, config: ModelConfig, layer_idx: int) -> tuple[int, tuple[int, ...]]:
        """A source publishes its entries, ``stride`` positions each, of its grid (``layer_grids``) and, with
        dual-offset compression, of the moved grid (``entry_origins``); not with one grid per KV head."""
        grids = layer_grids(config, layer_idx)
        if len(grids) > 1:
            raise ConfigError(
                "attention.grid.per='kv_head' gives each KV head its own grid of entries, which other layers cannot "
                "read as one set: give the source one grid (attention.grid.per: layer)"
            )
        return config.attention.stride, tuple(entry_origins(config, grids[0][0]))
