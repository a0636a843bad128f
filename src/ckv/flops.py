"""Model FLOPs per token and model FLOPs utilisation (MFU).

Counted (useful matmul FLOPs, 2 per multiply-add; norms, RoPE, softmax and other elementwise work are left out,
as in the PaLM/Chinchilla convention):
- every linear map used once per token (Q/K/V/O, SwiGLU gate/up/down, the LM head; the embedding is a lookup and
  costs nothing): ``2 * in * out`` per token in the forward;
- attention: ``4 * head_dim`` per query head and visible (query, key) pair (``Q K^T`` and ``P V``); full causal
  attention sees ``t + 1`` keys at position ``t``; compressed attention sees the visible entries plus the exact
  keys of its local window, both taken from ``ckv.geometry`` (the one source of truth), never counted as full;
  a layer with a shifted grid (``attention.grid_offsets``) is counted in its own grid coordinates, layer by layer;
- the compressor: each entry maps its ``window`` hidden states (absent ones included: they are computed as zeros)
  through the payload and gate maps, ``2 * d_model * (kv_heads * head_dim + gate_dim)`` per token and entry per
  branch, plus the gated sum ``2 * window * kv_heads * head_dim`` per entry per branch; token mixing
  (``attention.mixing='conv'``) adds ``2 * mixing_kernel * d_model`` per token per branch.
Training FLOPs are 3x the forward (backward = 2x forward; activation recomputation is not counted, so MFU stays
comparable across checkpointing modes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ckv.config import ConfigError, ModelConfig
from ckv.geometry import grid_origin, local_start, num_entries, visible_entries

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s. Sources: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM
# 989.4 TFLOPS, H100 PCIe 756 TFLOPS bf16 dense; the 1,979 / 1,513 figures are with 2:4 sparsity); NVIDIA H200
# datasheet (989 TFLOPS: the H100 SXM die with more HBM); NVIDIA A100 datasheet (312 TFLOPS bf16 dense).
# Matched by substring of torch.cuda.get_device_name(), longest key first ("H100 PCIe" before "H100").
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
}


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every per-token linear map of one block plus the head, keyed by module name (one block)."""
    d, h, kv, hd = config.d_model, config.n_heads, config.kv_heads, config.head_dim
    shapes = {
        "q_proj": (d, h * hd),
        "k_proj": (d, kv * hd),
        "o_proj": (h * hd, d),
        "gate_proj": (d, config.mlp_dim),
        "up_proj": (d, config.mlp_dim),
        "down_proj": (config.mlp_dim, d),
    }
    if not config.attention.tied_kv:
        shapes["v_proj"] = (d, kv * hd)
    return shapes


def _compressor_branches(config: ModelConfig) -> int:
    a = config.attention
    return 0 if not a.compressed else (1 if a.tied_kv else 2)


def _gate_dim(config: ModelConfig) -> int:
    a = config.attention
    if a.pooling != "gate":
        return 0
    return config.kv_heads if a.gate == "scalar" else config.kv_heads * config.head_dim


def parameter_count(config: ModelConfig) -> int:
    """Parameters of ``Transformer(config)`` from the shapes alone (tied embeddings counted once)."""
    d, hd, a = config.d_model, config.head_dim, config.attention
    block = sum(i * o for i, o in linear_shapes(config).values()) + 2 * d  # + the two pre-norm gains
    if a.qk_norm:
        block += 2 * hd
    branches = _compressor_branches(config)
    if branches:
        lead = {"specific": a.window, "series": a.window // a.stride}.get(a.offset_maps, 1)  # maps per branch
        out, g = config.kv_heads * hd, _gate_dim(config)
        per_branch = lead * d * out + lead * d * g + (a.window * g if g and a.gate_bias else 0)
        per_branch += a.mixing_kernel * d if a.mixing == "conv" else 0  # the causal depthwise mixing taps
        block += branches * per_branch + (hd if a.qk_norm else 0)  # + the compressed-key norm
        block += config.n_heads if a.sink else 0  # one attention-sink logit per query head
    embed = config.vocab_size * d
    return config.n_layers * block + embed * (1 if config.tie_embeddings else 2) + d  # + the final norm


def _layer_entries(seq_len: int, config: ModelConfig, layer_idx: int) -> int:
    """Entries layer ``layer_idx`` pools over ``seq_len`` tokens (its grid shifted by its grid offset)."""
    a = config.attention
    return num_entries(seq_len + grid_origin(config.grid_offset(layer_idx), a.stride), a.stride)


def visible_pairs(seq_len: int, config: ModelConfig, layer_idx: int = 0) -> int:
    """(query, key) pairs one query head scores over a sequence of ``seq_len`` tokens in layer ``layer_idx``
    (layers differ only by their grid offsets)."""
    a = config.attention
    if not a.compressed:
        return seq_len * (seq_len + 1) // 2
    P = grid_origin(config.grid_offset(layer_idx), a.stride)  # grid coordinates g = t + P, present from P
    e_total = num_entries(seq_len + P, a.stride)
    pairs = 0
    for t in range(P, seq_len + P):
        entries = min(visible_entries(t, a.stride), e_total)
        local = t - max(local_start(t, a.local_window, a.stride), P) + 1
        pairs += entries + max(local, 0)
    return pairs


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token, by part, averaged over the positions of a ``seq_len``-token sequence."""

    seq_len: int
    linear: float  # Q/K/V/O, MLP and the LM head
    attention: float  # scores and weighted values over the visible pairs
    compressor: float  # payload/gate maps and gated sums of the entries

    @property
    def forward(self) -> float:
        return self.linear + self.attention + self.compressor

    @property
    def training(self) -> float:
        """Forward + backward (3x forward)."""
        return 3.0 * self.forward


def flops_per_token(config: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Model FLOPs per token for sequences of ``seq_len`` tokens (see the module docstring for what counts)."""
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be >= 1")
    a, L = config.attention, config.n_layers
    linear = 2.0 * (L * sum(i * o for i, o in linear_shapes(config).values()) + config.d_model * config.vocab_size)
    if a.grid_offsets is None:  # every layer has the same grid
        pairs = L * visible_pairs(seq_len, config)
    else:
        pairs = sum(visible_pairs(seq_len, config, layer) for layer in range(L))
    attention = 4.0 * config.head_dim * config.n_heads * pairs / seq_len
    compressor = 0.0
    branches = _compressor_branches(config)
    if branches:
        entries = sum(_layer_entries(seq_len, config, layer) for layer in range(L))  # all layers
        out = config.kv_heads * config.head_dim
        per_entry = a.window * 2.0 * config.d_model * (out + _gate_dim(config)) + 2.0 * a.window * out
        compressor = branches * per_entry * entries / seq_len
        if a.mixing == "conv":
            compressor += L * branches * 2.0 * a.mixing_kernel * config.d_model
    return FlopsPerToken(seq_len=seq_len, linear=linear, attention=attention, compressor=compressor)


def peak_flops(device_name: Optional[str] = None, override: Optional[float] = None) -> Optional[float]:
    """Dense bf16 peak FLOP/s: ``override`` when given, else the table entry whose key is a substring of
    ``device_name`` (default: the current CUDA device's name); None when unknown (e.g. on CPU)."""
    if override is not None:
        if override <= 0:
            raise ConfigError(f"peak FLOP/s override {override} must be > 0")
        return float(override)
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_BF16_FLOPS[key]
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (per device: pass per-device tokens/s)."""
    if peak <= 0:
        raise ConfigError(f"peak FLOP/s {peak} must be > 0")
    return tokens_per_s * flops_per_token / peak
