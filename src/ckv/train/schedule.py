"""Learning-rate schedules: multipliers of the peak learning rate as a function of the optimizer step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ckv.train.config import OptimConfig


@dataclass
class LRSchedule:
    """``schedule(step) -> multiplier`` for the update made at 0-based optimizer step ``step``.

    Warmup rises linearly to 1 over ``warmup_steps`` (the first update already uses ``1 / warmup_steps``). Then
    ``cosine`` decays to ``min_ratio`` at the last step, ``wsd`` stays at 1 until the final ``decay_fraction`` of
    the steps and decays linearly to ``min_ratio``, ``constant`` stays at 1. The ``frozen_steps`` steps from
    ``frozen_start`` on get 0 (a parameter group held still, e.g. everything but the lightning indexer during its
    warm-up, which follows ``trainer.indexer.dense_steps``). A
    plain dataclass so that ``LambdaLR.state_dict`` saves it.
    """

    kind: str
    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.0
    decay_fraction: float = 0.2
    frozen_steps: int = 0
    frozen_start: int = 0

    def __call__(self, step: int) -> float:
        if self.frozen_start <= step < self.frozen_start + self.frozen_steps:
            return 0.0
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        last = max(self.total_steps - 1, 1)
        if self.kind == "cosine":
            span = max(last - self.warmup_steps, 1)
            progress = min((step - self.warmup_steps) / span, 1.0)
            return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.kind == "wsd":
            decay_steps = max(round(self.decay_fraction * self.total_steps), 1)
            start = max(self.total_steps - decay_steps, self.warmup_steps)
            if step < start:
                return 1.0
            progress = min((step - start + 1) / max(last - start + 1, 1), 1.0)
            return 1.0 - (1.0 - self.min_ratio) * progress
        raise ValueError(f"unknown schedule kind {self.kind!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    optim: OptimConfig,
    total_steps: int,
    frozen_steps: Optional[Sequence[int]] = None,
    frozen_start: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following ``optim.schedule`` for a run of ``total_steps`` updates;
    ``frozen_steps`` (one per parameter group) holds groups at learning rate 0 for that many steps from
    ``frozen_start`` on."""

    def schedule(frozen: int = 0) -> LRSchedule:
        return LRSchedule(
            kind=optim.schedule,
            total_steps=total_steps,
            warmup_steps=optim.warmup_steps,
            min_ratio=optim.min_lr_ratio,
            decay_fraction=optim.decay_fraction,
            frozen_steps=frozen,
            frozen_start=frozen_start,
        )

    if frozen_steps is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule())
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [schedule(n) for n in frozen_steps])
