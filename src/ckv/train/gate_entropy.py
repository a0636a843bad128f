"""The gate-entropy floor (``trainer.gate_entropy.floor`` / ``.weight``, docs/training.md): a
training-only regulariser that keeps each learned pooling gate spread over its window.

A query-independent softmax gate can put a channel's weight on a few offsets of the window, so the tokens at the
other offsets (phases) reach no entry. For every compressor branch of every layer, batch row, entry and gate
channel (KV head x gate dim), with ``alpha`` the gate's softmax over the window's ``n`` present offsets and
``H(alpha) = -sum alpha log alpha`` (nats), the penalty is

    weight * mean relu(floor * log(n) - H(alpha))

``floor`` is a fraction of the largest entropy a window of ``n`` offsets allows (``log n``, the uniform gate).
Entries with one present offset have ``log 1 = 0 = H``: they contribute 0 and are counted in the mean.

The model carries nothing for this: ``GateEntropyFloor`` puts a forward hook on every ``Pooling`` module (the
compressor's parameter-free pooling step) and recomputes ``alpha`` differentiably from the hook's inputs (the gate
logits and the present mask), the same under ``impl=torch`` and ``impl=triton`` (whose kernel returns a
non-differentiable alpha). The hooks compute only while their module is in training mode with gradients enabled
(validation under ``no_grad``, evaluation and decoding are untouched), and terms are kept only between ``start``
and ``finish`` of one micro-step, so the forward that activation checkpointing replays during backward computes
the same operations and its terms are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ckv.attention import compressed_layers
from ckv.config import ConfigError, check_float

_INPUTS = ("payload", "logits", "present")  # Pooling.forward's leading parameters


@dataclass
class GateEntropyConfig:
    """``trainer.gate_entropy``: the penalty ``weight * mean relu(floor * log(n) - H(alpha))`` over every learned
    gate; ``floor`` is a fraction of the largest entropy (in [0, 1); 0 turns it off). The model is unchanged."""

    floor: float = 0.0
    weight: float = 0.0

    def __post_init__(self) -> None:
        check_float("trainer.gate_entropy.floor", self.floor, 0, 1, high_open=True)
        check_float("trainer.gate_entropy.weight", self.weight, 0)
        if self.weight > 0 and self.floor == 0:
            raise ConfigError(
                f"trainer.gate_entropy.weight={self.weight} weighs the gate-entropy penalty, which is off: set "
                "trainer.gate_entropy.floor in (0, 1)"
            )

    @property
    def enabled(self) -> bool:
        return self.floor > 0


def gate_entropy_deficit(logits: torch.Tensor, present: torch.Tensor, floor: float) -> torch.Tensor:
    """``relu(floor * log(n) - H(alpha))`` per batch row, entry and gate channel, in fp32.

    logits: (B, E, W, KV, G) gate logits; present: (E, W) bool (``n = present.sum(-1)``, never 0). ``alpha`` is
    the softmax of the logits over the present offsets (as ``reference.pool_reference`` computes it); absent
    offsets carry no weight and no entropy. Returns (B, E, KV, G); differentiable in ``logits``."""
    mask = present[None, :, :, None, None]  # (1, E, W, 1, 1)
    logp = torch.log_softmax(logits.float().masked_fill(~mask, float("-inf")), dim=2)
    logp = logp.masked_fill(~mask, 0.0)  # exp(-inf) = 0 weight; 0, not -inf, so that 0 * log p has a 0 gradient
    entropy = -(logp.exp() * logp).sum(dim=2)  # (B, E, KV, G)
    target = floor * torch.log(present.sum(-1).clamp_min(1).to(entropy.dtype))  # (E,)
    return torch.relu(target[None, :, None, None] - entropy)


def _pool_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(logits, present) of one ``Pooling.forward`` call, passed by position or by name."""
    given = {**dict(zip(_INPUTS, args)), **{k: v for k, v in kwargs.items() if k in _INPUTS}}
    return given["logits"], given["present"]


def _pooling_steps(model: nn.Module) -> list[nn.Module]:
    """The pooling step (``Compressor.pooling``) of every compressor branch of ``model``, in module order: each
    compressed layer's K (and V) branch, then its lightning indexer's own branch."""
    return [
        branch.pooling
        for layer in compressed_layers(model)
        for branch in (*layer.compressors().values(), *(() if layer.indexer is None else (layer.indexer.compressor,)))
    ]


class GateEntropyFloor:
    """Forward hooks on every ``Pooling`` of ``model`` that add up the gate-entropy penalty of one forward.

    ``start()`` opens a micro-step, ``finish()`` closes it and returns the mean deficit over every hooked call (a
    0-d fp32 tensor on the model's device, attached to the graph; 0 when nothing was hooked): the penalty is
    ``weight`` times it. ``remove()`` takes the hooks off. No host sync."""

    def __init__(self, model: nn.Module, floor: float, weight: float) -> None:
        self.floor, self.weight = float(floor), float(weight)
        self._terms: list[torch.Tensor] = []
        self._open = False
        self._device = next(model.parameters()).device
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in _pooling_steps(model)]
        if not self._handles:
            raise ValueError("the gate-entropy floor found no compressor pooling step (Pooling) in the model")

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        logits, present = _pool_inputs(args, kwargs)
        if logits is None:  # a uniform mean has no gate to spread
            return
        term = gate_entropy_deficit(logits, present, self.floor).mean()
        if self._open:  # a checkpointed layer's replay in backward computes the same ops, and is dropped here
            self._terms.append(term)

    def start(self) -> None:
        self._terms.clear()
        self._open = True

    def finish(self) -> torch.Tensor:
        self._open = False
        terms, self._terms = self._terms, []
        if not terms:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        return torch.stack(terms).mean()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def hooks(self) -> int:
        """How many Pooling modules are hooked (per compressed layer: K, V unless tied, the indexer's branch)."""
        return len(self._handles)
