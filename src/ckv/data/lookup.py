"""Synthetic key->value record lookups: a tokenizer-agnostic id layout, the one sequence assembler, and a
deterministic example generator.

A sequence is ``prefix [pad]* (record [filler]*)* separator (query answer)*``; for ckv's layout the prefix is
``bos`` and the separator ``sep sep``. Records use distinct keys, each followed by some filler tokens; queries
ask keys that occurred (with replacement) and each is followed by its answer. The scored answer token is the
answer's FIRST token (the model predicts it from the query's last token).

``assemble_lookup`` is the only code that lays these tokens out: training examples (``make_lookup_example``,
drawn by ``ckv.data.synthetic``) and evaluation prompts (``ckv.eval``: ``LookupExample.prompt``, the sequence
up to the last query's scored answer) both come from it, for any ``RecordCodec`` (``LookupFormat`` here, the
tokenizer codec in ``ckv.eval.codec``).

Record formats (``LookupFormat.record``):

- ``kv``: the paper's: a single-token key immediately followed by a single-token value; a query is the key
  token again, the answer the value token.
- ``kkvv``: 2-token keys and 2-token values ``k1 k2 v1 v2``. A key ``k`` is written as two digits
  ``divmod(k, key_base)`` from one range of ``key_base`` ids (values likewise with ``value_base``).
- ``split``: a record is two adjacent tokens ``X(k_hi, v) Y(k_lo, v)``, both carrying the value and each half
  of the key (``key = k_hi * key_base + k_lo``); query keys and answer values have their own id ranges.
- ``keyed``: a single-token key followed by a value token that carries the key too, ``K(k) V(k, v)``; a query is
  the key token again, the answer a token of its own range (``V(k, v)`` alone holds the whole record, so one
  attention step from the query finds and reads it).

Id layout, relative to ``offset``: ``pad, bos, sep``, then ``n_filler`` filler ids, then the format's ranges in
the order of ``LookupFormat.ranges``. ``offset`` lets the layout sit inside a bigger vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Protocol

import numpy as np

from ckv.config import ConfigError, check_choice, check_int

RECORDS = ("kv", "kkvv", "split", "keyed")
N_SPECIAL = 3  # pad, bos, sep


class RecordCodec(Protocol):
    """The token ids of every part of a lookup sequence: what ``assemble_lookup`` lays out.

    ``prefix`` opens the sequence, ``pad_id`` fills the slot after it, ``filler_ids`` are drawn uniformly for
    the slots after records, ``separator`` ends the records. Keys are ``0..n_keys-1``, values
    ``0..n_values-1``; ``describe`` is the JSON-ready identity of the codec for results files.
    """

    @property
    def prefix(self) -> list[int]: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def filler_ids(self) -> Sequence[int]: ...

    @property
    def separator(self) -> list[int]: ...

    @property
    def n_keys(self) -> int: ...

    @property
    def n_values(self) -> int: ...

    @property
    def record_len(self) -> int: ...

    def record_tokens(self, key: int, value: int) -> list[int]: ...

    def query_tokens(self, key: int) -> list[int]: ...

    def answer_tokens(self, value: int) -> list[int]: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class LookupFormat:
    """Where every token of a synthetic lookup sequence lives in the vocabulary (a ``RecordCodec``).

    ``key_base``: for ``kkvv`` the number of ids per key digit (default ``ceil(sqrt(n_keys))``); for ``split``
    the number of low key halves ``k_lo`` (default ``ceil(sqrt(n_keys))``). ``value_base``: for ``kkvv`` the
    number of ids per value digit (default ``ceil(sqrt(n_values))``). Both are unused (must stay ``None``)
    for ``kv`` and ``keyed``.
    """

    record: str = "kv"
    n_keys: int = 16
    n_values: int = 16
    n_filler: int = 1
    key_base: Optional[int] = None
    value_base: Optional[int] = None
    offset: int = 0

    def __post_init__(self) -> None:
        check_choice("lookup.record", self.record, RECORDS)
        check_int("lookup.n_keys", self.n_keys, 1)
        check_int("lookup.n_values", self.n_values, 1)
        check_int("lookup.n_filler", self.n_filler, 0)
        check_int("lookup.offset", self.offset, 0)
        if self.record in ("kv", "keyed"):
            for name in ("key_base", "value_base"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"lookup.{name} is only used with record 'kkvv' or 'split' (got record={self.record!r})"
                    )
            return
        if self.record == "split" and self.value_base is not None:
            raise ConfigError("lookup.value_base is only used with record 'kkvv' (split records carry whole values)")
        # frozen dataclass: fill the defaults in place once
        if self.key_base is None:
            object.__setattr__(self, "key_base", math.isqrt(self.n_keys - 1) + 1)
        if self.record == "kkvv" and self.value_base is None:
            object.__setattr__(self, "value_base", math.isqrt(self.n_values - 1) + 1)
        check_int("lookup.key_base", self.key_base, 1)
        if self.record == "kkvv":
            check_int("lookup.value_base", self.value_base, 1)
            if self.key_base**2 < self.n_keys:
                raise ConfigError(
                    f"lookup.key_base={self.key_base} is too small: two digits hold {self.key_base**2} keys "
                    f"< n_keys={self.n_keys}"
                )
            if self.value_base**2 < self.n_values:
                raise ConfigError(
                    f"lookup.value_base={self.value_base} is too small: two digits hold {self.value_base**2} "
                    f"values < n_values={self.n_values}"
                )

    # ---- layout -------------------------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        return self.offset

    @property
    def bos_id(self) -> int:
        return self.offset + 1

    @property
    def sep_id(self) -> int:
        return self.offset + 2

    @property
    def n_key_hi(self) -> int:
        """Number of high key halves/digits (``kkvv``, ``split``): ``ceil(n_keys / key_base)``."""
        return -(-self.n_keys // self.key_base) if self.key_base else 0

    @cached_property
    def ranges(self) -> dict[str, range]:
        """Named, disjoint id ranges of the layout, in id order (``special`` holds pad, bos, sep)."""
        sizes: list[tuple[str, int]] = [("special", N_SPECIAL), ("filler", self.n_filler)]
        if self.record == "kv":
            sizes += [("key", self.n_keys), ("value", self.n_values)]
        elif self.record == "kkvv":
            sizes += [("key", self.key_base), ("value", self.value_base)]
        elif self.record == "keyed":
            sizes += [("key", self.n_keys), ("value", self.n_keys * self.n_values), ("answer", self.n_values)]
        else:
            sizes += [
                ("record_hi", self.n_key_hi * self.n_values),
                ("record_lo", self.key_base * self.n_values),
                ("query", self.n_keys),
                ("answer", self.n_values),
            ]
        out, start = {}, self.offset
        for name, size in sizes:
            out[name] = range(start, start + size)
            start += size
        return out

    @property
    def vocab_size(self) -> int:
        """The smallest vocabulary that holds the layout (``offset`` included)."""
        return list(self.ranges.values())[-1].stop

    @property
    def layout_size(self) -> int:
        """Number of ids the layout occupies: ``vocab_size - offset``."""
        return self.vocab_size - self.offset

    @property
    def filler_ids(self) -> range:
        return self.ranges["filler"]

    @property
    def prefix(self) -> list[int]:
        return [self.bos_id]

    @property
    def separator(self) -> list[int]:
        return [self.sep_id, self.sep_id]

    def describe(self) -> dict:
        """The layout's fields, for results files."""
        return {
            "source": "format",
            "record": self.record,
            "n_keys": self.n_keys,
            "n_values": self.n_values,
            "n_filler": self.n_filler,
            "key_base": self.key_base,
            "value_base": self.value_base,
            "offset": self.offset,
        }

    @property
    def answer_range(self) -> range:
        """The ids a scored (first) answer token can take."""
        return self.ranges["answer" if self.record in ("split", "keyed") else "value"]

    def validate(self, vocab_size: int, reserved_ids: Sequence[int] = ()) -> None:
        """Check that the layout fits a model vocabulary and avoids ids used elsewhere (e.g. a text
        tokenizer's end-of-document id). Raises ConfigError naming the clash."""
        if self.vocab_size > vocab_size:
            raise ConfigError(
                f"the lookup layout needs ids up to {self.vocab_size - 1} (offset={self.offset}, "
                f"{self.layout_size} ids) but the vocabulary has only {vocab_size} ids"
            )
        for rid in reserved_ids:
            for name, r in self.ranges.items():
                if rid in r:
                    raise ConfigError(
                        f"reserved id {rid} falls inside the lookup layout's {name!r} range "
                        f"[{r.start}, {r.stop - 1}]; move lookup.offset"
                    )

    # ---- tokens -------------------------------------------------------------------------------------------
    def _check_key(self, key: int) -> None:
        if not 0 <= key < self.n_keys:
            raise ValueError(f"key {key} is outside [0, n_keys={self.n_keys})")

    def _check_value(self, value: int) -> None:
        if not 0 <= value < self.n_values:
            raise ValueError(f"value {value} is outside [0, n_values={self.n_values})")

    def record_tokens(self, key: int, value: int) -> list[int]:
        """The tokens of one record (key ``key`` bound to value ``value``)."""
        self._check_key(key)
        self._check_value(value)
        r = self.ranges
        if self.record == "split":
            hi, lo = divmod(key, self.key_base)
            return [
                r["record_hi"].start + hi * self.n_values + value,
                r["record_lo"].start + lo * self.n_values + value,
            ]
        if self.record == "keyed":
            return [r["key"].start + key, r["value"].start + key * self.n_values + value]
        return self.query_tokens(key) + self.answer_tokens(value)

    def query_tokens(self, key: int) -> list[int]:
        """What precedes the answer in the query section: the key as asked."""
        self._check_key(key)
        if self.record in ("kv", "keyed"):
            return [self.ranges["key"].start + key]
        if self.record == "kkvv":
            return [self.ranges["key"].start + d for d in divmod(key, self.key_base)]
        return [self.ranges["query"].start + key]

    def answer_tokens(self, value: int) -> list[int]:
        """The answer to a query; its FIRST token is the scored one."""
        self._check_value(value)
        if self.record == "kv":
            return [self.ranges["value"].start + value]
        if self.record == "kkvv":
            return [self.ranges["value"].start + d for d in divmod(value, self.value_base)]
        return [self.ranges["answer"].start + value]  # split, keyed

    @property
    def record_len(self) -> int:
        return {"kv": 2, "kkvv": 4, "split": 2, "keyed": 2}[self.record]

    @property
    def query_len(self) -> int:
        return {"kv": 1, "kkvv": 2, "split": 1, "keyed": 1}[self.record]

    @property
    def answer_len(self) -> int:
        return {"kv": 1, "kkvv": 2, "split": 1, "keyed": 1}[self.record]

    def example_len(self, n_records: int, n_queries: int, fillers: int, prefix_pad: int) -> int:
        """Length of an example with ``fillers`` filler tokens in total."""
        return (
            1 + prefix_pad + n_records * self.record_len + fillers + 2 + n_queries * (self.query_len + self.answer_len)
        )


