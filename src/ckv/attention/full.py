"""Causal grouped-query attention: PyTorch SDPA (``impl=torch``) or flash-attn (``impl=flash``, CUDA, fp16/bf16).

``impl=auto`` takes flash-attn on CUDA for fp16/bf16 activations when the package imports, SDPA otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

from ckv.attention.base import AttentionBackend, LayerFlops
from ckv.cache import FullLayerCache
from ckv.config import ConfigError, ModelConfig

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _flash_attn_func() -> Optional[Callable[..., torch.Tensor]]:
    try:
        from flash_attn import flash_attn_func  # type: ignore

        return flash_attn_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int = 0, impl: str = "torch"
) -> torch.Tensor:
    """q: (B, Tq, H, D) at positions ``q_start..``; k, v: (B, Tk, KV, D) at positions ``0..Tk-1`` with
    ``Tk = q_start + Tq``. ``impl``: a resolved implementation, ``torch`` (SDPA) or ``flash``. Returns (B, Tq, H, D)."""
    Tq, Tk = q.shape[1], k.shape[1]
    if impl == "flash":
        return _flash_attn_func()(q, k, v, causal=True)  # bottom-right aligned causal mask, native GQA
    G = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)  # (B, H, Tq, D)
    kt = k.transpose(1, 2).repeat_interleave(G, dim=1)  # (B, H, Tk, D)
    vt = v.transpose(1, 2).repeat_interleave(G, dim=1)
    if Tq == Tk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        q_pos = torch.arange(q_start, q_start + Tq, device=q.device)
        mask = torch.arange(Tk, device=q.device)[None, :] <= q_pos[:, None]  # (Tq, Tk)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(1, 2)


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
