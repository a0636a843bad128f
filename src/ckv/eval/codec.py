"""How lookup records, queries and answers become token ids, for ckv's synthetic layout or any tokenizer.

A prompt is ``prefix [pad]* record_0 [gap]* record_1 ... record_{N-1} [gap]* separator (query answer)* query``;
the model must predict the FIRST token of the last query's answer. Two codecs fill this layout:

- ``FormatCodec`` wraps ``ckv.data.LookupFormat`` (prefix ``bos``, pads ``pad``, gaps from the filler ids,
  separator ``sep sep``): the prompts are exactly the sequences the training data draws.
- ``TokenCodec`` takes single-token keys and values of any tokenizer (word lists or id ranges): a record is
  ``key value``, a query the key alone, the answer the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from ckv.data.lookup import LookupFormat


class RecordCodec(Protocol):
    """Token ids of every part of a lookup prompt."""

    prefix: list[int]
    pad_id: int
    gap_ids: Sequence[int]
    separator: list[int]
    n_keys: int
    n_values: int
    record_len: int

    def record_tokens(self, key: int, value: int) -> list[int]: ...

    def query_tokens(self, key: int) -> list[int]: ...

    def answer_tokens(self, value: int) -> list[int]: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class FormatCodec:
    """ckv's synthetic lookup layout (``LookupFormat``): the same tokens training draws."""

    format: LookupFormat

    @property
    def prefix(self) -> list[int]:
        return [self.format.bos_id]

    @property
    def pad_id(self) -> int:
        return self.format.pad_id

    @property
    def gap_ids(self) -> Sequence[int]:
        return self.format.filler_ids

    @property
    def separator(self) -> list[int]:
        return [self.format.sep_id, self.format.sep_id]

    @property
    def n_keys(self) -> int:
        return self.format.n_keys

    @property
    def n_values(self) -> int:
        return self.format.n_values

    @property
    def record_len(self) -> int:
        return self.format.record_len

    def record_tokens(self, key: int, value: int) -> list[int]:
        return self.format.record_tokens(key, value)

    def query_tokens(self, key: int) -> list[int]:
        return self.format.query_tokens(key)

    def answer_tokens(self, value: int) -> list[int]:
        return self.format.answer_tokens(value)

    def describe(self) -> dict:
        f = self.format
        return {"source": "format", "record": f.record, "n_keys": f.n_keys, "n_values": f.n_values,
                "n_filler": f.n_filler, "key_base": f.key_base, "value_base": f.value_base, "offset": f.offset}


@dataclass(frozen=True)
class TokenCodec:
    """Single-token keys and values of a tokenizer. ``gap_ids`` fill in-sequence gaps (default: the pad)."""

    key_ids: tuple[int, ...]
    value_ids: tuple[int, ...]
    pad_id: int
    prefix: list[int] = field(default_factory=list)
    separator: list[int] = field(default_factory=list)
    gap_ids: Sequence[int] = ()
    labels: dict = field(default_factory=dict)  # {"keys": [...], "values": [...]} for the results table

    def __post_init__(self) -> None:
        if not self.key_ids or not self.value_ids:
            raise ValueError(f"empty vocabulary: {len(self.key_ids)} keys and {len(self.value_ids)} values")
        if not self.gap_ids:
            object.__setattr__(self, "gap_ids", (self.pad_id,))

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
        return {"source": "tokens", "n_keys": self.n_keys, "n_values": self.n_values, "pad_id": self.pad_id,
                "prefix": list(self.prefix), "separator": list(self.separator), **self.labels}


@dataclass
class Prompt:
    """One assembled prompt. ``tokens`` (T,) ends with the last query; ``record_starts`` (n_records,) are the
    positions of each record's first token; ``answer_id`` is the scored (first) answer token."""

    tokens: np.ndarray
    record_starts: np.ndarray
    answer_id: int


def assemble(
    codec: RecordCodec,
    keys: np.ndarray,
    values: np.ndarray,
    pads: np.ndarray,
    queried: np.ndarray,
    rng: np.random.Generator,
) -> Prompt:
    """Build the prompt for records ``(keys[i], values[i])``, ``pads[j]`` pad/gap tokens in slot ``j``
    (slot 0 uses the pad token, the others gap tokens drawn from ``rng``) and the queried record indices
    (the last one is scored). Shapes: keys/values (N,), pads (N + 1,), queried (Q,)."""
    n = len(keys)
    if len(values) != n or len(pads) != n + 1 or len(queried) < 1:
        raise ValueError(f"assemble needs N keys and values, N + 1 pad slots and >= 1 query; got {len(keys)}, "
                         f"{len(values)}, {len(pads)}, {len(queried)}")
    gap_ids = np.asarray(codec.gap_ids, dtype=np.int64)
    tokens: list[int] = list(codec.prefix) + [codec.pad_id] * int(pads[0])
    starts = np.empty(n, dtype=np.int64)
    for i in range(n):
        starts[i] = len(tokens)
        tokens += codec.record_tokens(int(keys[i]), int(values[i]))
        tokens += gap_ids[rng.integers(0, len(gap_ids), int(pads[i + 1]))].tolist()
    tokens += codec.separator
    for r in queried[:-1]:
        tokens += codec.query_tokens(int(keys[r])) + codec.answer_tokens(int(values[r]))
    last = int(queried[-1])
    tokens += codec.query_tokens(int(keys[last]))
    return Prompt(np.asarray(tokens, dtype=np.int64), starts, codec.answer_tokens(int(values[last]))[0])
