"""Model parameters, FLOPs per token, KV-cache bytes per token, and model FLOPs utilisation (MFU).

Counted (useful matmul FLOPs, 2 per multiply-add; norms, RoPE, softmax and other elementwise work are left out,
as in the PaLM/Chinchilla convention): every linear map used once per token (SwiGLU gate/up/down, the LM head;
the embedding is a lookup and costs nothing): ``2 * in * out`` per token in the forward; and each layer's
attention as its backend declares it (``AttentionBackend.flops_per_token``: its Q/K/V/O projections, ``4 *
head_dim`` per query head and visible (query, key) pair, and for compressed attention the compressor and its
option groups, with top-k selection's indexer on a line of its own). Nothing here knows an attention kind:
parameters, FLOPs and cache bytes of attention come from the backend the registry holds for each layer's
attention kind, layer by layer (``ckv.attention.layer_backends``: layers differ by their grid offsets, and under a
layer schedule, ``model.layers``, by their attention config). KV-cache bytes can be priced per part of the cache,
each at its own dtype (``kv_bytes_by_part``; ``KV_PRECISIONS``, DeepSeek-V4's inference dtypes among them).
Training FLOPs are 3x the forward (backward = 2x forward; activation recomputation is not counted, so MFU stays
comparable across checkpointing modes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ckv.attention import layer_backends
from ckv.config import ConfigError, ModelConfig
from ckv.options.selection import QUANT_BLOCK

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


def mlp_params(config: ModelConfig) -> int:
    """Parameters of one SwiGLU block (gate, up and down maps)."""
    return 3 * config.d_model * config.mlp_dim


def parameter_count(config: ModelConfig) -> int:
    """Parameters of ``Transformer(config)`` from the shapes alone (tied embeddings counted once)."""
    d = config.d_model
    attention = sum(backend.num_params(layer) for backend, layer in layer_backends(config))
    blocks = attention + config.n_layers * (mlp_params(config) + 2 * d)  # + the two pre-norm gains
    embed = config.vocab_size * d
    return blocks + embed * (1 if config.tie_embeddings else 2) + d  # + the final norm


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token, by part, averaged over the positions of a ``seq_len``-token sequence."""

    seq_len: int
    linear: float  # Q/K/V/O (the low-rank query path's maps in place of the query map), MLP and the LM head
    attention: float  # scores and weighted values over the visible pairs
    compressor: float  # what makes compressed entries (maps, pooling, option groups)
    indexer: float = 0.0  # top-k selection: the lightning indexer's branch, maps and scoring (or the oracle's pass)

    @property
    def forward(self) -> float:
        return self.linear + self.attention + self.compressor + self.indexer

    @property
    def training(self) -> float:
        """Forward + backward (3x forward)."""
        return 3.0 * self.forward