@dataclass
class LookupExample:
    """One assembled lookup sequence and where everything in it is.

    Shapes: ``tokens``/``loss_mask`` (L,); ``record_starts``/``keys``/``values`` (n_records,);
    ``answer_positions``/``query_records`` (n_queries,). ``answer_positions[q]`` is the position of the scored
    (first) answer token of query ``q``, predicted from position ``answer_positions[q] - 1``;
    ``query_records[q]`` is the index of the record it asks about. ``loss_mask`` marks every answer token.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    record_starts: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    answer_positions: np.ndarray
    query_records: np.ndarray

    @property
    def prompt(self) -> np.ndarray:
        """(answer_positions[-1],) the tokens before the last query's scored answer: an evaluation prompt."""
        if not len(self.answer_positions):
            raise ValueError("an example without queries has no prompt")
        return self.tokens[: self.answer_positions[-1]]

    @property
    def answer_id(self) -> int:
        """The scored (first) answer token of the last query: what the prompt must be continued with."""
        return int(self.tokens[self.prompt.shape[0]])


def assemble_lookup(
    codec: RecordCodec,
    keys: Sequence[int],
    values: Sequence[int],
    pads: Sequence[int],
    queried: Sequence[int],
    rng: np.random.Generator,
) -> LookupExample:
    """Lay out one lookup sequence: records ``(keys[i], values[i])``, ``pads[0]`` pad tokens after the prefix,
    ``pads[i + 1]`` filler tokens after record ``i`` (each drawn uniformly from ``codec.filler_ids`` with
    ``rng``, slot by slot), the separator, then every queried record's query followed by its answer.

    Shapes: keys/values (N,), pads (N + 1,), queried (Q,) record indices. Keys must be distinct (else a query
    has two answers). Training examples and evaluation prompts are both built here.
    """
    keys_, values_ = np.asarray(keys, dtype=np.int64), np.asarray(values, dtype=np.int64)
    pads_, queried_ = np.asarray(pads, dtype=np.int64), np.asarray(queried, dtype=np.int64)
    n = len(keys_)
    if values_.shape != (n,) or pads_.shape != (n + 1,) or queried_.ndim != 1:
        raise ValueError(
            f"a lookup sequence needs N keys and values, N + 1 pad slots and a 1-d list of queries; "
            f"got shapes {keys_.shape}, {values_.shape}, {pads_.shape}, {queried_.shape}"
        )
    if n and (keys_.min() < 0 or keys_.max() >= codec.n_keys or values_.min() < 0 or values_.max() >= codec.n_values):
        raise ValueError(
            f"keys must lie in [0, {codec.n_keys}) and values in [0, {codec.n_values}); got keys "
            f"{keys_.tolist()}, values {values_.tolist()}"
        )
    if len(set(keys_.tolist())) != n:
        raise ValueError(f"keys must be distinct, got {keys_.tolist()}")
    if (pads_ < 0).any() or ((queried_ < 0) | (queried_ >= n)).any():
        raise ValueError(
            f"pads must be >= 0 and queries must index the records; got pads {pads_.tolist()}, "
            f"queries {queried_.tolist()}"
        )
    filler_ids = np.asarray(codec.filler_ids, dtype=np.int64)
    if pads_[1:].sum() and not len(filler_ids):
        raise ValueError("filler tokens requested but the layout has no filler ids (lookup.n_filler=0)")

    # assemble with plain Python ints (numpy scalars are slow to index one by one)
    keys_l, values_l, pads_l = keys_.tolist(), values_.tolist(), pads_.tolist()
    tokens: list[int] = list(codec.prefix) + [codec.pad_id] * pads_l[0]
    record_starts = []
    for key, value, n_fill in zip(keys_l, values_l, pads_l[1:]):
        record_starts.append(len(tokens))
        tokens += codec.record_tokens(key, value)
        if n_fill:
            tokens += filler_ids[rng.integers(0, len(filler_ids), n_fill)].tolist()
    tokens += codec.separator
    answer_positions, answer_mask = [], []
    for r in queried_.tolist():
        tokens += codec.query_tokens(keys_l[r])
        answer_positions.append(len(tokens))
        answer = codec.answer_tokens(values_l[r])
        answer_mask += range(len(tokens), len(tokens) + len(answer))
        tokens += answer
    loss_mask = np.zeros(len(tokens), dtype=bool)
    loss_mask[answer_mask] = True
    return LookupExample(
        tokens=np.asarray(tokens, dtype=np.int64),
        loss_mask=loss_mask,
        record_starts=np.asarray(record_starts, dtype=np.int64),
        keys=keys_,
        values=values_,
        answer_positions=np.asarray(answer_positions, dtype=np.int64),
        query_records=queried_,
    )


