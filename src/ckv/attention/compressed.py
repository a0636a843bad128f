"""Chunked KV compression with joint attention (docs/attention.md).

Each window of ``window`` tokens, moved by ``stride``, is pooled into one key and one value per KV head by a
learned softmax gate or a uniform mean; a query attends in one softmax to every visible entry plus the exact
keys of its local window. ``impl`` picks the implementation of the joint softmax: ``reference`` (the PyTorch
oracle, ``attention/reference.py``), ``torch`` (the fast, memory-bounded block path, ``attention/blocked.py``),
``triton`` (the kernels) or ``auto`` (``resolve_impl``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from ckv.attention.base import AttentionBackend, LayerFlops
from ckv.attention.blocked import choose_block, joint_attention_blocked, working_bytes
from ckv.attention.compressed_config import CompressedAttentionConfig
from ckv.attention.indexer import (
    LightningIndexer,
    index_working_bytes,
    kl_working_bytes,
    oracle_selection,
    query_chunk,
)
from ckv.attention.reference import joint_attention_reference, pool_reference
from ckv.cache import CompressedLayerCache
from ckv.config import ConfigError, ModelConfig
from ckv.geometry import (
    LocalWindow,
    entry_rope_position,
    entry_start,
    grid_origin,
    local_keep,
    local_span,
    local_start,
    num_entries,
    offset_series,
    pending_keep,
    visible_entries,
    window_positions,
)
from ckv.norm import RMSNorm
from ckv.options import Dims

IMPLS = ("auto", "reference", "torch", "triton")
# ``auto`` off CUDA runs the reference for a call whose score matrix per (batch, head), queries x (entries + local
# span), has at most this many elements, the fast path above: the reference is exact to the last digit of every
# study run before the fast path existed (66-token tasks), and cheap at that size; the fast path differs from it by
# summation order (~1e-7 relative).
REFERENCE_MAX_SCORES = 2**16


def resolve_impl(impl: str, device: torch.device, scores: Optional[int] = None) -> str:
    """``auto`` -> ``triton`` on CUDA (when ckv_kernels imports); elsewhere the fast path ``torch``, or the
    ``reference`` when the call's ``scores`` (queries x (entries + local span), per batch row and head) are at most
    ``REFERENCE_MAX_SCORES`` (None: size unknown, the fast path). ``triton`` on a non-CUDA device runs the kernels
    under the Triton interpreter (slow: meant for tests); it says so once, and raises RuntimeError when the
    interpreter is not enabled (TRITON_INTERPRET=1 before ckv_kernels is imported)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {list(IMPLS)}")
    if impl == "auto":
        if device.type == "cuda" and _triton_available():
            return "triton"
        return "reference" if scores is not None and scores <= REFERENCE_MAX_SCORES else "torch"
    if impl == "triton" and device.type != "cuda":
        _check_interpreter(device)
    return impl


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    try:
        import ckv_kernels  # noqa: F401

        return True
    except ImportError:
        return False


_interpreter_announced = False


def _check_interpreter(device: torch.device) -> None:
    """Allow impl='triton' off CUDA only under the Triton interpreter, and say so once per process."""
    global _interpreter_announced
    if not _triton_available():
        raise RuntimeError("attention.impl='triton' needs the ckv_kernels package and triton (pip install '.[gpu]')")
    import ckv_kernels

    if not ckv_kernels.INTERPRET:
        raise RuntimeError(
            f"attention.impl='triton' on {device.type} runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before ckv_kernels is imported (tests do), or use impl='auto' / 'torch' off CUDA"
        )
    if not _interpreter_announced:
        _interpreter_announced = True
        warnings.warn(
            f"attention.impl='triton' on {device.type}: the Triton kernels run under the interpreter "
            "(TRITON_INTERPRET=1), which is correct but very slow",
            RuntimeWarning,
            stacklevel=3,
        )


