"""Lookup records, queries and answers as token ids of any tokenizer.

A prompt is ``prefix [pad]* record_0 [filler]* record_1 ... record_{N-1} [filler]* separator (query answer)*
query``; the model must predict the FIRST token of the last query's answer. ``ckv.data.lookup.assemble_lookup``
lays every prompt out, from a ``RecordCodec``:

- ``ckv.data.LookupFormat``, ckv's synthetic layout (prefix ``bos``, pads ``pad``, fillers from the filler ids,
  separator ``sep sep``): the prompts are then sequences the training data draws, by construction;
- ``TokenCodec`` (here): single-token keys and values of any tokenizer (word lists or id ranges); a record is
  ``key value``, a query the key alone, the answer the value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenCodec:
    """Single-token keys and values of a tokenizer (a ``ckv.data.lookup.RecordCodec``). ``filler_ids`` fill
    the slots after records (default: the pad)."""

    key_ids: tuple[int, ...]
    value_ids: tuple[int, ...]
    pad_id: int
    prefix: list[int] = field(default_factory=list)
    separator: list[int] = field(default_factory=list)
    filler_ids: Sequence[int] = ()
    labels: dict = field(default_factory=dict)  # {"keys": [...], "values": [...]} for the results table

    def __post_init__(self) -> None:
        if not self.key_ids or not self.value_ids:
            raise ValueError(f"empty vocabulary: {len(self.key_ids)} keys and {len(self.value_ids)} values")
        if not self.filler_ids:
            object.__setattr__(self, "filler_ids", (self.pad_id,))

    @property
    def n_keys(self) -> int:
        return len(self.key_ids)

    @property
    def n_values(self) -> int:
        return len(self.value_ids)

    @property
    def record_len(self) -> int:
        return 2

    def record_tokens(self, key: int, value: int) -> list[int]:
        return [self.key_ids[key], self.value_ids[value]]

    def query_tokens(self, key: int) -> list[int]:
        return [self.key_ids[key]]

    def answer_tokens(self, value: int) -> list[int]:
        return [self.value_ids[value]]

    def describe(self) -> dict:
        return {
            "source": "tokens",
            "n_keys": self.n_keys,
            "n_values": self.n_values,
            "pad_id": self.pad_id,
            "prefix": list(self.prefix),
            "separator": list(self.separator),
            **self.labels,
        }
