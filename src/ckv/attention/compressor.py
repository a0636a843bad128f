"""The compressor of a compressed attention layer (docs/attention.md, "The compressor"): ``Compressor``, one
branch (keys, values, or the lightning indexer's keys) that pools each window of hidden states into one entry per KV
head, and ``CompressorGate``, the view of its learned gate that code outside ``ckv.attention`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ckv.attention.dispatch import Pooling
from ckv.config import ModelConfig
from ckv.geometry import offset_series


@dataclass(frozen=True)
class CompressorGate:
    """A compressor branch's learned gate, as its parameters (the tensors themselves: writing to them changes the
    model): ``weight`` the gate maps, offset-first (``Z_i`` (W, d, G), ``Z_s`` (W / stride, d, G) per series, or
    one shared ``Z`` (d, G)), and ``bias`` the offset-specific bias ``b_i`` (W, G), None with ``gate.bias: false``.
    ``G``: KV heads (scalar gates) or ``KV * head_dim`` (vector gates)."""

    weight: nn.Parameter
    bias: Optional[nn.Parameter]


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
    Public surface: ``payload`` (the payload maps), ``gate`` and ``pooling`` (the hook point of the gate weights);
    the gate's attribute names are private (they name the parameters in saved weights). The instance attributes of
    the surface are the ones annotated here.
    """

    payload: nn.Parameter
    pooling: Pooling

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

    @property
    def gate(self) -> Optional[CompressorGate]:
        """The learned gate's parameters; None for uniform averaging (``attention.gate: null``)."""
        return None if self.gate_weight is None else CompressorGate(self.gate_weight, self.gate_bias)

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