def _given_or(arr: Optional[Sequence[int]], n: int, name: str, draw) -> np.ndarray:
    if arr is None:
        return np.asarray(draw(), dtype=np.int64)
    out = np.asarray(arr, dtype=np.int64)
    if out.shape != (n,):
        raise ValueError(f"{name} must have {n} entries, got shape {out.shape}")
    return out


def make_lookup_example(
    fmt: LookupFormat,
    rng: np.random.Generator,
    n_records: int,
    n_queries: int,
    filler: tuple[int, int] = (0, 0),
    prefix_pad: int = 0,
    tail_filler: Optional[tuple[int, int]] = None,
    *,
    keys: Optional[Sequence[int]] = None,
    values: Optional[Sequence[int]] = None,
    fillers: Optional[Sequence[int]] = None,
    query_records: Optional[Sequence[int]] = None,
    distinct_queries: bool = False,
) -> LookupExample:
    """Draw one training lookup sequence, deterministically given ``rng``, and assemble it (``assemble_lookup``).

    ``filler=(lo, hi)``: the number of filler tokens after each record is uniform in ``[lo, hi]``, after the
    last one in ``tail_filler`` when given; ``prefix_pad`` pad tokens follow ``bos``. Keys are distinct, values
    drawn with replacement, queried records drawn with replacement (``distinct_queries``: without).
    ``keys``/``values``/``fillers`` (per record) and ``query_records`` (per query) override the random draws, for
    position-controlled evaluations.
    """
    if not 1 <= n_records <= fmt.n_keys:
        raise ValueError(f"n_records={n_records} must be in [1, n_keys={fmt.n_keys}] (records use distinct keys)")
    if n_queries < 0 or prefix_pad < 0:
        raise ValueError(f"n_queries={n_queries} and prefix_pad={prefix_pad} must be >= 0")
    if distinct_queries and n_queries > n_records:
        raise ValueError(f"n_queries={n_queries} distinct queries need as many records, got n_records={n_records}")
    lo, hi = filler
    tlo, thi = filler if tail_filler is None else tail_filler
    if not 0 <= lo <= hi or not 0 <= tlo <= thi:
        raise ValueError(f"filler={filler} and tail_filler={tail_filler} must be (lo, hi) with 0 <= lo <= hi")

    def draw_fillers() -> np.ndarray:
        if tail_filler is None:  # one draw for all records: the stream of configs without a tail range
            return rng.integers(lo, hi + 1, n_records)
        return np.append(rng.integers(lo, hi + 1, n_records - 1), rng.integers(tlo, thi + 1))

    # draws in a fixed order so that the same rng state gives the same example (the filler tokens come last)
    keys_ = _given_or(keys, n_records, "keys", lambda: rng.choice(fmt.n_keys, n_records, replace=False))
    values_ = _given_or(values, n_records, "values", lambda: rng.integers(0, fmt.n_values, n_records))
    fillers_ = _given_or(fillers, n_records, "fillers", draw_fillers)

    def draw_queries() -> np.ndarray:
        if distinct_queries:
            return rng.choice(n_records, n_queries, replace=False)
        return rng.integers(0, n_records, n_queries)

    queried = _given_or(query_records, n_queries, "query_records", draw_queries)
    return assemble_lookup(fmt, keys_, values_, np.concatenate([[prefix_pad], fillers_]), queried, rng)
