"""Lookup records, queries and answers as token ids of any tokenizer.

A prompt is ``prefix [pad]* record_0 [filler]* record_1 ... record_{N-1} [filler]* separator (query answer)*
query``; the model must predict the FIRST token of the last query's answer. ``ckv.data.lookup.assemble_lookup``
lays every prompt out, from a ``RecordCodec``:

- ``ckv.data.LookupFormat``, ckv's synthetic layout (prefix ``bos``, pads ``pad``, fillers from the filler ids,
  separator ``sep sep``): the prompts are then sequences the training data draws, by construction;
- ``TokenCodec`` (here): single-token keys and values of any tokenizer (word lists or id ranges); a record is
  ``key value``, a query the key alone, the answer the value;
- ``MultiTokenKeyCodec`` (here, the needle test's ``needle_codec``): records of more tokens over a ``TokenCodec``,
  keys of several key tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ckv.config import ConfigError
from ckv.data.lookup import RecordCodec


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


@dataclass(frozen=True)
class MultiTokenKeyCodec:
    """Records of ``record_len`` tokens over a ``TokenCodec``'s single-token keys and values (a
    ``ckv.data.lookup.RecordCodec``): key ``j`` is the ``record_len - 1`` key tokens of ``j``'s base-``n`` digits
    (``n`` = the base's key count), the value one value token. Distinct keys are distinct token sequences."""

    base: TokenCodec
    record_len: int

    @property
    def key_len(self) -> int:
        return self.record_len - 1

    @property
    def prefix(self) -> list[int]:
        return self.base.prefix

    @property
    def pad_id(self) -> int:
        return self.base.pad_id

    @property
    def filler_ids(self) -> tuple[int, ...]:
        return tuple(self.base.filler_ids)

    @property
    def separator(self) -> list[int]:
        return self.base.separator

    @property
    def n_keys(self) -> int:
        return self.base.n_keys**self.key_len

    @property
    def n_values(self) -> int:
        return self.base.n_values

    def record_tokens(self, key: int, value: int) -> list[int]:
        return self.query_tokens(key) + self.answer_tokens(value)

    def query_tokens(self, key: int) -> list[int]:
        digits = []
        for _ in range(self.key_len):
            key, d = divmod(key, self.base.n_keys)
            digits.append(self.base.key_ids[d])
        return digits[::-1]

    def answer_tokens(self, value: int) -> list[int]:
        return self.base.answer_tokens(value)

    def describe(self) -> dict:
        return {
            **self.base.describe(),
            "source": "multi_token_keys",
            "record_len": self.record_len,
            "key_tokens": self.key_len,
            "n_keys": self.n_keys,
        }


def needle_codec(codec: RecordCodec, record_len: int) -> RecordCodec:
    """The codec of the haystack: ``codec`` itself when its records have ``record_len`` tokens, else (for word or
    id vocabularies) keys of ``record_len - 1`` tokens over its keys."""
    if codec.record_len == record_len:
        return codec
    if isinstance(codec, TokenCodec):
        return MultiTokenKeyCodec(codec, record_len)
    raise ConfigError(
        f"task.record_len={record_len}, but the model's lookup layout has records of "
        f"{codec.record_len} tokens; set task.record_len={codec.record_len} (or use vocab source "
        f"'words'/'ids')"
    )
