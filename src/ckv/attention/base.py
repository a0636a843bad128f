"""What every attention backend shares: Q/K/V/O projections, per-head Q/K RMSNorm and RoPE."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import nn

from ckv.attention.rope import Rotary
from ckv.config import ConfigError, ModelConfig
from ckv.norm import RMSNorm


class AttentionBackend(nn.Module):
    """Base class of the attention backends. Subclasses declare ``kind`` and the ``impls`` they run, may extend
    ``check`` to refuse configurations they cannot run, override ``resolve_impl`` when ``impl="auto"`` has a
    choice to make, and implement ``forward(x, cache)`` and ``new_cache(batch_size)``."""

    kind: ClassVar[str]
    impls: ClassVar[tuple[str, ...]] = ("auto", "torch")

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.check(config)
        a = config.attention
        self.config = config
        self.layer_idx = layer_idx
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        d, hd = config.d_model, config.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = None if a.tied_kv else nn.Linear(d, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.norm_eps) if a.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, config.norm_eps) if a.qk_norm else nn.Identity()
        theta = config.rope_theta if a.rope_theta is None else a.rope_theta
        self.rotary = Rotary(config.rope_dims, theta, side=a.rope_side, pairing=a.rope_pairing)
        self.impl = a.impl
        self._resolved_impls: dict[tuple[torch.device, torch.dtype], str] = {}

    @classmethod
    def check(cls, config: ModelConfig) -> None:
        """Raise ConfigError naming the field if this backend cannot run ``config``."""
        a = config.attention
        if a.impl not in cls.impls:
            raise ConfigError(
                f"attention.kind={cls.kind!r} does not support attention.impl={a.impl!r}; it supports {list(cls.impls)}"
            )

    @classmethod
    def resolve_impl(cls, impl: str, device: torch.device, dtype: torch.dtype) -> str:
        """The implementation ``impl`` runs as on ``device`` for activations of ``dtype`` (``auto`` -> ``torch``)."""
        return "torch" if impl == "auto" else impl

    def impl_for(self, x: torch.Tensor) -> str:
        """This module's ``impl`` resolved for ``x``'s device and dtype, once per (device, dtype)."""
        key = (x.device, x.dtype)
        if key not in self._resolved_impls:
            self._resolved_impls[key] = self.resolve_impl(self.impl, x.device, x.dtype)
        return self._resolved_impls[key]

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, d) -> q (B, T, H, D), k and v (B, T, KV, D), normalised and rotated (v = k when tied)."""
        B, T, _ = x.shape
        q = self.rotary(self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)), positions)
        k = self.rotary(self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)), positions)
        v = k if self.v_proj is None else self.v_proj(x).view(B, T, self.kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: Optional[object] = None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def new_cache(self, batch_size: int) -> object:  # pragma: no cover
        raise NotImplementedError
