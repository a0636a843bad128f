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
    kv_head``) the tensors stay None and ``grids`` holds one such cache per grid, for its KV heads. With
    dual-offset compression (``attention.dual_offset``) ``moved`` is the moved grid's own cache: its entries and
    the pending hidden states its next entry needs (no exact keys)."""

    kc: Optional[torch.Tensor] = None
    vc: Optional[torch.Tensor] = None
    ki: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    pending: Optional[torch.Tensor] = None
    length: int = 0
    grids: list[CompressedLayerCache] = field(default_factory=list)
    moved: Optional[CompressedLayerCache] = None

    def pooling_input(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The hidden states a forward of x (B, T, d) pools its new entries from, ``pending`` then x (B, P + T, d),
        and the real position of the first."""
        h = _cat(self.pending, x)
        return h, self.length + x.shape[1] - h.shape[1]

    def append(
        self,
        kc: torch.Tensor,
        vc: Optional[torch.Tensor],
        ki: Optional[torch.Tensor],
        k: torch.Tensor,
        v: Optional[torch.Tensor],
        hidden: torch.Tensor,
        *,
        local_keep: int,
        pending_keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Append one forward of T tokens: its finished entries kc, vc (B, n, KV, D) (vc None: tied K/V, the values
        are the keys), the indexer's keys ki (B, n, Di) (None without one), the exact keys and values k, v
        (B, T, KV, D) (v None when tied) and ``hidden``, the hidden states it pooled from (``pooling_input``).
        Keeps every entry, the last ``local_keep`` exact tokens and the last ``pending_keep`` hidden states (at most
        those given); returns every entry and the exact tokens held before the forward with its own (kc, vc, ki, k,
        v) for its attention."""
        tied = vc is None
        k_all = _cat(self.k, k)
        v_all = k_all if tied else _cat(self.v, v)
        self.k = k_all[:, k_all.shape[1] - local_keep :]
        self.v = self.k if tied else v_all[:, v_all.shape[1] - local_keep :]
        kc, vc, ki = self.add_entries(kc, vc, ki, hidden, k.shape[1], pending_keep=pending_keep)
        return kc, vc, ki, k_all, v_all

    def add_entries(
        self,
        kc: torch.Tensor,
        vc: Optional[torch.Tensor],
        ki: Optional[torch.Tensor],
        hidden: torch.Tensor,
        tokens: int,
        *,
        pending_keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The entry part of ``append`` for a forward of ``tokens`` tokens (a moved grid's cache has no other):
        appends its entries kc, vc, ki (vc None: tied), keeps the last ``pending_keep`` of ``hidden`` (at most
        those given) and returns every entry (kc, vc, ki)."""
        tied = vc is None
        kc = _cat(self.kc, kc)
        vc = kc if tied else _cat(self.vc, vc)
        ki = None if ki is None else _cat(self.ki, ki)
        self.kc, self.vc, self.ki = kc, (None if tied else vc), ki
        self.pending = hidden[:, hidden.shape[1] - min(pending_keep, hidden.shape[1]) :]
        self.length += tokens
        return kc, vc, ki

    def nbytes(self) -> dict[str, int]:
        """Bytes held by part: ``entries``, ``index``, ``local``, ``pending`` (a moved grid's entries and pending
        states under its own parts' names, summed in)."""
        if self.grids:
            parts = [g.nbytes() for g in self.grids]
            return {name: sum(p[name] for p in parts) for name in parts[0]}
        tied = self.v is self.k
        out = {
            "entries": _nbytes(self.kc, None if self.vc is self.kc else self.vc),
            "index": _nbytes(self.ki),
            "local": _nbytes(self.k, None if tied else self.v),
            "pending": _nbytes(self.pending),
        }
        if self.moved is not None:
            out = {name: n + self.moved.nbytes()[name] for name, n in out.items()}
        return out


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
