"""Peak memory of the needle test's chunked prefill, estimated from a model's config alone (no weights).

The peak of scoring a batch of ``B`` prompts of ``T`` tokens, ``c`` tokens per forward, sits in the last chunk:

    peak = weights + KV cache after T tokens + the largest layer's transient tensors for c queries over T keys
           + the chunk's activations

- **KV cache** per layer and sequence: for ckv models what each layer's attention backend declares
  (``kv_bytes_per_token``: full attention ``2 x KV heads x head_dim`` per token; compressed attention its
  finished entries, the exact keys of the local window and the pending hidden states; a sliding window only
  its window), summed layer by layer, so each layer of a layer schedule counts its own;
  DeepSeek-V4's CSA/HCA layers their window, their compressed entries (``T / rate``) and, for CSA, the
  indexer's entries.
- **Transient** (one layer at a time; freed before the next): attention implementations that materialise
  ``(B, H, c, keys)`` scores hold several copies at their worst moment: transformers' eager attention 8 bytes
  per score element (the scores in the compute dtype, their fp32 softmax and its cast back; fp32: two fp32
  copies), DeepSeek-V4's eager attention three copies in the compute dtype (it appends the sink logit,
  subtracts the maximum and softmaxes in that dtype while the masked scores stay referenced), ckv's torch
  reference of compressed attention four fp32 copies (scores, their concatenation with the local window's, the
  masked copy, ``exp``); ckv's fast torch path one query block's working memory (``blocked.working_bytes``, the
  block ``blocked.choose_block`` picks); ckv's lightning indexer one of its query chunks (``index_bytes``).
  DeepSeek-V4's lightning indexer computes ``(B, c, index heads, entries)`` fp32 scores
  and holds three copies (scores, ``relu``, scaled) before it sums the heads. Kernels that never materialise
  scores (SDPA, flash attention, ckv's Triton kernels) hold the keys and values expanded to every query head
  (grouped-query attention without native support) and the mask.
- **Activations** of the chunk: hidden states, projections and the MLP's intermediates (a rough count).

``ckv_model_memory`` (ckv models, from ``ModelConfig``) and ``hf_model_memory`` (transformers models, from their
config) build the description; ``estimate`` prices one chunk, ``pick_chunk`` the largest chunk that fits a budget.
The CPU test (``tests/eval/test_memory.py``) checks the estimate against the measured resident-set high-water
mark within a stated factor; docs/evaluation.md lists the figures for DeepSeek-V4 and ckv's models.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ckv.attention import AttentionBackend, layer_backends
from ckv.config import ModelConfig
from ckv.flops import parameter_count
from ckv.geometry import num_entries, shifted_origin

GB = 1e9
MIN_CHUNK = 64  # the smallest prefill chunk ``pick_chunk`` tries
MEMORY_FRACTION = 0.9  # of the device's free memory that ``device_budget`` offers (the rest: allocator slack)
FP32 = 4


def gb(n_bytes: float) -> str:
    """Bytes as GB for a reader: three significant digits, whole GB from 1,000 on (``12.3``, ``1,410``)."""
    x = n_bytes / GB
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def _zero(c: int, T: int) -> float:
    return 0.0


@dataclass(frozen=True)
class LayerGroup:
    """``count`` layers that cost the same. Per sequence: ``cache(T)`` bytes of KV cache after ``T`` tokens;
    ``scores(c, T)`` the bytes of the attention's transient tensors for a chunk of ``c`` queries ending at ``T``;
    ``indexer(c, T)`` those of a lightning indexer (it runs before the attention: the two never coexist)."""

    name: str
    count: int
    cache: Callable[[int], float]
    scores: Callable[[int, int], float]
    indexer: Callable[[int, int], float] = _zero


@dataclass(frozen=True)
class ModelMemory:
    """What the estimate knows of a model: ``weights`` (bytes), its layer groups, activation bytes per token of
    a chunk, and ``notes`` saying how attention is counted."""

    name: str
    weights: float
    layers: tuple[LayerGroup, ...]
    activation_per_token: float
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkEstimate:
    """The estimated peak (bytes) of one prefill chunk: its parts for ``batch`` prompts of ``context`` tokens,
    ``chunk`` tokens per forward. ``scores``/``indexer``: the largest layer's attention and indexer transients;
    ``transient``: the largest layer's worst moment (the larger of the two) plus the activations."""

    chunk: int
    batch: int
    context: int
    weights: float
    cache: float
    scores: float
    indexer: float
    activations: float
    transient: float
    notes: tuple[str, ...] = field(default=())

    @property
    def peak(self) -> float:
        return self.weights + self.cache + self.transient

    def to_dict(self) -> dict:
        """JSON-ready, in bytes (for results.json)."""
        keys = ("chunk", "batch", "context", "weights", "cache", "scores", "indexer", "activations", "transient")
        return {**{k: getattr(self, k) for k in keys}, "peak": self.peak, "notes": list(self.notes)}

    def line(self) -> str:
        """``peak 12.3 GB = weights ... + KV cache ... + attention scores ... (indexer ...) + activations ...``."""
        return (
            f"chunk {self.chunk}, batch {self.batch}: peak {gb(self.peak)} GB = weights {gb(self.weights)}"
            f" + KV cache {gb(self.cache)} + largest layer's attention scores {gb(self.scores)}"
            f" (indexer scores {gb(self.indexer)}) + activations {gb(self.activations)} GB"
        )


