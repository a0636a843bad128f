"""Causal grouped-query attention: PyTorch SDPA (``impl=torch``) or flash-attn (``impl=flash``, CUDA, fp16/bf16).

``impl=auto`` takes flash-attn on CUDA for fp16/bf16 activations when the package imports, SDPA otherwise.

``kind: sliding`` (``SlidingAttention``) is the same attention restricted to the last ``sliding_window`` tokens
(DeepSeek-V4's sliding-only layers, its "ratio 0"): SDPA with a banded causal mask, and a decode cache that keeps
the last ``sliding_window - 1`` keys and values.

Cross-layer KV sharing (``model.layers``' ``kv``; docs/attention.md): a full layer can be a source (ratio 1: it
publishes every token's keys and values); a sliding layer can be a consumer, which attends its source's entries
beside its own window in one joint softmax (``dispatch.attend_entries``, compressed attention's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ckv.attention.base import AttentionBackend, LayerFlops
from ckv.attention.compressed_accounting import joint_working_bytes
from ckv.attention.dispatch import EntrySet, attend_entries
from ckv.cache import FullLayerCache
from ckv.config import AttentionConfig, ConfigError, ModelConfig, check_bool, check_choice, check_int
from ckv.geometry import num_entries, visible_entries
from ckv.options import Dims, OptionGroup, QueryConfig, RopeConfig

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _flash_attn_func() -> Optional[Callable[..., torch.Tensor]]:
    try:
        from flash_attn import flash_attn_func  # type: ignore

        return flash_attn_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int = 0,
    impl: str = "torch",
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q: (B, Tq, H, D) at positions ``q_start..``; k, v: (B, Tk, KV, D) at the ``Tk`` positions ending at the last
    query's, ``q_start + Tq - Tk ..`` (all of ``0..`` without a window). ``window``: a query at ``t`` sees keys
    ``t - window < p <= t`` only (None: every earlier key). ``sinks`` (H,): one more logit per head in the softmax,
    whose probability is dropped (a zero key scored 0 plus the sink, with a zero value). ``impl``: a resolved
    implementation, ``torch`` (SDPA) or ``flash`` (neither window nor sinks). Returns (B, Tq, H, D)."""
    Tq, Tk = q.shape[1], k.shape[1]
    if impl == "flash":
        return _flash_attn_func()(q, k, v, causal=True)  # bottom-right aligned causal mask, native GQA
    B, _, H, D = q.shape
    G = H // k.shape[2]
    qt = q.transpose(1, 2)  # (B, H, Tq, D)
    kt = k.transpose(1, 2).repeat_interleave(G, dim=1)  # (B, H, Tk, D)
    vt = v.transpose(1, 2).repeat_interleave(G, dim=1)
    if Tq == Tk and window is None and sinks is None:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
    q_pos = torch.arange(q_start, q_start + Tq, device=q.device)  # (Tq,)
    k_pos = torch.arange(q_start + Tq - Tk, q_start + Tq, device=q.device)  # (Tk,)
    mask = k_pos[None, :] <= q_pos[:, None]  # (Tq, Tk)
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    if sinks is not None:
        bias = torch.zeros(Tq, Tk, device=q.device, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        sink = sinks.to(q.dtype)[:, None, None].expand(H, Tq, 1)
        mask = torch.cat([bias.expand(H, Tq, Tk), sink], dim=-1)  # (H, Tq, Tk + 1): a float bias
        zero = q.new_zeros(B, H, 1, D)
        kt, vt = torch.cat([kt, zero], dim=2), torch.cat([vt, zero], dim=2)  # (B, H, Tk + 1, D)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)


class FullAttention(AttentionBackend):
    """Full causal attention: every query sees every earlier token exactly. As the source of a KV-sharing group
    (``kv: source``) it publishes its keys and values, every token's so far, as entries of stride 1."""

    kind = "full"
    impls = ("auto", "torch", "flash")

    @classmethod
    def check(cls, config: ModelConfig) -> None:
        super().check(config)
        if config.attention.impl == "flash" and _flash_attn_func() is None:
            raise ConfigError(
                "attention.impl='flash' needs the flash-attn package (pip install flash-attn); "
                "impl='torch' runs PyTorch SDPA"
            )

    @classmethod
    def resolve_impl(cls, impl: str, device: torch.device, dtype: torch.dtype) -> str:
        """``auto`` -> ``flash`` on CUDA for fp16/bf16 when flash-attn imports, else ``torch``; ``flash`` on another
        device or dtype is a ConfigError (flash-attn runs only there)."""
        flash_fits = device.type == "cuda" and dtype in FLASH_DTYPES
        if impl == "auto":
            return "flash" if flash_fits and _flash_attn_func() is not None else "torch"
        if impl == "flash" and not flash_fits:
            raise ConfigError(
                f"attention.impl='flash' runs on CUDA in fp16/bf16, not on {device.type} in {dtype}; "
                "use impl='auto' or 'torch' (SDPA)"
            )
        return impl

    @classmethod
    def num_params(cls, config: ModelConfig) -> int:
        return cls.projection_params(config)

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int, layer_idx: int = 0) -> LayerFlops:
        pairs = seq_len * (seq_len + 1) // 2  # position t sees t + 1 keys
        attention = 4.0 * config.head_dim * config.n_heads * pairs / seq_len
        return LayerFlops(projections=cls.projection_flops(config), attention=attention)

    @classmethod
    def kv_elements_per_token(
        cls, config: ModelConfig, seq_len: Optional[int] = None, layer_idx: int = 0
    ) -> dict[str, float]:
        """Every key and value, at any length; the keys' rotated dims apart."""
        rope = config.kv_heads * config.rope_dims
        return {"keys_values": 2.0 * config.kv_heads * config.head_dim - rope, "keys_values.rope": float(rope)}

    @classmethod
    def kv_bytes_per_token(
        cls, config: ModelConfig, seq_len: Optional[int] = None, layer_idx: int = 0, bytes_per_element: int = 2
    ) -> float:
        return sum(cls.kv_elements_per_token(config, seq_len, layer_idx).values()) * bytes_per_element

    @classmethod
    def prefill_bytes(
        cls, config: ModelConfig, chunk: int, seq_len: int, device: torch.device, bytes_per_element: int = 4
    ) -> float:
        """SDPA holds the keys and values repeated to every query head (unless each head has its own), the bool
        mask and the kernel's float copy of it; flash-attn needs neither."""
        if cls.resolve_impl(config.attention.impl, device, torch.float32) == "flash":
            return 0.0
        H, KV, D, b = config.n_heads, config.kv_heads, config.head_dim, bytes_per_element
        return 2 * H * seq_len * D * b * (H != KV) + chunk * seq_len * (1 + b)

    @classmethod
    def prefill_note(cls, config: ModelConfig, device: torch.device) -> str:
        flash = cls.resolve_impl(config.attention.impl, device, torch.float32) == "flash"
        return "ckv full attention, " + ("flash-attn" if flash else "SDPA: keys/values expanded to every head + mask")

    @classmethod
    def shared_kv(cls, config: ModelConfig, layer_idx: int) -> tuple[int, tuple[int, ...]]:
        """Every token's key and value: entries of stride 1 (ratio 1), token ``j`` visible from position ``j``."""
        return 1, (0,)

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[FullLayerCache] = None,
        shared: Optional[dict[int, list[EntrySet]]] = None,
    ) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d); with ``shared`` (a source's, ``kv: source``) its keys and values so far go
        into it under its layer index."""
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        q, k, v = self.project(x, torch.arange(start, start + T, device=x.device))
        if cache is not None:
            k, v = cache.append(k, v)  # (B, start + T, KV, D): every token's
        if shared is not None:
            shared[self.layer_idx] = [EntrySet(k, v, stride=1)]
        out = causal_attention(q, k, v, q_start=start, impl=self.impl_for(q))  # (B, T, H, D)
        return self.o_proj(out.reshape(B, T, -1))

    def new_cache(self, batch_size: int) -> FullLayerCache:
        return FullLayerCache()


@dataclass
class SlidingAttentionConfig(AttentionConfig):
    """``kind: sliding``: full attention's fields plus ``sliding_window``, the tokens a query sees (itself and the
    ``sliding_window - 1`` before it; DeepSeek-V4's ``sliding_window``), and DeepSeek-V4's sliding-layer options as
    compressed attention spells them: ``kv`` (``tied``: the values are the normalised, rotated keys), ``sink`` (one
    learned attention-sink logit per query head), ``output_rope`` (``inverse``: the output rotated back by the
    query's position; needs tied K/V) and the ``query`` option group (the low-rank query path)."""

    GROUPS: ClassVar[dict[str, type[OptionGroup]]] = {"rope": RopeConfig, "query": QueryConfig}

    kind: str = "sliding"
    sliding_window: int = 128
    kv: str = "separate"
    sink: bool = False
    output_rope: str = "keep"
    query: Optional[QueryConfig] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("attention.sliding_window", self.sliding_window, 1)
        check_choice("attention.kv", self.kv, ("separate", "tied"))
        check_bool("attention.sink", self.sink)
        check_choice("attention.output_rope", self.output_rope, ("keep", "inverse"))
        if self.output_rope == "inverse" and self.kv != "tied":
            raise ConfigError(
                "attention.output_rope='inverse' undoes the RoPE that tied values carry; it needs attention.kv='tied' "
                f"(got {self.kv!r})"
            )

    @property
    def tied_kv(self) -> bool:
        return self.kv == "tied"


@dataclass
class SlidingLayerCache(FullLayerCache):
    """The keys and values the next query's window needs: the last ``window - 1`` (k, v (B, <= window - 1, KV, D);
    v None when the values are the keys); ``length``: tokens seen."""

    window: int = 1

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the kept keys and values followed by the new ones, (B, kept + T, KV, D), then keeps the last
        ``window - 1`` (one tensor when ``v is k``)."""
        tied = v is k
        k = k if self.k is None else torch.cat([self.k, k], dim=1)
        v = k if tied else v if self.v is None else torch.cat([self.v, v], dim=1)
        self.length += k.shape[1] - (0 if self.k is None else self.k.shape[1])
        keep = k.shape[1] - (self.window - 1)
        self.k, self.v = k[:, max(keep, 0) :], None if tied else v[:, max(keep, 0) :]
        return k, v


class SlidingAttention(FullAttention):
    """Causal attention over the last ``attention.sliding_window`` tokens: SDPA with a banded mask (with
    ``attention.sink``, each head's sink logit too: ``causal_attention``).

    As a consumer of a KV-sharing group (``kv: shared``: its config's ``kv_source``) it also attends its source's
    entries (``EntrySet``s, read from the ``shared`` dict of the model's forward), with its own queries, in one
    joint softmax with its window's exact keys and its sinks (``dispatch.attend_entries``, by ``attention.impl`` as
    compressed attention runs it): its window is the joint softmax's local window (``local_window =
    sliding_window``). It owns what a sliding layer owns (its query path, its window's K/V projections, the output
    map, norms, sinks), no compressor; its decode cache holds its window only."""

    kind = "sliding"
    impls = ("auto", "torch")
    config_class = SlidingAttentionConfig
    reads_shared_kv = True

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        a = config.attention
        self.window = a.sliding_window
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if a.sink else None  # one logit per query head
        self.inverse_output_rope = a.output_rope == "inverse"
        self.source = None if config.kv_source is None else config.kv_source.layer  # the layer whose KV it reads

    @classmethod
    def resolve_impl(cls, impl: str, device: torch.device, dtype: torch.dtype) -> str:
        """``auto`` -> ``torch`` (SDPA with the banded mask)."""
        return "torch" if impl == "auto" else impl

    @staticmethod
    def dims(config: ModelConfig) -> Dims:
        """The sizes the option groups' accounting reads (no compressor: a window of ``sliding_window``, stride 1,
        one map)."""
        a = config.attention
        return Dims(
            d_model=config.d_model,
            n_heads=config.n_heads,
            kv_heads=config.kv_heads,
            head_dim=config.head_dim,
            window=a.sliding_window,
            stride=1,
            maps=1,
            branches=1 if a.tied_kv else 2,
            query_latent=config.d_model if a.query is None else a.query.lora_rank,
        )

    @classmethod
    def num_params(cls, config: ModelConfig) -> int:
        """Projections (tied K/V: no value map), the option groups' shares (the low-rank query path's) and the
        sinks."""
        a, dims = config.attention, cls.dims(config)
        sinks = config.n_heads if a.sink else 0
        return cls.projection_params(config) + sum(g.num_params(dims) for g in a.groups()) + sinks

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int, layer_idx: int = 0) -> LayerFlops:
        """Projections (the low-rank query path's maps in place of the query map) and the pairs in the band; a
        consumer's, also each query's visible entries of its source's sets (``shared_pairs``)."""
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        a, W = config.attention, config.attention.sliding_window
        full = min(seq_len, W)  # positions 0..W-1 see t + 1 keys, later ones W
        pairs = full * (full + 1) // 2 + (seq_len - full) * W + cls.shared_pairs(config, seq_len)
        projections = cls.projection_flops(config) + sum(g.flops_per_token(cls.dims(config)) for g in a.groups())
        return LayerFlops(projections=projections, attention=4.0 * config.head_dim * config.n_heads * pairs / seq_len)

    @staticmethod
    def shared_pairs(config: ModelConfig, seq_len: int) -> int:
        """The (query, entry) pairs a consumer's query head scores over ``seq_len`` tokens: each query's visible
        entries of each set its source publishes (``kv_source``: stride and grid origins); 0 for any other layer."""
        source = config.kv_source
        if source is None:
            return 0
        return sum(visible_entries(t + P, source.stride) for t in range(seq_len) for P in source.origins)

    @classmethod
    def phase_stride(cls, config: ModelConfig) -> Optional[int]:
        """None, or a consumer's source's stride (the period of the entries it attends) when above 1."""
        source = config.kv_source
        return source.stride if source is not None and source.stride > 1 else None

    @classmethod
    def shared_kv(cls, config: ModelConfig, layer_idx: int) -> tuple[int, tuple[int, ...]]:
        raise ConfigError(
            f"attention.kind={cls.kind!r} keeps only its last sliding_window tokens, so it has no KV to publish to "
            "other layers: make the source a full layer (ratio 1) or a compressed one (ratio = its stride)"
        )

    @classmethod
    def kv_elements_per_token(
        cls, config: ModelConfig, seq_len: Optional[int] = None, layer_idx: int = 0
    ) -> dict[str, float]:
        """The last ``sliding_window - 1`` keys (and values unless tied; ``SlidingLayerCache``) over ``seq_len``;
        nothing per token in the long run (the cache stops growing)."""
        if seq_len is not None and seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        kept = 0.0 if seq_len is None else min(seq_len, config.attention.sliding_window - 1) / seq_len
        rope = config.kv_heads * config.rope_dims
        per_token = config.kv_heads * config.head_dim * (1 if config.attention.tied_kv else 2)
        return {"keys_values": kept * (per_token - rope), "keys_values.rope": kept * rope}

    @classmethod
    def prefill_bytes(
        cls, config: ModelConfig, chunk: int, seq_len: int, device: torch.device, bytes_per_element: int = 4
    ) -> float:
        """SDPA's keys and values repeated to every query head (unless each has its own) and its mask, over the keys
        the chunk reads (the window before it and the chunk; with sinks, the zero key and a float bias per head); a
        consumer's, the joint softmax's over its source's first set of entries and its window
        (``compressed_accounting.joint_working_bytes``: a further set's pass runs after it and scores no more)."""
        a, source = config.attention, config.kv_source
        if source is not None:
            entries = num_entries(seq_len + source.origins[0], source.stride)
            return joint_working_bytes(
                a.impl,
                device,
                chunk,
                entries,
                a.sliding_window,
                config,
                sink=a.sink,
                bytes_per_element=bytes_per_element,
            )
        keys = min(seq_len, chunk + a.sliding_window - 1) + (1 if a.sink else 0)
        H, KV, D, b = config.n_heads, config.kv_heads, config.head_dim, bytes_per_element
        expanded = 2 * H * keys * D * b * (H != KV or a.sink)  # repeated to every head, or copied with the zero key
        return expanded + chunk * keys * (1 + b * (H if a.sink else 1))  # the bool band and its float copy(s)

    @classmethod
    def working_bytes(cls, config: ModelConfig, seq_len: int, device: torch.device) -> dict[str, float]:
        """A consumer's joint softmax over the whole sequence (``prefill_bytes``); none for SDPA's banded path."""
        if config.kv_source is None:
            return {}
        return {"attention": cls.prefill_bytes(config, seq_len, seq_len, device)}

    @classmethod
    def prefill_note(cls, config: ModelConfig, device: torch.device) -> str:
        note = f"ckv sliding-window attention ({config.attention.sliding_window} tokens)"
        source = config.kv_source
        if source is None:
            return note + ", SDPA + banded mask"
        return note + f" beside layer {source.layer}'s shared KV (stride {source.stride}), one joint softmax"

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """The projections as every backend's; sink logits 0 (DeepSeek-V4's initialisation)."""
        super().init_weights(std, out_std)
        if self.sinks is not None:
            self.sinks.zero_()

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[SlidingLayerCache] = None,
        shared: Optional[dict[int, list[EntrySet]]] = None,
    ) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d); a consumer reads its source's entry sets from ``shared``."""
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=x.device)
        q, k, v = self.project(x, positions)  # (B, T, H, D), (B, T, KV, D) x 2
        if cache is not None:
            k, v = cache.append(k, v)  # (B, kept + T, KV, D)
        if self.source is None:
            out = causal_attention(q, k, v, start, self.impl_for(q), self.window, self.sinks)  # (B, T, H, D)
        else:  # the source's entries (B, E, KV, D) beside the window, one softmax
            if shared is None or self.source not in shared:
                raise ValueError(
                    f"layer {self.layer_idx} reads the KV of layer {self.source} (kv: shared): run it in its model, "
                    "whose forward passes the KV its source published (shared)"
                )
            sets = shared[self.source]
            out = attend_entries(q, sets, k, v, start=start, local_window=self.window, impl=self.impl, sinks=self.sinks)
        if self.inverse_output_rope:  # tied values carry RoPE: rotate back by the query's position
            out = self.rotary(out, positions, inverse=True)
        return self.o_proj(out.reshape(B, T, -1))

    def new_cache(self, batch_size: int) -> SlidingLayerCache:
        return SlidingLayerCache(window=self.window)
