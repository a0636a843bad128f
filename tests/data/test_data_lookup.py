"""The synthetic lookup layout and example generator (the contract evaluation relies on)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ckv.config import ConfigError
from ckv.data.lookup import LookupFormat, make_lookup_example

FORMATS = [
    LookupFormat(record="kv", n_keys=12, n_values=10, n_filler=3),
    LookupFormat(record="kkvv", n_keys=20, n_values=30, n_filler=2, offset=7),
    LookupFormat(record="split", n_keys=16, n_values=16, key_base=4),
    LookupFormat(record="split", n_keys=10, n_values=5, key_base=3, offset=100),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.record}-{f.offset}")
def test_layout_is_contiguous_disjoint_and_sized(fmt: LookupFormat) -> None:
    ranges = list(fmt.ranges.values())
    assert ranges[0].start == fmt.offset
    for a, b in zip(ranges, ranges[1:]):
        assert a.stop == b.start  # contiguous, in id order, hence disjoint
    assert fmt.vocab_size == ranges[-1].stop == fmt.offset + fmt.layout_size
    assert [fmt.pad_id, fmt.bos_id, fmt.sep_id] == list(fmt.ranges["special"])
    assert set(fmt.answer_range) <= set(fmt.ranges["answer" if fmt.record == "split" else "value"])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.record}-{f.offset}")
def test_tokens_are_injective_and_in_their_ranges(fmt: LookupFormat) -> None:
    r = fmt.ranges
    records = {}
    for k, v in itertools.product(range(fmt.n_keys), range(fmt.n_values)):
        rec = fmt.record_tokens(k, v)
        assert len(rec) == fmt.record_len and all(fmt.offset + 3 + fmt.n_filler <= t < fmt.vocab_size for t in rec)
        records[tuple(rec)] = (k, v)
        assert fmt.answer_tokens(v)[0] in fmt.answer_range
    assert len(records) == fmt.n_keys * fmt.n_values  # every (key, value) pair has its own record
    queries = {tuple(fmt.query_tokens(k)) for k in range(fmt.n_keys)}
    answers = {tuple(fmt.answer_tokens(v)) for v in range(fmt.n_values)}
    assert len(queries) == fmt.n_keys and len(answers) == fmt.n_values
    if fmt.record == "kv":  # the paper's record: key token immediately followed by value token
        assert fmt.record_tokens(3, 4) == [r["key"][3], r["value"][4]] == fmt.query_tokens(3) + fmt.answer_tokens(4)
    if fmt.record == "kkvv":
        assert fmt.record_tokens(11, 29) == fmt.query_tokens(11) + fmt.answer_tokens(29)
        assert fmt.query_tokens(11) == [r["key"][11 // fmt.key_base], r["key"][11 % fmt.key_base]]
    if fmt.record == "split":  # X(k_hi, v) Y(k_lo, v); queries and answers have their own ranges
        k, v = fmt.n_keys - 1, 2
        hi, lo = divmod(k, fmt.key_base)
        assert fmt.record_tokens(k, v) == [r["record_hi"][hi * fmt.n_values + v], r["record_lo"][lo * fmt.n_values + v]]
        assert fmt.query_tokens(k) == [r["query"][k]] and fmt.answer_tokens(v) == [r["answer"][v]]


def test_format_validation_names_the_problem() -> None:
    with pytest.raises(ConfigError, match="lookup.record"):
        LookupFormat(record="kvkv")
    with pytest.raises(ConfigError, match="lookup.key_base=3 is too small"):
        LookupFormat(record="kkvv", n_keys=10, key_base=3)
    with pytest.raises(ConfigError, match="lookup.key_base is only used"):
        LookupFormat(record="kv", key_base=4)
    with pytest.raises(ConfigError, match="lookup.n_keys"):
        LookupFormat(n_keys=0)
    fmt = LookupFormat(record="kv", n_keys=4, n_values=4, offset=10)
    fmt.validate(fmt.vocab_size, reserved_ids=[0, fmt.vocab_size])
    with pytest.raises(ConfigError, match="vocabulary has only"):
        fmt.validate(fmt.vocab_size - 1)
    with pytest.raises(ConfigError, match="reserved id 12 falls inside the lookup layout's 'special' range"):
        fmt.validate(100, reserved_ids=[12])
    with pytest.raises(ValueError, match="key 4 is outside"):
        fmt.record_tokens(4, 0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.record}-{f.offset}")
def test_example_structure(fmt: LookupFormat) -> None:
    n_rec, n_q, pad = min(8, fmt.n_keys), 12, 3
    filler = (0, 2) if fmt.n_filler else (0, 0)
    ex = make_lookup_example(fmt, np.random.default_rng(1), n_rec, n_q, filler=filler, prefix_pad=pad)
    t = ex.tokens.tolist()
    assert t[0] == fmt.bos_id and t[1 : 1 + pad] == [fmt.pad_id] * pad
    assert len(set(ex.keys.tolist())) == n_rec  # distinct keys
    for i, start in enumerate(ex.record_starts):
        assert t[start : start + fmt.record_len] == fmt.record_tokens(int(ex.keys[i]), int(ex.values[i]))
        end = ex.record_starts[i + 1] if i + 1 < n_rec else t.index(fmt.sep_id)
        assert all(tok in fmt.filler_ids for tok in t[start + fmt.record_len : end])  # only filler between records
    sep = t.index(fmt.sep_id)
    assert t[sep : sep + 2] == [fmt.sep_id] * 2 and fmt.sep_id not in t[sep + 2 :]
    mask = np.zeros(len(t), dtype=bool)
    for q, pos in enumerate(ex.answer_positions):
        r = int(ex.query_records[q])
        assert t[pos - fmt.query_len : pos] == fmt.query_tokens(int(ex.keys[r]))
        answer = fmt.answer_tokens(int(ex.values[r]))
        assert t[pos : pos + len(answer)] == answer
        mask[pos : pos + len(answer)] = True
    assert (ex.loss_mask == mask).all() and ex.answer_positions[0] > sep
    n_fill = sum(tok in fmt.filler_ids for tok in t)
    assert len(t) == fmt.example_len(n_rec, n_q, n_fill, pad)


def test_example_is_deterministic_and_overridable() -> None:
    fmt = LookupFormat(record="kv", n_keys=32, n_values=32, n_filler=2)
    a = make_lookup_example(fmt, np.random.default_rng(5), 16, 8, filler=(0, 3))
    b = make_lookup_example(fmt, np.random.default_rng(5), 16, 8, filler=(0, 3))
    c = make_lookup_example(fmt, np.random.default_rng(6), 16, 8, filler=(0, 3))
    assert (a.tokens == b.tokens).all() and not np.array_equal(a.tokens, c.tokens)
    fillers = [3, 0, 1, 2]
    ex = make_lookup_example(fmt, np.random.default_rng(0), 4, 2, keys=[9, 1, 5, 7], values=[0, 0, 3, 4],
                             fillers=fillers, query_records=[3, 3])
    assert np.diff(ex.record_starts).tolist() == [2 + f for f in fillers[:-1]]
    assert ex.tokens[ex.answer_positions].tolist() == [fmt.answer_tokens(4)[0]] * 2
    assert ex.tokens[ex.answer_positions - 1].tolist() == [fmt.query_tokens(7)[0]] * 2
    with pytest.raises(ValueError, match="n_records=40 must be in"):
        make_lookup_example(fmt, np.random.default_rng(0), 40, 2)
    with pytest.raises(ValueError, match="keys must be distinct"):
        make_lookup_example(fmt, np.random.default_rng(0), 2, 2, keys=[1, 1])
    with pytest.raises(ValueError, match="no filler ids"):
        make_lookup_example(LookupFormat(n_filler=0), np.random.default_rng(0), 2, 2, filler=(1, 1))


def test_queries_are_drawn_with_replacement_from_the_records() -> None:
    fmt = LookupFormat(record="split", n_keys=16, n_values=16)
    rng = np.random.default_rng(0)
    counts = np.zeros(4)
    for _ in range(200):
        ex = make_lookup_example(fmt, rng, 4, 8)
        counts += np.bincount(ex.query_records, minlength=4)
    assert counts.min() > 0.2 * counts.sum() / 4  # every record index is asked, roughly uniformly