def estimate(memory: ModelMemory, batch: int, context: int, chunk: int) -> ChunkEstimate:
    """The peak of the last chunk of a chunked prefill of ``batch`` prompts of ``context`` tokens."""
    c, T = min(chunk, context), context
    cache = batch * sum(g.count * g.cache(T) for g in memory.layers)
    scores = batch * max((g.scores(c, T) for g in memory.layers), default=0.0)
    indexer = batch * max((g.indexer(c, T) for g in memory.layers), default=0.0)
    worst = batch * max((max(g.scores(c, T), g.indexer(c, T)) for g in memory.layers), default=0.0)
    activations = batch * c * memory.activation_per_token
    return ChunkEstimate(
        c, batch, T, memory.weights, cache, scores, indexer, activations, worst + activations, memory.notes
    )


def chunk_candidates(context: int) -> list[int]:
    """Chunks ``pick_chunk`` tries, largest first: the whole context, then powers of two down to ``MIN_CHUNK``."""
    powers = [1 << k for k in range(MIN_CHUNK.bit_length() - 1, context.bit_length()) if (1 << k) < context]
    return [context, *sorted(powers, reverse=True)]


def pick_chunk(
    memory: ModelMemory, batch: int, context: int, budget: float, *, weights_loaded: bool
) -> tuple[Optional[ChunkEstimate], ChunkEstimate]:
    """The largest chunk whose peak fits ``budget`` bytes (``weights_loaded``: the budget is what is left after
    the weights, so they are not counted again), or ``None``; second, the estimate of the smallest chunk tried."""
    smallest = estimate(memory, batch, context, MIN_CHUNK)
    for chunk in chunk_candidates(context):
        est = estimate(memory, batch, context, chunk)
        if needed(est, weights_loaded) <= budget:
            return est, smallest
    return None, smallest


def needed(est: ChunkEstimate, weights_loaded: bool) -> float:
    """The bytes a chunk still needs: its peak, less the weights when they are already in memory."""
    return est.peak - (est.weights if weights_loaded else 0.0)


