"""Interleave text and lookup sequences at a fixed ratio."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckv.data.stream import SequenceSource


class Mixture:
    """Row ``n`` (counted per rank) is a lookup sequence iff ``floor((n+1) * ratio) > floor(n * ratio)``.

    This deterministic interleaving keeps the share of lookup rows among the first ``n`` rows at exactly
    ``floor(n * ratio)`` (off by less than one row from ``n * ratio`` for every prefix), needs no random
    draw, and its state is one counter plus the states of the two parts.
    """

    def __init__(self, text: SequenceSource, lookup: SequenceSource, ratio: float) -> None:
        if not 0 < ratio < 1:
            raise ValueError(f"mixture ratio {ratio} must be strictly between 0 and 1")
        self.text, self.lookup, self.ratio = text, lookup, ratio
        self.rows = 0

    def is_lookup(self, row: int) -> bool:
        return math.floor((row + 1) * self.ratio) > math.floor(row * self.ratio)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        source = self.lookup if self.is_lookup(self.rows) else self.text
        self.rows += 1
        return source.next()

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "text": self.text.state_dict(), "lookup": self.lookup.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = int(state["rows"])
        self.text.load_state_dict(state["text"])
        self.lookup.load_state_dict(state["lookup"])
