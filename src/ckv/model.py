"""A Qwen3-style decoder with a pluggable attention backend.

embed -> n_layers x [RMSNorm -> attention -> +residual -> RMSNorm -> SwiGLU -> +residual] -> RMSNorm -> head
Module names follow transformers' Qwen3 so that weights convert by renaming (see ckv.io.hf). Under cross-layer KV
sharing (``model.layers``' ``kv``) a forward threads one dict through the blocks: each source layer puts its
entries there, the consumers after it read them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ckv.attention import EntrySet, build_attention
from ckv.attention.base import residual_std
from ckv.cache import KVCache
from ckv.config import ModelConfig
from ckv.flops import flops_per_token
from ckv.norm import RMSNorm


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.mlp_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.mlp_dim, bias=False)
        self.down_proj = nn.Linear(config.mlp_dim, config.d_model, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        self.gate_proj.weight.normal_(0.0, std)
        self.up_proj.weight.normal_(0.0, std)
        self.down_proj.weight.normal_(0.0, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block. A block whose layer shares KV (``kv: source`` or ``shared``) hands its attention
    the forward's ``shared`` dict (a source publishes into it, a consumer reads its source's entries from it)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = build_attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)
        self.shares_kv = config.layer_kv(layer_idx) != "own"

    def forward(self, x: torch.Tensor, cache=None, shared: Optional[dict[int, list[EntrySet]]] = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, cache, shared=shared) if self.shares_kv else self.self_attn(h, cache))
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The ckv decoder. ``Transformer(config)(input_ids) -> logits (B, T, V)``.

    ``check_token_ids`` (default True): every forward checks that the ids lie in the vocabulary, which reads
    their min and max (a host sync). The trainer turns it off (its batch stream produces ids of the model's
    vocabulary, checked at the data boundary) unless ``trainer.debug_checks``; shapes are always checked.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.check_token_ids = True
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for the embedding and the MLP; each attention backend initialises its own
        parameters (``AttentionBackend.init_weights``); maps into the residual stream (attention output, MLP down)
        get ``init_std / sqrt(2 * n_layers)``; norm gains 1. Modules draw in the order of ``named_parameters``, so
        a seed gives the same weights as drawing parameter by parameter."""
        std = self.config.init_std
        out_std = residual_std(std, self.config.n_layers)
        self.embed_tokens.weight.normal_(0.0, std)
        for block in self.layers:
            block.input_layernorm.reset_parameters()
            block.self_attn.init_weights(std, out_std)
            block.post_attention_layernorm.reset_parameters()
            block.mlp.init_weights(std, out_std)
        self.norm.reset_parameters()
        if not self.config.tie_embeddings:
            self.lm_head.weight.normal_(0.0, std)

    def num_parameters(self) -> int:
        """Parameters actually held (tied embeddings once); ``ckv.flops.parameter_count`` predicts it."""
        return sum(p.numel() for p in self.parameters())

    def num_flops_per_token(self, seq_len: int) -> float:
        """Forward model FLOPs per token over ``seq_len``-token sequences (``ckv.flops.flops_per_token``)."""
        return flops_per_token(self.config, seq_len).forward

    def new_cache(self, batch_size: int = 1) -> KVCache:
        """An empty decoding cache, one layer cache per layer, matching each layer's backend."""
        return KVCache([block.self_attn.new_cache(batch_size) for block in self.layers])

    def _check_input(self, input_ids: torch.Tensor, start: int) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a (batch, seq_len) tensor, got {getattr(input_ids, 'shape', type(input_ids))}"
            )
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        if self.check_token_ids:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}); got min {lo}, max {hi}")
        if start + input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {start + input_ids.shape[1]} tokens exceeds model.max_seq_len={self.config.max_seq_len}"
            )

    def hidden_states(self, input_ids: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, d)."""
        self._check_input(input_ids, cache.length if cache is not None else 0)
        x = self.embed_tokens(input_ids)  # (B, T, d)
        shared: dict[int, list[EntrySet]] = {}  # the entry sets each source layer published, by layer index
        for i, block in enumerate(self.layers):
            x = block(x, None if cache is None else cache.layers[i], shared=shared)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, cache: Optional[KVCache] = None, head: bool = True) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V). With a cache, the tokens continue the cached sequence.
        ``head=False`` returns the final-norm hidden states (B, T, d) instead (for a loss fused with the head)."""
        h = self.hidden_states(input_ids, cache)
        return self.lm_head(h) if head else h

    def next_token_logits(self, input_ids: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, V) of the next token: the LM head runs on the last position only."""
        return self.lm_head(self.hidden_states(input_ids, cache)[:, -1])

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: Optional[int] = None
    ) -> torch.Tensor:
        """Greedy decoding with the KV cache: (B, T) prompt -> (B, T + generated) token ids.

        The prefill computes logits for the last prompt position only; each step then feeds one token. With
        ``eos_token_id``, a sequence that produced it continues with it, and decoding stops once all have.
        Raises ValueError on a negative or non-integer ``max_new_tokens``, an ``eos_token_id`` outside the
        vocabulary, or a prompt plus ``max_new_tokens`` longer than ``max_seq_len``.
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        if eos_token_id is not None and (
            not isinstance(eos_token_id, int)
            or isinstance(eos_token_id, bool)
            or not 0 <= eos_token_id < self.config.vocab_size
        ):
            raise ValueError(
                f"eos_token_id={eos_token_id!r} must be None or a token id in [0, {self.config.vocab_size})"
            )
        self._check_input(input_ids, 0)
        if input_ids.shape[1] + max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"a prompt of {input_ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"model.max_seq_len={self.config.max_seq_len}"
            )
        if max_new_tokens == 0:
            return input_ids
        cache = self.new_cache(input_ids.shape[0])
        logits = self.next_token_logits(input_ids, cache)  # (B, V)
        out = [input_ids]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1)  # (B,)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            out.append(nxt[:, None])
            if step == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
                break
            logits = self.next_token_logits(nxt[:, None], cache)
        return torch.cat(out, dim=1)