def device_budget(device: torch.device) -> Optional[float]:
    """``MEMORY_FRACTION`` of the free memory of ``device`` in bytes (CUDA: ``mem_get_info``; CPU: Linux's
    ``MemAvailable``), or ``None`` when it cannot be read."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return MEMORY_FRACTION * free
    if device.type == "cpu":
        meminfo = Path("/proc/meminfo")
        if meminfo.is_file():
            found = re.search(r"MemAvailable:\s+(\d+) kB", meminfo.read_text())
            if found:
                return MEMORY_FRACTION * int(found.group(1)) * 1024
    return None


# ---- ckv models ------------------------------------------------------------------------------------------------
def ckv_model_memory(config: ModelConfig, device: torch.device) -> ModelMemory:
    """The memory description of a ckv ``Transformer`` (fp32 weights and activations, as ``load_ckv_model`` runs
    it) on ``device``, from each layer's attention backend's own accounting (``ckv.attention.layer_backends``):
    one layer group per run of consecutive layers with the same attention (one group for a uniform stack, one per
    segment of a layer schedule), with the decode cache after ``T`` tokens (``kv_bytes_per_token``, averaged over
    the group's layers, which differ only by their grid offsets), one layer's prefill transients
    (``prefill_bytes``: the reference's score copies, or the fast path's query block) and its lightning indexer's
    (``index_bytes``); the activations of the widest layer."""
    b, H, D, d = FP32, config.n_heads, config.head_dim, config.d_model
    layers = layer_backends(config)  # each layer's backend, after it checked the layer's config
    runs = [  # consecutive layers that share one attention config (a segment of a schedule)
        [(i, backend, layer) for i, (backend, layer) in run]
        for _, run in itertools.groupby(enumerate(layers), key=lambda item: id(item[1][1].attention))
    ]
    groups, notes = [], []
    for run in runs:
        groups.append(_ckv_layer_group(run, device))
        _, backend, layer = run[0]
        note = backend.prefill_note(layer, device)
        if note not in notes:
            notes.append(note)
    KV = max(layer.kv_heads for _, layer in layers)
    activation = b * (4 * d + 2 * (H + 2 * KV) * D + 3 * config.mlp_dim)
    return ModelMemory("ckv", FP32 * parameter_count(config), tuple(groups), activation, tuple(notes))


def _ckv_layer_group(run: list[tuple[int, type[AttentionBackend], ModelConfig]], device: torch.device) -> LayerGroup:
    """The ``LayerGroup`` of consecutive layers ``run`` (index, backend, layer config) sharing one attention."""
    b, n, (_, backend, config) = FP32, len(run), run[0]

    def cache(T: int) -> float:
        return sum(backend.kv_bytes_per_token(layer, T, i, b) for i, _, layer in run) * T / n

    def scores(c: int, T: int) -> float:
        return backend.prefill_bytes(config, c, T, device, b)

    def indexer(c: int, T: int) -> float:
        return backend.index_bytes(config, c, T)

    return LayerGroup(config.attention.kind, n, cache, scores, indexer)


# ---- transformers models ---------------------------------------------------------------------------------------
def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _attention_scores(attn: str, H: int, KV: int, D: int, b: int) -> Callable[[int, int], float]:
    """Transient bytes per sequence of a transformers attention call over ``keys`` keys (``keys(c, T)``)."""

    def eager(c: int, keys: int) -> float:  # scores (b) + fp32 softmax (4) + its cast back (b); fp32: 2 x 4
        per_element = 2 * FP32 if b == FP32 else 2 * b + FP32
        return per_element * H * c * keys + 2 * H * keys * D * b * (H != KV) + c * keys * b

    def kernel(c: int, keys: int) -> float:  # SDPA: K/V repeated to every head, a bool mask and a float copy of it
        return 2 * H * keys * D * b * (H != KV) + c * keys * (1 + b)

    def flash(c: int, keys: int) -> float:
        return 0.0

    # any other implementation (sdpa, flex_attention, ...) is counted as a kernel without a score matrix
    return {"eager": eager, "flash_attention_2": flash, "flash_attention_3": flash}.get(attn, kernel)


def hf_model_memory(
    config: Any,
    dtype: torch.dtype,
    attn_implementation: str,
    n_params: int,
    dual_offsets: Optional[dict[str, int]] = None,
) -> ModelMemory:
    """The memory description of a transformers causal LM from its config: DeepSeek-V4 (``model_type``
    ``deepseek_v4``: sliding, CSA and HCA layers, the lightning indexer, eager attention; ``dual_offsets``: the
    compressed layer types that run dual-offset compression, ``ckv.eval.mitigation``, and their offsets) or a
    standard decoder (Llama, Qwen, Mistral, ...: full or sliding-window layers)."""
    b = torch.finfo(dtype).bits // 8
    L = int(_get(config, "num_hidden_layers"))
    H = int(_get(config, "num_attention_heads"))
    KV = int(_get(config, "num_key_value_heads", default=H))
    d = int(_get(config, "hidden_size"))
    D = int(_get(config, "head_dim", default=d // H))
    weights = float(n_params * b)
    if _get(config, "model_type") == "deepseek_v4":
        return _deepseek_v4_memory(config, b, L, H, D, d, weights, dual_offsets or {})
    window = _get(config, "sliding_window")
    types = list(_get(config, "layer_types", default=["full_attention"] * L))
    attention = _attention_scores(attn_implementation, H, KV, D, b)
    groups = []
    for kind in sorted(set(types)):
        sliding = kind == "sliding_attention" and window is not None

        def keys(c: int, T: int, sliding: bool = sliding) -> int:
            return min(T, window - 1 + c) if sliding else T  # type: ignore[operator]

        groups.append(
            LayerGroup(
                kind,
                types.count(kind),
                lambda T, sliding=sliding: b * 2 * KV * D * (min(T, window) if sliding else T),  # type: ignore[misc]
                lambda c, T, keys=keys: attention(c, keys(c, T)),
            )
        )
    F_ = int(_get(config, "intermediate_size", default=4 * d))
    activation = b * (4 * d + 2 * (H + 2 * KV) * D + 3 * F_)
    note = f"transformers {attn_implementation} attention" + (
        ": 8 bytes per (B, H, c, T) score element" if attn_implementation == "eager" else ""
    )
    return ModelMemory(type(config).__name__, weights, tuple(groups), activation, (note,))


def _deepseek_v4_memory(
    config: Any, b: int, L: int, H: int, D: int, d: int, weights: float, dual_offsets: dict[str, int]
) -> ModelMemory:
    """DeepSeek-V4 (transformers' eager-only implementation; one KV head, keys = values); a layer type in
    ``dual_offsets`` also holds and attends the entries of its grid moved by that offset
    (``geometry.shifted_origin``)."""
    w = int(config.sliding_window)
    rates = dict(config.compress_rates)
    Hi, Di = int(config.index_n_heads), int(config.index_head_dim)
    types = list(config.layer_types)
    groups = []
    for kind in sorted(set(types)):
        rate = rates.get(kind)
        indexed = kind == "compressed_sparse_attention"

        origin = None if kind not in dual_offsets or not rate else shifted_origin(0, dual_offsets[kind], rate)

        def entries(T: int, rate: Optional[int] = rate) -> int:
            return T // rate if rate else 0

        def moved(T: int, rate: Optional[int] = rate, origin: Optional[int] = origin) -> int:
            return 0 if origin is None else num_entries(T + origin, rate)  # dual-offset compression's second set

        def cache(
            T: int,
            entries: Callable[[int], int] = entries,
            moved: Callable[[int], int] = moved,
            indexed: bool = indexed,
        ) -> float:
            return b * (2 * min(T, w) * D + entries(T) * (D + (Di if indexed else 0)) + moved(T) * D)

        def scores(
            c: int, T: int, entries: Callable[[int], int] = entries, moved: Callable[[int], int] = moved
        ) -> float:
            keys = min(T, w - 1 + c) + entries(T) + moved(T)  # the sliding window's keys plus every entry
            # 3 copies of (H, c, keys + sink) in the compute dtype (the masked scores stay referenced while the
            # sink is appended, the max subtracted and the softmax taken), K/V repeated to all H heads, the mask
            return 3 * b * H * c * (keys + 1) + 2 * H * keys * D * b + 2 * c * keys * b

        def indexer(c: int, T: int, entries: Callable[[int], int] = entries, indexed: bool = indexed) -> float:
            return 3 * FP32 * c * Hi * entries(T) if indexed else 0.0  # fp32 (c, index heads, entries), 3 copies

        groups.append(LayerGroup(kind, types.count(kind), cache, scores, indexer))
    hc = int(getattr(config, "hc_mult", 1))
    ffn = int(config.moe_intermediate_size) * (int(config.num_experts_per_tok) + int(config.n_shared_experts))
    activation = FP32 * hc * d * 4 + b * (2 * H * D + 3 * ffn)
    notes = (
        "DeepSeek-V4 eager attention: 3 copies of (B, H, c, window + c + T/rate) scores in the compute dtype",
        "lightning indexer: 3 fp32 copies of (B, c, index heads, T/4) scores",
    )
    return ModelMemory("DeepseekV4", weights, tuple(groups), activation, notes)
