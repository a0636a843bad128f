"""Activation checkpointing of a ckv ``Transformer``, applied from outside the model.

Modes (``trainer.activation_checkpointing``):
- ``none``: nothing changes;
- ``full``: every block keeps only its input; its whole forward (both norms, attention, MLP) is recomputed in
  backward. Activation memory per layer drops to one ``(B, T, d_model)`` tensor, at the cost of one more forward;
- ``selective``: only each block's attention sublayer (``self_attn``: Q/K/V/O projections, Q/K norms, RoPE, the
  compressor and the attention core) is recomputed; the norms and the MLP keep their activations. The attention
  sublayer holds the largest activations at long sequences (the reference compressed path's fp32 score
  matrices, ``T * (T / stride + local)`` per head, and its pooled windows) while its recompute costs less than
  half the MLP's matmuls at Qwen3 shapes.
Recompute happens only when autograd records (training); evaluation under ``no_grad`` and decoding with a cache
run unchanged. The wrapper is set as an instance ``forward``, so module names, ``state_dict`` keys and hooks are
those of the plain model. ``torch.utils.checkpoint`` runs with ``use_reentrant=False`` (no RNG in the model;
gradients of parameters only, which reentrant checkpointing would need inputs that require grad for).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckv.config import ConfigError

MODES = ("none", "full", "selective")
_MARK = "_ckv_checkpointed"


def _checkpointed(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(forward)
    def run(x: torch.Tensor, cache: Any = None, **kwargs: Any) -> torch.Tensor:
        # kwargs: the forward's ``shared`` dict of a KV-sharing layer (or its block), passed on; a source's entries
        # keep their autograd graph, so a consumer's gradient reaches them through the source's recompute
        if cache is not None or not torch.is_grad_enabled():
            return forward(x, cache, **kwargs)
        return checkpoint(forward, x, None, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Checkpoint ``model.layers`` (a ckv ``Transformer``'s blocks) in ``mode`` (see the module docstring), in
    place. Returns how many modules now recompute in backward (0 for ``none``)."""
    if mode not in MODES:
        raise ConfigError(f"trainer.activation_checkpointing={mode!r} is not allowed; choose one of {list(MODES)}")
    if mode == "none":
        return 0
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"activation checkpointing needs a ckv Transformer (with .layers), got {type(model).__name__}")
    targets = list(layers) if mode == "full" else [block.self_attn for block in layers]
    if any(getattr(m, _MARK, False) for m in model.modules()):
        raise ValueError("activation checkpointing is already applied to this model")
    for m in targets:
        m.forward = _checkpointed(m.forward)
        setattr(m, _MARK, True)
    return len(targets)
