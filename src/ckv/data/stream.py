"""BatchStream: collates the sequences of a source into resumable, deterministic training batches."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import numpy as np
import torch

from ckv.data.corpus import DataError
from ckv.data.lookup import LookupFormat

IGNORE = -100  # label of positions that carry no loss (torch's cross_entropy default ignore_index)
SPLITS = {"train": 0, "val": 1}  # split -> seed salt


class SequenceSource(Protocol):
    """An endless, deterministic stream of fixed-length ``(input_ids, labels)`` pairs, each of shape (T,)."""

    def next(self) -> tuple[np.ndarray, np.ndarray]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_for(seed: int, *salt: int) -> np.random.Generator:
    """An independent numpy generator for ``seed`` and a tuple of non-negative integers (split, index, ...)."""
    return np.random.default_rng([seed, *salt])


def check_identity(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Raise ValueError naming every field (saved -> now) where a saved data state's identity differs from the
    stream's that loads it."""
    diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if diff:
        raise ValueError(
            "data state was saved by a differently configured stream; (saved, now) per field: "
            + ", ".join(f"{k}={a!r}->{b!r}" for k, (a, b) in sorted(diff.items()))
        )


class BatchStream:
    """Endless iterator of ``{"input_ids": LongTensor (B, T), "labels": LongTensor (B, T)}``.

    ``labels[:, t]`` is the target of position ``t`` (already shifted); ``-100`` marks positions without loss.
    The batches are a pure function of (config, seed, rank, world_size, split) and of how many batches were
    drawn, so ``state_dict()`` (a small JSON-serialisable dict) restored with ``load_state_dict()`` on a stream
    built with the same arguments continues with exactly the batches an uninterrupted stream would give.
    """

    elastic = False  # whether a state saved by one number of ranks may be loaded by another (ShardBatches: yes)

    def __init__(
        self,
        source: SequenceSource,
        *,
        batch_size: int,
        identity: dict[str, Any],
        vocab_size: int,
        tokenizer_path: Optional[str] = None,
        lookup_format: Optional[LookupFormat] = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.source = source
        self.batch_size = batch_size
        self.identity = dict(identity, batch_size=batch_size)
        self._vocab_size = vocab_size
        self._tokenizer_path = tokenizer_path
        self.lookup_format = lookup_format  # where lookup records live in the vocabulary (None for pure text)
        self.batches = 0

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the model needs: the tokenizer's, or the lookup layout's for pure lookup data."""
        return self._vocab_size

    @property
    def tokenizer_path(self) -> Optional[str]:
        """The ``tokenizer.json`` the text was tokenised with (None for pure lookup data)."""
        return self._tokenizer_path

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        pairs = [self.source.next() for _ in range(self.batch_size)]
        self.batches += 1
        return self.collate(pairs, self.batches)

    def collate(self, pairs: list[tuple[np.ndarray, np.ndarray]], number: int) -> dict[str, torch.Tensor]:
        """Stack ``(input_ids, labels)`` pairs into batch ``number`` after checking its ids fit the vocabulary."""
        ids = np.stack([p[0] for p in pairs]).astype(np.int64)  # (B, T)
        if ids.min() < 0 or ids.max() >= self._vocab_size:  # the data-boundary check (host memory, no device sync)
            raise DataError(
                f"batch {number} holds token ids outside [0, {self._vocab_size}): min {ids.min()}, max {ids.max()}"
            )
        return {
            "input_ids": torch.from_numpy(ids),  # (B, T)
            "labels": torch.from_numpy(np.stack([p[1] for p in pairs]).astype(np.int64)),  # (B, T)
        }

    def close(self) -> None:
        """Release background work (nothing here; ``ShardBatches`` stops its prefetch thread)."""

    def state_dict(self) -> dict[str, Any]:
        return {"identity": dict(self.identity), "batches": self.batches, "source": self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state saved by a stream with different arguments."""
        check_identity(state["identity"], self.identity)
        self.source.load_state_dict(state["source"])
        self.batches = int(state["batches"])
