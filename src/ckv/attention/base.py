"""What every attention backend shares: Q/K/V/O projections, per-head Q/K RMSNorm and RoPE, and the accounting
interface (parameters, FLOPs, KV-cache bytes, initialisation) that everything above ``ckv.attention`` asks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import nn

from ckv.attention.rope import Rotary
from ckv.config import AttentionConfig, ConfigError, ModelConfig
from ckv.norm import RMSNorm


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one attention layer, by part, averaged over a ``seq_len``-token sequence:
    ``projections`` (Q/K/V/O, with the low-rank query path's maps in place of the full-rank query map),
    ``attention`` (scores and weighted values over the visible (query, key) pairs: ``4 * head_dim`` per query head
    and pair), ``compressor`` (everything that makes the layer's compressed entries) and ``indexer`` (top-k
    selection: the lightning indexer's own compressor branch, its query and head-weight maps and its scoring of
    every visible entry, or the oracle's dense pass). Every part is >= 0."""

    projections: float
    attention: float
    compressor: float = 0.0
    indexer: float = 0.0


class AttentionBackend(nn.Module):
    """Base class of the attention backends.

    A subclass declares ``kind``, the ``impls`` it runs and the config class of its kind (``config_class``: the
    fields and option groups it takes; ``AttentionConfig``, every kind's fields, unless it takes more), may extend
    ``check`` to refuse configurations it cannot run, overrides ``resolve_impl`` when ``impl="auto"``
    has a choice to make, and implements ``forward(x, cache)`` and ``new_cache(batch_size)``.

    Accounting (OLMo-core's ``SequenceMixer``, torchtitan's model ``Config``): the backend answers, from the
    config alone, ``num_params`` (default: counted on a module built on the meta device), ``flops_per_token`` and
    ``kv_bytes_per_token`` (no default: a backend that does not declare them fails with a ConfigError naming its
    kind, never with another backend's figures), ``activation_elements_per_token`` (for ``ckv.train.plan``) and
    ``phase_stride`` (the period of a phase effect it may cause; None for none); a built module initialises its
    own parameters in ``init_weights``.

    Cross-layer KV sharing (``model.layers``' ``kv``; docs/attention.md): a kind that can be a source declares
    ``shared_kv`` (the stride and grid origins of what it publishes) and, called with ``shared`` (a dict of the
    model's forward), puts its entry sets (``EntrySet``) there under its layer index; a kind that can be a
    consumer sets ``reads_shared_kv`` and, built from a config with ``kv_source``, reads its source's sets from
    ``shared``.

    Public surface (what code outside ``ckv.attention`` may read, ``tests/attention/test_surface.py``): the methods,
    properties and class variables above, and the instance attributes annotated here: the head layout
    (``n_heads``, ``kv_heads``, ``head_dim``), ``o_proj`` (whose input is the concatenated head outputs, query heads
    grouped by KV head: the hook point of the knock-outs) and ``rotary`` (the layer's RoPE, its ``inv_freq``). Every
    other attribute a constructor sets is private to the package."""

    n_heads: int
    kv_heads: int
    head_dim: int
    o_proj: nn.Linear
    rotary: Rotary
    kind: ClassVar[str]
    impls: ClassVar[tuple[str, ...]] = ("auto", "torch")
    config_class: ClassVar[type[AttentionConfig]] = AttentionConfig
    reads_shared_kv: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.check(config)
        a = config.attention
        self.config = config
        self.layer_idx = layer_idx
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        d, hd = config.d_model, config.head_dim
        # attention.query (DeepSeek-V4's low-rank query path): the latent RMSNorm(q_a x); q_proj then maps the latent
        query = a.option("query")
        self.q_latent = None if query is None else QueryLatent(d, query.lora_rank, config.norm_eps)
        self.q_proj = nn.Linear(d if query is None else query.lora_rank, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = None if a.tied_kv else nn.Linear(d, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.norm_eps) if a.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, config.norm_eps) if a.qk_norm else nn.Identity()
        theta = config.rope_theta if a.rope.theta is None else a.rope.theta
        self.rotary = Rotary(config.rope_dims, theta, side=a.rope.side, pairing=a.rope.pairing, yarn=a.rope.yarn)
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

    # ---- accounting ---------------------------------------------------------------------------------------------
    @classmethod
    def num_params(cls, config: ModelConfig) -> int:
        """Parameters of one layer's attention module (default: counted on a module built on the meta device)."""
        with torch.device("meta"):
            return sum(p.numel() for p in cls(config, 0).parameters())

    @classmethod
    def projection_params(cls, config: ModelConfig) -> int:
        """Parameters of the shared Q/K/V/O projections and Q/K norms."""
        d, h, kv, hd, a = config.d_model, config.n_heads, config.kv_heads, config.head_dim, config.attention
        return d * h * hd * 2 + d * kv * hd * (1 if a.tied_kv else 2) + (2 * hd if a.qk_norm else 0)

    @classmethod
    def projection_flops(cls, config: ModelConfig) -> float:
        """Forward FLOPs per token of the Q/K/V/O projections."""
        d, h, kv, hd = config.d_model, config.n_heads, config.kv_heads, config.head_dim
        return 2.0 * (d * h * hd * 2 + d * kv * hd * (1 if config.attention.tied_kv else 2))

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int, layer_idx: int = 0) -> LayerFlops:
        """Forward FLOPs per token of layer ``layer_idx`` over sequences of ``seq_len`` tokens."""
        raise ConfigError(
            f"attention.kind={cls.kind!r} ({cls.__name__}) does not declare flops_per_token: its FLOPs are unknown"
        )

    @classmethod
    def kv_bytes_per_token(
        cls, config: ModelConfig, seq_len: Optional[int] = None, layer_idx: int = 0, bytes_per_element: int = 2
    ) -> float:
        """Bytes layer ``layer_idx``'s decode cache holds per token: everything it holds after ``seq_len`` tokens
        divided by ``seq_len``, or (``seq_len=None``) the long-sequence figure, the growth per token."""
        raise ConfigError(
            f"attention.kind={cls.kind!r} ({cls.__name__}) does not declare kv_bytes_per_token: its cache is unknown"
        )

    @classmethod
    def kv_elements_per_token(
        cls, config: ModelConfig, seq_len: Optional[int] = None, layer_idx: int = 0
    ) -> dict[str, float]:
        """``kv_bytes_per_token`` in elements, by part of the decode cache (the parts its ``nbytes`` names; a key's
        rotated dims apart as ``<part>.rope``), so that each part can be priced at its own dtype
        (``ckv.flops.kv_bytes_by_part``). Default: the whole cache as one part, ``cache``."""
        return {"cache": cls.kv_bytes_per_token(config, seq_len, layer_idx, bytes_per_element=1)}

    @classmethod
    def prefill_bytes(
        cls, config: ModelConfig, chunk: int, seq_len: int, device: torch.device, bytes_per_element: int = 4
    ) -> float:
        """Transient bytes per sequence one layer holds at its worst moment while ``chunk`` queries ending at
        ``seq_len`` attend (score matrices, gathered keys; freed before the next layer), on ``device``; for the
        memory estimate of long prompts (``ckv.eval.memory``)."""
        raise ConfigError(
            f"attention.kind={cls.kind!r} ({cls.__name__}) does not declare prefill_bytes: its prefill memory is "
            "unknown"
        )

    @classmethod
    def index_bytes(cls, config: ModelConfig, chunk: int, seq_len: int) -> float:
        """Transient bytes per sequence of a top-k indexer scoring ``chunk`` queries ending at ``seq_len`` (it runs
        before the attention: the two never coexist); 0 for a backend without one."""
        return 0.0

    @classmethod
    def kl_bytes(cls, config: ModelConfig, tokens: int, seq_len: int) -> float:
        """Transient bytes per sequence of the indexer's training loss over ``tokens`` queries of a ``seq_len``-token
        sequence (``ckv.train.plan``); 0 for a backend without an indexer."""
        return 0.0

    @classmethod
    def working_bytes(cls, config: ModelConfig, seq_len: int, device: torch.device) -> dict[str, float]:
        """The transient bytes per sequence of one layer's training step on ``device`` beyond what autograd saves,
        by part (``attention``, ``index scores``, ``KL logits``; one part at a time: ``ckv.train.plan`` takes the
        largest). Default: none (fused kernels and SDPA's causal path hold no score matrix)."""
        return {}

    @classmethod
    def prefill_note(cls, config: ModelConfig, device: torch.device) -> str:
        """One line saying how ``prefill_bytes`` counts (which implementation runs on ``device``)."""
        return f"attention.kind={cls.kind}"

    @classmethod
    def activation_elements_per_token(cls, config: ModelConfig) -> float:
        """Activation elements autograd saves per token in this layer's attention (Q/K/V before and after their
        norms and the output: ``4 H D + 4 KV D``), for ``ckv.train.plan``."""
        return 4 * config.n_heads * config.head_dim + 4 * config.kv_heads * config.head_dim

    @classmethod
    def phase_stride(cls, config: ModelConfig) -> Optional[int]:
        """The period of the phase effects this attention can cause (None: positions have no phase)."""
        return None

    @classmethod
    def shared_kv(cls, config: ModelConfig, layer_idx: int) -> tuple[int, tuple[int, ...]]:
        """As the source of a KV-sharing group (``kv: source``), what layer ``layer_idx`` publishes: the positions
        per entry (1: every token's key and value) and the grid origin of each set of entries (its own first);
        ConfigError saying why when this kind cannot be a source (the default)."""
        raise ConfigError(f"attention.kind={cls.kind!r} does not publish its KV to other layers")

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Normal(0, std) for the Q/K/V maps (and the query latent's), Normal(0, out_std) for the output map, norm
        gains 1."""
        if self.q_latent is not None:
            self.q_latent.init_weights(std)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            if proj is not None:
                proj.weight.normal_(0.0, std)
        self.o_proj.weight.normal_(0.0, out_std)
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                norm.reset_parameters()

    # ---- running ------------------------------------------------------------------------------------------------
    def impl_for(self, x: torch.Tensor) -> str:
        """This module's ``impl`` resolved for ``x``'s device and dtype, once per (device, dtype)."""
        key = (x.device, x.dtype)
        if key not in self._resolved_impls:
            self._resolved_impls[key] = self.resolve_impl(self.impl, x.device, x.dtype)
        return self._resolved_impls[key]

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """The input of the query map: x (B, T, d) itself, or the low-rank path's latent (B, T, lora_rank)."""
        return x if self.q_latent is None else self.q_latent(x)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, latent: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, d) -> q (B, T, H, D), k and v (B, T, KV, D), normalised and rotated (v = k when tied); the
        queries are mapped from ``latent`` when given (``query_latent(x)``, computed once by a caller that also
        needs it), else from ``query_latent(x)``."""
        B, T, _ = x.shape
        latent = self.query_latent(x) if latent is None else latent
        q = self.rotary(self.q_norm(self.q_proj(latent).view(B, T, self.n_heads, self.head_dim)), positions)
        k = self.rotary(self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)), positions)
        v = k if self.v_proj is None else self.v_proj(x).view(B, T, self.kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: Optional[object] = None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def new_cache(self, batch_size: int) -> object:  # pragma: no cover
        raise NotImplementedError


class QueryLatent(nn.Module):
    """DeepSeek-V4's query latent (``attention.query``): ``RMSNorm(proj x)``, a down-projection of the input to
    ``rank`` dims and a weighted RMSNorm (V4's ``q_a_proj`` and ``q_a_norm``)."""

    def __init__(self, d_model: int, rank: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, rank, bias=False)
        self.norm = RMSNorm(rank, eps)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        self.proj.weight.normal_(0.0, std)
        self.norm.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))  # (B, T, rank)


def residual_std(std: float, n_layers: int) -> float:
    """The init std of maps that write into the residual stream (output projections): ``std / sqrt(2 n_layers)``."""
    return std / math.sqrt(2 * n_layers)
