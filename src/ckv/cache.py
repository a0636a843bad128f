"""Decoding caches. Full attention keeps every key and value; compressed attention keeps only finished entries
plus the exact tokens the next queries still need (their local window and the unfinished window's hidden
states, from which the next entry is pooled when its window closes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


def _cat(old: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=1)


def _nbytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class FullLayerCache:
    """Every key and value so far: k, v (B, T, KV, D)."""

    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k, self.v = _cat(self.k, k), _cat(self.v, v)
        self.length += k.shape[1]
        return self.k, self.v

    def nbytes(self) -> dict[str, int]:
        return {"keys_values": _nbytes(self.k, self.v)}


@dataclass
class CompressedLayerCache:
    """kc, vc (B, E, KV, D): finished entries (vc is None with tied K/V); ki (B, E, Di): the lightning indexer's
    key of each finished entry (``attention.selection``; None without); k, v (B, L, KV, D): exact keys of the
    last ``L`` tokens (``geometry.local_keep``); pending (B, P, d_model): hidden states of the last ``P`` tokens
    (``geometry.pending_keep``), from which every branch pools the next entry (V4's overlap state: the previous
    window's tokens are among them); ``length``: tokens seen. With one grid per KV head (``attention.grid.per:
    kv_head``) the tensors stay None and ``grids`` holds one such cache per grid, for its KV heads."""

    kc: Optional[torch.Tensor] = None
    vc: Optional[torch.Tensor] = None
    ki: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    pending: Optional[torch.Tensor] = None
    length: int = 0
    grids: list[CompressedLayerCache] = field(default_factory=list)

    def nbytes(self) -> dict[str, int]:
        if self.grids:
            parts = [g.nbytes() for g in self.grids]
            return {name: sum(p[name] for p in parts) for name in parts[0]}
        tied = self.v is self.k
        return {
            "entries": _nbytes(self.kc, None if self.vc is self.kc else self.vc),
            "index": _nbytes(self.ki),
            "local": _nbytes(self.k, None if tied else self.v),
            "pending": _nbytes(self.pending),
        }


@dataclass
class KVCache:
    """One layer cache per transformer layer."""

    layers: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def nbytes(self) -> dict[str, int]:
        """Bytes held, summed over layers, per component (and ``total``)."""
        out: dict[str, int] = {}
        for layer in self.layers:
            for name, n in layer.nbytes().items():
                out[name] = out.get(name, 0) + n
        out["total"] = sum(out.values())
        return out