def flops_per_token(config: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Model FLOPs per token for sequences of ``seq_len`` tokens (see the module docstring for what counts)."""
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be >= 1")
    layers = [backend.flops_per_token(layer, seq_len, i) for i, (backend, layer) in enumerate(layer_backends(config))]
    mlp_and_head = 2.0 * (config.n_layers * mlp_params(config) + config.d_model * config.vocab_size)
    return FlopsPerToken(
        seq_len=seq_len,
        linear=mlp_and_head + sum(f.projections for f in layers),
        attention=sum(f.attention for f in layers),
        compressor=sum(f.compressor for f in layers),
        indexer=sum(f.indexer for f in layers),
    )


def kv_bytes_per_token(config: ModelConfig, seq_len: Optional[int] = None, bytes_per_element: int = 2) -> float:
    """KV-cache bytes per token over all layers: what the decode cache holds after ``seq_len`` tokens divided by
    ``seq_len``, or (``seq_len=None``) the long-sequence figure (the growth per token); ``AttentionBackend``."""
    return sum(
        backend.kv_bytes_per_token(layer, seq_len, i, bytes_per_element)
        for i, (backend, layer) in enumerate(layer_backends(config))
    )


@dataclass(frozen=True)
class CacheDtype:
    """A storage format of cached elements: ``bits`` per element plus, for block-scaled formats, ``scale_bits``
    per block of ``block`` elements."""

    name: str
    bits: int
    scale_bits: int = 0
    block: int = 1

    @property
    def bytes_per_element(self) -> float:
        return (self.bits + self.scale_bits / self.block) / 8


CACHE_DTYPES: dict[str, CacheDtype] = {
    "fp32": CacheDtype("fp32", 32),
    "bf16": CacheDtype("bf16", 16),
    # FlashMLA's FP8 KV-cache format for DeepSeek's sparse attention (V3.2): e4m3 values, one fp32 scale per 128
    # (the block ``attention.selection.quant: fp8`` fake-quantises the indexer in)
    "fp8": CacheDtype("fp8 e4m3, fp32 scale per 128", 8, 32, QUANT_BLOCK["fp8"]),
    # OCP Microscaling MXFP4: e2m1 values, one e8m0 (8-bit) scale per block of 32 (``selection.quant: fp4``'s)
    "fp4": CacheDtype("fp4 e2m1, e8m0 scale per 32 (MXFP4)", 4, 8, QUANT_BLOCK["fp4"]),
}


@dataclass(frozen=True)
class KVPrecision:
    """The dtype (``CACHE_DTYPES`` key) of each kind of cached element: ``main`` (compressed entries' and exact
    keys' unrotated dims, values), ``rope`` (keys' rotated dims), ``index`` (the lightning indexer's keys) and
    ``pending`` (hidden states of unfinished windows)."""

    name: str
    main: str
    rope: str
    index: str
    pending: str

    def dtype(self, part: str) -> CacheDtype:
        """The dtype of a part of ``AttentionBackend.kv_elements_per_token`` (``entries.rope`` -> ``rope``, ...)."""
        kind = "rope" if part.endswith(".rope") else part if part in ("index", "pending") else "main"
        return CACHE_DTYPES[getattr(self, kind)]


KV_PRECISIONS: dict[str, KVPrecision] = {
    "fp32": KVPrecision("fp32", "fp32", "fp32", "fp32", "fp32"),
    "bf16": KVPrecision("bf16", "bf16", "bf16", "bf16", "bf16"),
    # DeepSeek's inference dtypes: FP8 entries with the RoPE dims kept in BF16 (FlashMLA's sparse-attention cache:
    # 512 fp8 dims + 4 fp32 scales + 64 bf16 RoPE dims = 656 bytes per token), the indexer's keys in FP4 (V4's
    # serving stacks; docs/long_context.md), the pending window's hidden states in BF16
    "deepseek_v4": KVPrecision("deepseek_v4", main="fp8", rope="bf16", index="fp4", pending="bf16"),
}


def kv_bytes_by_part(
    config: ModelConfig, seq_len: Optional[int] = None, precision: str = "bf16"
) -> dict[str, tuple[float, str]]:
    """KV-cache bytes per token over all layers by part of the cache (``kv_elements_per_token``: for compressed
    attention ``entries``, ``entries.rope``, ``index``, ``local``, ``local.rope``, ``pending``), each priced at
    its dtype under ``precision`` (a ``KV_PRECISIONS`` key): {part: (bytes per token, dtype name)}."""
    if precision not in KV_PRECISIONS:
        raise ConfigError(f"KV-cache precision {precision!r} is unknown; choose one of {sorted(KV_PRECISIONS)}")
    p = KV_PRECISIONS[precision]
    out: dict[str, tuple[float, str]] = {}
    for i, (backend, layer) in enumerate(layer_backends(config)):
        for part, n in backend.kv_elements_per_token(layer, seq_len, i).items():
            dtype = p.dtype(part)
            out[part] = (out.get(part, (0.0, ""))[0] + n * dtype.bytes_per_element, dtype.name)
    return out


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