def pool(
    payload: torch.Tensor, logits: Optional[torch.Tensor], present: torch.Tensor, impl: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch of ``reference.pool_reference`` (see there for shapes): returns pooled entries and weights. Every
    impl but ``triton`` pools with the reference (one pass over the windows; the torch paths share it)."""
    if resolve_impl(impl, payload.device) == "triton":
        from ckv_kernels import pool as pool_triton

        return pool_triton(payload, logits, present)
    return pool_reference(payload, logits, present)


def joint_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    local_window: LocalWindow,
    q_start: int = 0,
    impl: str = "auto",
    sinks: Optional[torch.Tensor] = None,
    origin: int = 0,
    selected: Optional[torch.Tensor] = None,
    block: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint softmax of ``reference.joint_attention_reference`` (see there for shapes, ``origin`` and the
    top-k ``selected`` entries per query) by ``impl`` (``resolve_impl``: ``auto`` decides per call by size off
    CUDA; ``block``: the fast path's queries per block, None to choose); returns the output (B, Tq, H, D) and the
    joint softmax's log-sum-exp (B, Tq, H) fp32, which carries a gradient under ``reference`` only (no caller
    differentiates it). A layer with a shifted grid passes ``q_start`` in grid coordinates and its ``origin``."""
    scores = q.shape[1] * (kc.shape[1] + local_span(local_window, stride))
    impl = resolve_impl(impl, q.device, scores)
    if impl == "triton":
        from ckv_kernels import joint_attention as joint_attention_triton

        return joint_attention_triton(
            q,
            kc,
            vc,
            k,
            v,
            stride=stride,
            local_span=local_span(local_window, stride),
            tail=local_window == "tail",
            q_start=q_start,
            sinks=sinks,
            origin=origin,
            selected=selected,
        )
    joint = dict(stride=stride, local_window=local_window, q_start=q_start, sinks=sinks, origin=origin)
    if impl == "torch":
        return joint_attention_blocked(q, kc, vc, k, v, **joint, selected=selected, block=block)
    return joint_attention_reference(q, kc, vc, k, v, **joint, selected=selected)


class JointAttention(nn.Module):
    """The joint softmax of a compressed layer as a submodule without parameters or state, so that a forward hook
    can read its inputs (queries, entries, the selection) and its log-sum-exp (the indexer's training target,
    ``ckv.train.indexer``): ``forward`` takes ``joint_attention``'s arguments and returns ``(out, lse)``."""

    def forward(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        stride: int,
        local_window: LocalWindow,
        q_start: int = 0,
        impl: str = "auto",
        sinks: Optional[torch.Tensor] = None,
        origin: int = 0,
        selected: Optional[torch.Tensor] = None,
        block: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return joint_attention(
            q,
            kc,
            vc,
            k,
            v,
            stride=stride,
            local_window=local_window,
            q_start=q_start,
            impl=impl,
            sinks=sinks,
            origin=origin,
            selected=selected,
            block=block,
        )


class Pooling(nn.Module):
    """The pooling step of a compressor as a submodule without parameters or state, so that a forward hook can
    read the weights: ``forward(payload, logits, present, impl)`` returns ``(pooled, alpha)`` (see ``pool``)."""

    def forward(
        self, payload: torch.Tensor, logits: Optional[torch.Tensor], present: torch.Tensor, impl: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pool(payload, logits, present, impl=impl)


class Compressor(nn.Module):
    """One branch (keys or values) of the chunked compressor.

    Offset-specific maps (``offset_maps="specific"``): gate logits ``s_i = Z_i h_i + b_i`` and payload
    ``C_i h_i`` with one ``Z_i``, ``C_i`` per offset ``i``; shared maps (DeepSeek style): one ``Z`` and ``C`` for
    all offsets and an offset-specific bias ``b_i`` only; per-series maps (DeepSeek-V4's CSA): one ``Z_s``,
    ``C_s`` per series ``s = i // stride`` (``geometry.offset_series``) and the offset-specific bias. Parameters
    are stacked offset-first (series-first for per-series maps) so that gate cycling is ``torch.roll(..., dims=0)``.
    With ``attention.mixing`` set the branch owns the module that group builds (``mixing``,
    ``ckv.options.mixing.CausalMixing``), which the layer applies to the hidden-state sequence before windows are
    gathered (a window's first token then carries its predecessors).
    ``kv_heads`` and ``head_dim`` (default: the model's) size the pooled output: the lightning indexer's branch
    pools one key of its own ``head_dim`` (``attention.selection``).
    """

    def __init__(self, config: ModelConfig, kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> None:
        super().__init__()
        a = config.attention
        d, W = config.d_model, a.window
        self.kv_heads = config.kv_heads if kv_heads is None else kv_heads
        self.head_dim = config.head_dim if head_dim is None else head_dim
        self.window = W
        out = self.kv_heads * self.head_dim
        self.specific = a.offset_maps == "specific"
        # per-series maps: the series of each offset, (W,); None for offset-specific or shared maps
        self.register_buffer(
            "series", offset_series(W, a.stride) if a.offset_maps == "series" else None, persistent=False
        )
        lead = (W,) if self.specific else (W // a.stride,) if self.series is not None else ()
        self.payload = nn.Parameter(torch.empty(*lead, d, out))  # C_i: (W, d, KV*D) or C: (d, KV*D)
        gate = a.gate  # None: uniform averaging
        self.gate_dim = 0 if gate is None else gate.gate_dim(self.kv_heads, self.head_dim)
        self.gate_weight = None if gate is None else nn.Parameter(torch.empty(*lead, d, self.gate_dim))
        self.gate_bias = nn.Parameter(torch.zeros(W, self.gate_dim)) if gate is not None and gate.bias else None
        self.pooling = Pooling()  # analyses hook it to read the gate weights alpha
        self.mixing = None if a.mixing is None else a.mixing.build(d, a.stride)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Normal(0, std) for the payload and gate maps; gate biases 0 (a uniform gate); the mixing initialises its
        own taps (``attention.mixing.init``)."""
        for p in (self.payload, self.gate_weight):
            if p is not None:
                p.normal_(0.0, std)
        if self.gate_bias is not None:
            self.gate_bias.zero_()
        if self.mixing is not None:
            self.mixing.init_weights(std)

    def _map(self, hw: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.specific:
            return torch.einsum("bewd,wdo->bewo", hw, weight)
        if self.series is not None:
            return torch.einsum("bewd,wdo->bewo", hw, weight[self.series])  # (W, d, o): each offset's series map
        return hw @ weight

    def forward(
        self, hw: torch.Tensor, present: torch.Tensor, impl: str = "torch", norm: Optional[nn.Module] = None
    ) -> torch.Tensor:
        """hw: (B, E, W, d) hidden states of each entry's window (zeros where absent); present: (E, W); ``norm``
        (the layer's compressed-key RMSNorm in "pre" mode) is applied to each token's payload before pooling.
        Returns the pooled payload (B, E, KV, D)."""
        B, E, W, _ = hw.shape
        payload = self._map(hw, self.payload).view(B, E, W, self.kv_heads, self.head_dim)
        if norm is not None:
            payload = norm(payload)
        logits = None
        if self.gate_weight is not None:
            logits = self._map(hw, self.gate_weight)  # (B, E, W, G)
            if self.gate_bias is not None:
                logits = logits + self.gate_bias
            logits = logits.view(B, E, W, self.kv_heads, self.gate_dim // self.kv_heads)
        pooled, _ = self.pooling(payload, logits, present, impl=impl)
        return pooled


def layer_grids(config: ModelConfig, layer_idx: int) -> list[tuple[int, slice]]:
    """The window grids of layer ``layer_idx``: ``(origin, KV heads)`` for each, its grid coordinate of real
    position 0 (``geometry.grid_origin``) and the KV heads it serves. One grid for every KV head, or with
    ``attention.grid.per: kv_head`` one per KV head."""
    origins = [grid_origin(o, config.attention.stride) for o in config.grid_offsets(layer_idx)]
    if len(origins) == 1:
        return [(origins[0], slice(0, config.kv_heads))]
    return [(P, slice(h, h + 1)) for h, P in enumerate(origins)]


class CompressedAttention(AttentionBackend):
    """Joint attention over chunk-compressed entries and an exact local window.

    With ``attention.grid`` the layer's grid is shifted by ``grid_offset`` (``config.grid_offset(layer_idx)``):
    entries, visibility, the local window and the decode cache's keeps are computed in grid coordinates
    ``g = p + origin`` (``geometry.grid_origin``), positions below ``origin`` absent; RoPE stays at real positions.
    With ``attention.grid.per: kv_head`` each KV head has its own grid (``grids``): the layer pools, keeps and
    attends once per grid, its query heads' share each time, with one decode sub-cache per grid.
    With ``attention.selection`` the lightning indexer (``indexer``, ``ckv.attention.indexer``) picks each query's
    top-k entries from its own compressor branch's keys (or, with ``selection.by: oracle``, the layer's own dense
    joint softmax does: ``oracle_topk``); with ``attention.query`` queries come from V4's low-rank
    latent (``query_latent``), which the indexer reads too. The joint softmax runs in the parameter-free ``attend``
    submodule (a hook reads its queries, entries, selection and log-sum-exp)."""

    kind = "compressed"
    impls = IMPLS
    config_class = CompressedAttentionConfig

    @classmethod
    def check(cls, config: ModelConfig) -> None:
        super().check(config)
        a = config.attention
        if a.impl == "triton" and not _triton_available():
            raise ConfigError("attention.impl='triton' needs the ckv_kernels package and triton (pip install '.[gpu]')")
        if a.grid is not None and a.grid.per == "kv_head" and a.selection is not None:
            raise ConfigError(
                "attention.grid.per='kv_head' gives each KV head its own entries, but attention.selection picks "
                "one set of entries per query for all heads: use one of the two"
            )

    @classmethod
    def resolve_impl(cls, impl: str, device: torch.device, dtype: torch.dtype) -> str:
        """``resolve_impl`` without a size: ``auto`` stays ``auto`` off CUDA (each joint softmax picks the fast path
        or, for a small call, the reference by its size)."""
        resolved = resolve_impl(impl, device)
        return "auto" if impl == "auto" and resolved != "triton" else resolved

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        a = config.attention
        self.window, self.stride, self.local_window = a.window, a.stride, a.local_window
        self.entry_rope = a.entry_rope_position
        self.ck_norm = RMSNorm(config.head_dim, config.norm_eps) if a.qk_norm else None  # compressed keys
        self.norm_before_pooling = a.compressed_norm == "pre"
        self.k_compressor = Compressor(config)
        self.v_compressor = None if a.tied_kv else Compressor(config)
        self.indexer = None
        if a.selection is not None and not a.selection.oracle:
            self.indexer = LightningIndexer(config, Compressor(config, kv_heads=1, head_dim=a.selection.head_dim))
        # selection.by=oracle: top-k of the dense joint softmax's mass (``oracle_selection``), no module
        self.oracle_topk = a.selection.topk if a.selection is not None and a.selection.oracle else None
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if a.sink else None  # one logit per query head
        self.inverse_output_rope = a.output_rope == "inverse"
        self.history = sum(g.cache_history(self.dims(config)) for g in a.groups())  # states before a window
        self.grids = layer_grids(config, layer_idx)  # [(origin, KV heads)]: one, or one per KV head
        self.grid_offsets = config.grid_offsets(layer_idx)
        self.origin = self.grids[0][0]  # grid coordinate of real position 0 (the first grid's)
        self.attend = JointAttention()

    # ---- accounting (per layer; the option groups declare their own shares) -------------------------------------
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
        exact keys) and the (query, visible entry) pairs, each grid in its own coordinates."""
        a, G = config.attention, config.n_heads // config.kv_heads
        pairs, visible_pairs = 0, 0
        for P, heads in layer_grids(config, layer_idx):  # grid coordinates g = t + P, present from P
            n_entries, q_heads = num_entries(seq_len + P, a.stride), G * (heads.stop - heads.start)
            for t in range(P, seq_len + P):
                local = t - max(local_start(t, a.local_window, a.stride), P) + 1
                visible = attended = min(visible_entries(t, a.stride), n_entries)
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
            num_entries(seq_len + P, a.stride) * (heads.stop - heads.start) / config.kv_heads
            for P, heads in layer_grids(config, layer_idx)
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
            entries, local, pending = 1.0, 0.0, 0.0
        elif seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        else:
            history = sum(g.cache_history(dims) for g in a.groups())
            entries = local = pending = 0.0
            for P, heads in layer_grids(config, layer_idx):  # one sub-cache per grid: its heads' share, own pending
                n, share = seq_len + P, (heads.stop - heads.start) / config.kv_heads
                entries += share * num_entries(n, a.stride)
                local += share * local_keep(n, a.local_window, a.stride, origin=P)
                pending += min(pending_keep(n, a.window, a.stride, origin=P) + history, seq_len) * dims.d_model
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
    def _prefill_impl(cls, config: ModelConfig, device: torch.device, chunk: int, seq_len: int) -> str:
        """The implementation a chunk of ``chunk`` queries over ``seq_len`` tokens runs on ``device``
        (``resolve_impl``: ``auto`` picks by the call's size off CUDA)."""
        a = config.attention
        if a.impl == "triton":
            return "triton"
        scores = chunk * (num_entries(seq_len, a.stride) + local_span(a.local_window, a.stride))
        return resolve_impl(a.impl, device, scores)

    @classmethod
    def block_working_bytes(cls, config: ModelConfig, chunk: int, seq_len: int, batch: int = 1) -> tuple[int, int]:
        """The fast path's query block for ``chunk`` queries over ``seq_len`` tokens (``blocked.choose_block``) and
        its working memory (``blocked.working_bytes``: the backward's pass, the larger), in bytes."""
        a = config.attention
        E, L = num_entries(seq_len, a.stride), local_span(a.local_window, a.stride)
        topk = a.selection.topk if a.selection is not None else None
        sizes = (E, L, config.n_heads, config.head_dim, topk, batch, config.kv_heads)
        block = choose_block(chunk, *sizes)
        return block, working_bytes(block, *sizes)

    @classmethod
    def prefill_bytes(
        cls, config: ModelConfig, chunk: int, seq_len: int, device: torch.device, bytes_per_element: int = 4
    ) -> float:
        """The chunk's pooled windows plus the joint softmax's working memory: with the reference four fp32 copies
        of the ``(H, chunk, entries + local window [+ sink])`` scores (scores, their concatenation with the local
        window's, the masked copy, ``exp``) and each query's local keys and values, gathered; with the fast path
        one query block's (``block_working_bytes``); with the Triton kernels none (they read the band in place)."""
        a, b = config.attention, bytes_per_element
        impl = cls._prefill_impl(config, device, chunk, seq_len)
        pooled = cls._pooled_bytes(config, chunk, b)
        if impl == "torch":
            return pooled + cls.block_working_bytes(config, chunk, seq_len)[1]
        if impl == "triton":
            return pooled
        L = local_span(a.local_window, a.stride)
        keys = num_entries(seq_len, a.stride) + L + (1 if a.sink else 0)
        local = 2 * chunk * L * config.kv_heads * config.head_dim  # each query's local keys and values, gathered
        return pooled + b * (4 * config.n_heads * chunk * keys + local)

    @classmethod
    def _pooled_bytes(cls, config: ModelConfig, chunk: int, bytes_per_element: int = 4) -> float:
        """The windows of hidden states a chunk of ``chunk`` queries pools, per compressor branch."""
        a = config.attention
        return bytes_per_element * cls.dims(config).branches * (chunk // a.stride + 1) * a.window * config.d_model

    @classmethod
    def index_bytes(cls, config: ModelConfig, chunk: int, seq_len: int) -> float:
        """The lightning indexer's working memory for ``chunk`` queries over ``seq_len`` tokens (0 without one): one
        of its own query chunks (``indexer.query_chunk`` from ``WORKING_BYTES``), ``indexer.index_working_bytes``
        plus one more fp32 ``(chunk, heads, entries)`` copy: ``index_scores`` holds three at its peak (the dots,
        the scaled ReLU and its product with the head weights), which the CPU measurement shows
        (``tests/eval/test_memory.py``, ``ckv_compressed_indexer``: 1.39x the estimate without it)."""
        s = config.attention.selection
        if s is None or s.oracle:
            return 0.0
        E = num_entries(seq_len, config.attention.stride)
        c = min(chunk, query_chunk(index_working_bytes(1, 1, s.heads, E), chunk))
        return float(index_working_bytes(1, c, s.heads, E) + 4 * c * s.heads * E)

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
        if impl == "auto" and not (device.type == "cuda" and _triton_available()):
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

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """The projections as every backend; compressor maps Normal(0, std), gate biases and the attention-sink
        logits 0 (DeepSeek-V4's initialisation of its sinks), the compressed-key norm's gain 1; the indexer's
        maps Normal(0, std) (``LightningIndexer.init_weights``)."""
        super().init_weights(std, out_std)
        if self.ck_norm is not None:
            self.ck_norm.reset_parameters()
        for compressor in (self.k_compressor, self.v_compressor):
            if compressor is not None:
                compressor.init_weights(std)
        if self.indexer is not None:
            self.indexer.init_weights(std)
        if self.sinks is not None:
            self.sinks.zero_()

    def _windows(
        self, h: torch.Tensor, h_start: int, first: int, n: int, origin: Optional[int] = None
    ) -> tuple[Callable[[Compressor], torch.Tensor], torch.Tensor, torch.Tensor]:
        """For entries ``first .. first+n-1`` of this layer's grid from hidden states h (B, Th, d) at real positions
        ``h_start..``: a function giving a compressor branch's windows (B, n, W, d) (its mixing applied, zeros where
        absent), ``present`` (n, W) and the entries' real RoPE positions (n,). With token mixing, h must also hold
        the ``kernel - 1`` states before each window (unless it starts at position 0). ``origin``: the grid's
        (default: the layer's first grid)."""
        P = self.origin if origin is None else origin
        # the earliest present position pooled is max(entry_start(first), P) - P (real): ints only, no host sync
        need = self.history if h_start > 0 else 0
        if n > 0 and max(entry_start(first, self.window, self.stride), P) - P < h_start + need:
            raise ValueError(
                "hidden states do not reach back to the start of a window being pooled"
                + (f" (and its {self.history} mixing predecessors)" if self.history else "")
            )
        pos, present = window_positions(first, n, self.window, self.stride, device=h.device, origin=P)  # (n, W) grid
        idx = (pos - P - h_start).clamp(min=0)
        mask = present[None, :, :, None].to(h.dtype)  # (1, n, W, 1)

        def windows(compressor: Compressor) -> torch.Tensor:  # (B, n, W, d), zeros where absent
            hm = h if compressor.mixing is None else compressor.mixing(h)
            return hm[:, idx] * mask

        j = torch.arange(first, first + n, device=h.device)
        return windows, present, entry_rope_position(j, self.window, self.stride, self.entry_rope, origin=P) - P

    def entries(
        self, h: torch.Tensor, h_start: int, first: int, n: int, origin: Optional[int] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool entries ``first .. first+n-1`` (of the grid at ``origin``, default the layer's first) from hidden
        states h (B, Th, d) at real positions ``h_start..`` (see ``_windows``). Returns kc, vc (B, n, KV, D): keys
        normalised and rotated at real positions; vc is kc with tied K/V."""
        windows, present, rope_positions = self._windows(h, h_start, first, n, origin)
        # without mixing both branches pool the same windows: one gather, so one gradient sum into h
        shared = windows(self.k_compressor) if self.history == 0 else None
        impl = self.impl_for(h)
        kc = self.k_compressor(
            windows(self.k_compressor) if shared is None else shared,
            present,
            impl=impl,
            norm=self.ck_norm if self.norm_before_pooling else None,
        )
        if self.ck_norm is not None and not self.norm_before_pooling:
            kc = self.ck_norm(kc)
        kc = self.rotary(kc, rope_positions)
        vc = (
            kc
            if self.v_compressor is None
            else self.v_compressor(windows(self.v_compressor) if shared is None else shared, present, impl=impl)
        )
        return kc, vc

    def index_keys(self, h: torch.Tensor, h_start: int, first: int, n: int) -> torch.Tensor:
        """The indexer's keys (B, n, head_dim) of entries ``first .. first+n-1``, pooled like ``entries``' keys by
        its own compressor branch from ``h`` detached (the indexer learns only from its own loss)."""
        windows, present, rope_positions = self._windows(h.detach(), h_start, first, n)
        ix = self.indexer
        norm = ix.norm if self.norm_before_pooling else None
        keys = ix.compressor(windows(ix.compressor), present, impl=self.impl_for(h), norm=norm)  # (B, n, 1, Di)
        if ix.norm is not None and not self.norm_before_pooling:
            keys = ix.norm(keys)
        return ix.rotary(keys, rope_positions)[:, :, 0]

    def forward(self, x: torch.Tensor, cache: Optional[CompressedLayerCache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=x.device)
        latent = self.query_latent(x)  # (B, T, d) or V4's low-rank latent
        q, k, v = self.project(x, positions, latent)  # (B, T, H|KV, D)
        if len(self.grids) == 1:
            out = self._attend_grid(x, latent, positions, q, k, v, self.sinks, self.origin, None, cache)
        else:  # one grid per KV head: its query heads, its entries, its own sub-cache
            G = self.n_heads // self.kv_heads
            caches = [None] * len(self.grids) if cache is None else cache.grids
            out = torch.cat(
                [
                    self._attend_grid(
                        x,
                        latent,
                        positions,
                        q[:, :, G * heads.start : G * heads.stop],
                        k[:, :, heads],
                        v[:, :, heads],
                        None if self.sinks is None else self.sinks[G * heads.start : G * heads.stop],
                        P,
                        heads,
                        sub,
                    )
                    for (P, heads), sub in zip(self.grids, caches)
                ],
                dim=2,
            )  # (B, T, H, D)
            if cache is not None:
                cache.length = start + T
        if self.inverse_output_rope:  # tied values carry RoPE: rotate back by the query's position
            out = self.rotary(out, positions, inverse=True)
        return self.o_proj(out.reshape(B, T, -1))

    def _attend_grid(
        self,
        x: torch.Tensor,
        latent: torch.Tensor,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: Optional[torch.Tensor],
        P: int,
        heads: Optional[slice],
        cache: Optional[CompressedLayerCache],
    ) -> torch.Tensor:
        """Joint attention of queries q (B, T, Hg, D) over one grid (origin ``P``; grid coordinates g = p + P,
        P = 0 without a shift) serving KV heads ``heads`` (None: all), whose exact keys k, v (B, T, KVg, D) and
        decode state ``cache`` are its own. Returns (B, T, Hg, D)."""
        T = x.shape[1]
        start = cache.length if cache is not None else 0
        tied = self.v_compressor is None

        def pooled(h: torch.Tensor, h_start: int, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            kc, vc = self.entries(h, h_start, first, n, P)  # (B, n, KV, D)
            return (kc, vc) if heads is None else (kc[:, :, heads], vc[:, :, heads])

        first, end = num_entries(start + P, self.stride), num_entries(start + P + T, self.stride)
        ki = None  # the indexer's keys (B, E, Di)
        if cache is None:
            kc, vc = pooled(x, 0, 0, end)
            if self.indexer is not None:
                ki = self.index_keys(x, 0, 0, end)
            k_all, v_all = k, v
        else:
            h = x if cache.pending is None else torch.cat([cache.pending, x], dim=1)
            h_start = start + T - h.shape[1]
            kc_new, vc_new = pooled(h, h_start, first, end - first)
            kc = kc_new if cache.kc is None else torch.cat([cache.kc, kc_new], dim=1)
            vc = kc if tied else (vc_new if cache.vc is None else torch.cat([cache.vc, vc_new], dim=1))
            if self.indexer is not None:
                ki_new = self.index_keys(h, h_start, first, end - first)
                ki = ki_new if cache.ki is None else torch.cat([cache.ki, ki_new], dim=1)
            k_all = k if cache.k is None else torch.cat([cache.k, k], dim=1)
            v_all = k_all if tied else (v if cache.v is None else torch.cat([cache.v, v], dim=1))
            n = start + T
            # grid coordinates; the origin clamps the keep to the tokens held (positions below P do not exist)
            keep_l = local_keep(n + P, self.local_window, self.stride, origin=P)
            # the next window's hidden states, plus the mixing's history before it (none before position 0)
            keep_p = min(pending_keep(n + P, self.window, self.stride, origin=P) + self.history, h.shape[1])
            cache.kc, cache.vc, cache.ki = kc, (None if tied else vc), ki
            cache.k = k_all[:, k_all.shape[1] - keep_l :]
            cache.v = cache.k if tied else v_all[:, v_all.shape[1] - keep_l :]
            cache.pending = h[:, h.shape[1] - keep_p :]
            cache.length = n
        selected = None
        joint = dict(stride=self.stride, local_window=self.local_window, q_start=start + P, impl=self.impl_for(x))
        joint.update(sinks=sinks, origin=P, block=self.config.attention.block)
        if self.indexer is not None:  # detached inputs: the LM loss does not reach the indexer
            _, selected = self.indexer(x.detach(), latent.detach(), ki, positions, start + P, self.stride)
        elif self.oracle_topk is not None:  # the dense pass's log-sum-exp ranks the entries (no gradient)
            with torch.no_grad():
                _, lse = joint_attention(q, kc, vc, k_all, v_all, **joint)  # (B, T, Hg)
            selected = oracle_selection(q, kc, lse, start + P, self.stride, self.oracle_topk)
        out, _ = self.attend(q, kc, vc, k_all, v_all, **joint, selected=selected)  # (B, T, Hg, D)
        return out

    def new_cache(self, batch_size: int) -> CompressedLayerCache:
        if len(self.grids) == 1:
            return CompressedLayerCache()
        return CompressedLayerCache(grids=[CompressedLayerCache() for _ in self.grids])
