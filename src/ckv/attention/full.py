"""Causal grouped-query attention: PyTorch SDPA (``impl=torch``) or flash-attn (``impl=flash``, CUDA, fp16/bf16).

``impl=auto`` takes flash-attn on CUDA for fp16/bf16 activations when the package imports, SDPA otherwise.

``kind: sliding`` (``SlidingAttention``) is the same attention restricted to the last ``sliding_window`` tokens
(DeepSeek-V4's sliding-only layers, its "ratio 0"): SDPA with a banded causal mask, and a decode cache that keeps
the last ``sliding_window - 1`` keys and values.
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
from ckv.cache import FullLayerCache
from ckv.config import AttentionConfig, ConfigError, ModelConfig, check_bool, check_choice, check_int
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
    """Full causal attention: every query sees every earlier token exactly."""

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

    def forward(self, x: torch.Tensor, cache: Optional[FullLayerCache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        q, k, v = self.project(x, torch.arange(start, start + T, device=x.device))
        if cache is not None:
            k, v = cache.append(k, v)
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
    ``attention.sink``, each head's sink logit too: ``causal_attention``)."""

    kind = "sliding"
    impls = ("auto", "torch")
    config_class = SlidingAttentionConfig

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        a = config.attention
        self.window = a.sliding_window
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if a.sink else None  # one logit per query head
        self.inverse_output_rope = a.output_rope == "inverse"

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
        """Projections (the low-rank query path's maps in place of the query map) and the pairs in the band."""
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        a, W = config.attention, config.attention.sliding_window
        full = min(seq_len, W)  # positions 0..W-1 see t + 1 keys, later ones W
        pairs = full * (full + 1) // 2 + (seq_len - full) * W
        projections = cls.projection_flops(config) + sum(g.flops_per_token(cls.dims(config)) for g in a.groups())
        return LayerFlops(projections=projections, attention=4.0 * config.head_dim * config.n_heads * pairs / seq_len)

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
        the chunk reads (the window before it and the chunk; with sinks, the zero key and a float bias per head)."""
        a = config.attention
        keys = min(seq_len, chunk + a.sliding_window - 1) + (1 if a.sink else 0)
        H, KV, D, b = config.n_heads, config.kv_heads, config.head_dim, bytes_per_element
        expanded = 2 * H * keys * D * b * (H != KV or a.sink)  # repeated to every head, or copied with the zero key
        return expanded + chunk * keys * (1 + b * (H if a.sink else 1))  # the bool band and its float copy(s)

    @classmethod
    def prefill_note(cls, config: ModelConfig, device: torch.device) -> str:
        return f"ckv sliding-window attention ({config.attention.sliding_window} tokens), SDPA + banded mask"

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """The projections as every backend's; sink logits 0 (DeepSeek-V4's initialisation)."""
        super().init_weights(std, out_std)
        if self.sinks is not None:
            self.sinks.zero_()

    def forward(self, x: torch.Tensor, cache: Optional[SlidingLayerCache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=x.device)
        q, k, v = self.project(x, positions)  # (B, T, H, D), (B, T, KV, D) x 2
        if cache is not None:
            k, v = cache.append(k, v)  # (B, kept + T, KV, D)
        out = causal_attention(q, k, v, start, self.impl_for(q), self.window, self.sinks)  # (B, T, H, D)
        if self.inverse_output_rope:  # tied values carry RoPE: rotate back by the query's position
            out = self.rotary(out, positions, inverse=True)
        return self.o_proj(out.reshape(B, T, -1))

    def new_cache(self, batch_size: int) -> SlidingLayerCache:
        return SlidingLayerCache(window=self.window)
