"""Chunked KV compression with joint attention (docs/attention.md): the backend ``CompressedAttention``.

Each window of ``window`` tokens, moved by ``stride``, is pooled into one key and one value per KV head by a
learned softmax gate or a uniform mean (``Compressor``, ``attention/compressor.py``); a query attends in one softmax
to every visible entry plus the exact keys of its local window (``joint_attention``, dispatched by ``impl`` in
``attention/dispatch.py``). The layer's figures from the config alone are ``CompressedAccounting``'s
(``attention/compressed_accounting.py``); the decode cache updates itself (``CompressedLayerCache.append``).

Code outside ``ckv.attention`` uses only the declared surface (docs/attention.md, "The compressed layer's public
surface"): ``compressed_layers(module)``, a layer's ``compressors()``, ``indexer`` and ``attend``, its geometry
(``window``, ``stride``, ``origin``), and each ``Compressor``'s ``payload``, ``gate`` and ``pooling``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from ckv.attention.compressed_accounting import CompressedAccounting, entry_origins, layer_grids
from ckv.attention.compressed_config import CompressedAttentionConfig
from ckv.attention.compressor import Compressor
from ckv.attention.dispatch import (
    IMPLS,
    EntrySet,
    JointAttention,
    attend_entries,
    joint_attention,
    resolve_impl,
    triton_available,
)
from ckv.attention.indexer import LightningIndexer, oracle_selection
from ckv.cache import CompressedLayerCache
from ckv.config import ConfigError, ModelConfig
from ckv.geometry import entry_rope_position, entry_start, local_keep, num_entries, pending_keep, window_positions
from ckv.norm import RMSNorm


class CompressedAttention(CompressedAccounting):
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
    submodule (a hook reads its queries, entries, selection and log-sum-exp). With ``attention.dual_offset``
    (inference only) each grid also pools its windows moved by that offset (``moved_entries``, the grid at
    ``geometry.shifted_origin``), and each query attends to both sets of entries in one joint softmax: the second
    set's softmax (no local window, no sink) merged with the first's by their log-sum-exps
    (``dispatch.attend_entries``). As the source of a KV-sharing group (``kv: source``, one grid) it puts its sets of
    entries into the ``shared`` dict its forward is given, for the layers that read its KV.

    Public surface (the rest, ``k_compressor`` and ``v_compressor`` among it, is private to ``ckv.attention``;
    those attribute names stay as the state-dict names of saved weights): ``compressors()`` (the K/V branches by
    name), ``indexer`` (the ``LightningIndexer`` or None; its branch is ``indexer.compressor``, its ``topk``
    settable), ``attend`` (the hook point of the joint softmax), ``window``, ``stride`` and ``origin``; each
    ``Compressor``'s ``payload``, ``gate`` (``CompressorGate`` or None) and ``pooling`` (the hook point of its
    gate weights). ``compressed_layers(module)`` finds the layers of a model. The instance attributes of the surface
    are the ones annotated here (``tests/attention/test_surface.py`` holds every caller to them)."""

    indexer: Optional[LightningIndexer]
    attend: JointAttention
    window: int
    stride: int
    origin: int
    kind = "compressed"
    impls = IMPLS
    config_class = CompressedAttentionConfig

    @classmethod
    def check(cls, config: ModelConfig) -> None:
        super().check(config)
        a = config.attention
        if a.impl == "triton" and not triton_available():
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
        self.dual_offset = a.dual_offset or 0  # dual-offset compression: the second set's grid is moved by this
        self.attend = JointAttention()

    # ---- the public surface (what code outside ckv.attention may use) -------------------------------------------
    def compressors(self) -> dict[str, Compressor]:
        """The layer's compressor branches by name: ``K`` and, unless K/V are tied, ``V`` (the lightning indexer's
        own branch is ``indexer.compressor``)."""
        out = {"K": self.k_compressor}
        if self.v_compressor is not None:
            out["V"] = self.v_compressor
        return out

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

    def moved_entries(
        self,
        x: torch.Tensor,
        start: int,
        origin: int,
        cache: Optional[CompressedLayerCache] = None,
        heads: Optional[slice] = None,
        hidden: Optional[tuple[torch.Tensor, int]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every finished entry of the grid at ``origin`` after a forward of x (B, T, d) at real positions
        ``start..``: kc, vc (B, E, KV, D) (KV heads ``heads``, default all), pooled by ``entries`` from x alone
        (``start`` 0) or, with ``cache`` (that grid's own ``CompressedLayerCache``), the earlier entries it holds and
        the new ones pooled from the hidden states before x and x: ``hidden`` ((B, Th, d), the real position of the
        first), the layer's own cache's (it keeps what both grids need), else the pending states ``cache`` keeps for
        itself. Dual-offset compression's second set; through ``ckv.eval.mitigation``, DeepSeek-V4's in
        transformers."""
        T = x.shape[1]
        end = num_entries(start + origin + T, self.stride)
        heads = slice(None) if heads is None else heads
        if cache is None:
            if start:
                raise ValueError(f"without a cache the hidden states start at position 0, not {start}")
            kc, vc = self.entries(x, 0, 0, end, origin)  # (B, E, KV, D)
            return kc[:, :, heads], vc[:, :, heads]
        h, h_start = cache.pooling_input(x) if hidden is None else hidden  # the states before x, then x
        first = num_entries(start + origin, self.stride)
        kc, vc = self.entries(h, h_start, first, end - first, origin)
        keep = 0 if hidden is not None else self.pending(start + T, origin)
        tied = self.v_compressor is None
        kc, vc, _ = cache.add_entries(kc[:, :, heads], None if tied else vc[:, :, heads], None, h, T, pending_keep=keep)
        return kc, vc

    def pending(self, tokens: int, *origins: int) -> int:
        """Hidden states a decode cache keeps after ``tokens`` tokens to pool the next entry of each grid at
        ``origins`` (``geometry.pending_keep`` in each grid's coordinates, the most of them), plus the mixing's
        history before it."""
        return max(pending_keep(tokens + P, self.window, self.stride, origin=P) for P in origins) + self.history

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

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[CompressedLayerCache] = None,
        shared: Optional[dict[int, list[EntrySet]]] = None,
    ) -> torch.Tensor:
        """x (B, T, d) at real positions ``cache.length..`` (0.. without a cache) -> (B, T, d); with ``shared`` (a
        source layer's, ``kv: source``) its sets of entries, every finished one so far, go into it under its layer
        index."""
        if self.dual_offset and torch.is_grad_enabled() and self.training:
            raise RuntimeError(
                "attention.dual_offset is an inference-time option (its two softmaxes merge through log-sum-exps "
                "the fast path returns without a gradient): evaluate with model.eval() or torch.no_grad()"
            )
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=x.device)
        latent = self.query_latent(x)  # (B, T, d) or V4's low-rank latent
        q, k, v = self.project(x, positions, latent)  # (B, T, H|KV, D)
        if len(self.grids) == 1:
            out, sets = self._attend_grid(x, latent, positions, q, k, v, self.sinks, self.origin, None, cache)
            if shared is not None:
                shared[self.layer_idx] = sets
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
                    )[0]
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
    ) -> tuple[torch.Tensor, list[EntrySet]]:
        """Joint attention of queries q (B, T, Hg, D) over one grid (origin ``P``; grid coordinates g = p + P,
        P = 0 without a shift) serving KV heads ``heads`` (None: all), whose exact keys k, v (B, T, KVg, D) and
        decode state ``cache`` are its own. Returns (B, T, Hg, D) and the sets of entries it attended (every
        finished one: its grid's, then dual-offset compression's moved grid's)."""
        T = x.shape[1]
        start = cache.length if cache is not None else 0
        tied = self.v_compressor is None

        def pooled(h: torch.Tensor, h_start: int, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            kc, vc = self.entries(h, h_start, first, n, P)  # (B, n, KV, D)
            return (kc, vc) if heads is None else (kc[:, :, heads], vc[:, :, heads])

        first, end = num_entries(start + P, self.stride), num_entries(start + P + T, self.stride)
        if cache is None:
            kc, vc = pooled(x, 0, 0, end)
            ki = None if self.indexer is None else self.index_keys(x, 0, 0, end)  # (B, E, Di)
            k_all, v_all = k, v
        else:
            h, h_start = cache.pooling_input(x)  # the pending hidden states, then x
            kc_new, vc_new = pooled(h, h_start, first, end - first)
            ki_new = None if self.indexer is None else self.index_keys(h, h_start, first, end - first)
            n = start + T + P  # grid coordinates: the origin clamps the keeps to the tokens held
            kc, vc, ki, k_all, v_all = cache.append(
                kc_new,
                None if tied else vc_new,
                ki_new,
                k,
                None if tied else v,
                h,
                local_keep=local_keep(n, self.local_window, self.stride, origin=P),
                # the next window's hidden states (of every grid this one attends), plus the mixing's history before
                # it (none before position 0)
                pending_keep=self.pending(start + T, *entry_origins(self.config, P)),
            )
        sets = [EntrySet(kc, vc, self.stride, P)]  # (B, E, KVg, D) each
        for Px in entry_origins(self.config, P)[1:]:  # dual-offset compression: the moved grid's entries
            hidden = None if cache is None else (h, h_start)  # pooled from the grid's own pending states
            kx, vx = self.moved_entries(x, start, Px, None if cache is None else cache.moved, heads, hidden)
            sets.append(EntrySet(kx, vx, self.stride, Px))
        selected = None
        joint = dict(local_window=self.local_window, impl=self.impl_for(x), block=self.config.attention.block)
        if self.indexer is not None:  # detached inputs: the LM loss does not reach the indexer
            _, selected = self.indexer(x.detach(), latent.detach(), ki, positions, start + P, self.stride)
        elif self.oracle_topk is not None:  # the dense pass's log-sum-exp ranks the entries (no gradient)
            with torch.no_grad():
                _, lse = joint_attention(
                    q, kc, vc, k_all, v_all, stride=self.stride, q_start=start + P, sinks=sinks, origin=P, **joint
                )  # (B, T, Hg)
            selected = oracle_selection(q, kc, lse, start + P, self.stride, self.oracle_topk)
        out = attend_entries(
            q, sets, k_all, v_all, start=start, sinks=sinks, selected=selected, attend=self.attend, **joint
        )  # (B, T, Hg, D)
        return out, sets

    def new_cache(self, batch_size: int) -> CompressedLayerCache:
        def grid_cache() -> CompressedLayerCache:  # with dual-offset compression, the moved grid's own sub-cache
            return CompressedLayerCache(moved=CompressedLayerCache() if self.dual_offset else None)

        if len(self.grids) == 1:
            return grid_cache()
        return CompressedLayerCache(grids=[grid_cache() for _ in self.grids])


def compressed_layers(module: nn.Module) -> list[CompressedAttention]:
    """The compressed attention layers of ``module`` in order (empty when it has none)."""
    return [m for m in module.modules() if isinstance(m, CompressedAttention)]
