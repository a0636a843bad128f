"""The synthetic lookup layout and example generator (the contract evaluation relies on)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ckv.config import ConfigError
from ckv.data.lookup import RECORDS, LookupFormat, assemble_lookup, make_lookup_example

FORMATS = [
    LookupFormat(record="kv", n_keys=12, n_values=10, n_filler=3),
    LookupFormat(record="kkvv", n_keys=20, n_values=30, n_filler=2, offset=7),
    LookupFormat(record="split", n_keys=16, n_values=16, key_base=4),
    LookupFormat(record="split", n_keys=10, n_values=5, key_base=3, offset=100),
    LookupFormat(record="keyed", n_keys=12, n_values=7, offset=5),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.record}-{f.offset}")
def test_layout_is_contiguous_disjoint_and_sized(fmt: LookupFormat) -> None:
    ranges = list(fmt.ranges.values())
    assert ranges[0].start == fmt.offset
    for a, b in zip(ranges, ranges[1:]):
        assert a.stop == b.start  # contiguous, in id order, hence disjoint
    assert fmt.vocab_size == ranges[-1].stop == fmt.offset + fmt.layout_size
    assert [fmt.pad_id, fmt.bos_id, fmt.sep_id] == list(fmt.ranges["special"])
    assert set(fmt.answer_range) <= set(fmt.ranges["answer" if fmt.record in ("split", "keyed") else "value"])


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
    if fmt.record == "keyed":  # K(k) V(k, v): the value token carries the key; the query is the key token again
        assert fmt.record_tokens(3, 4) == [r["key"][3], r["value"][3 * fmt.n_values + 4]]
        assert fmt.query_tokens(3) == [r["key"][3]] and fmt.answer_tokens(4) == [r["answer"][4]]


def test_format_validation_names_the_problem() -> None:
    with pytest.raises(ConfigError, match="lookup.record"):
        LookupFormat(record="kvkv")
    with pytest.raises(ConfigError, match="lookup.key_base=3 is too small"):
        LookupFormat(record="kkvv", n_keys=10, key_base=3)
    with pytest.raises(ConfigError, match="lookup.key_base is only used"):
        LookupFormat(record="kv", key_base=4)
    with pytest.raises(ConfigError, match="lookup.value_base is only used .* record='keyed'"):
        LookupFormat(record="keyed", value_base=4)
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
    ex = make_lookup_example(
        fmt,
        np.random.default_rng(0),
        4,
        2,
        keys=[9, 1, 5, 7],
        values=[0, 0, 3, 4],
        fillers=fillers,
        query_records=[3, 3],
    )
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


# ---- the one assembler: a property test over random layouts (all three records, several filler ids) --------
def _read_back(fmt: LookupFormat, tokens: list[int], n_records: int) -> dict:
    """Recover records, pads and queries from a sequence using only the layout's id ranges and token maps
    (tested above to be injective); asserts the sequence has the documented shape on the way."""
    pairs = itertools.product(range(fmt.n_keys), range(fmt.n_values))
    records = {tuple(fmt.record_tokens(k, v)): (k, v) for k, v in pairs}
    queries = {tuple(fmt.query_tokens(k)): k for k in range(fmt.n_keys)}
    answers = {tuple(fmt.answer_tokens(v)): v for v in range(fmt.n_values)}
    assert tokens[0] == fmt.bos_id
    i, pads, starts, keys, values = 1, [0], [], [], []
    while tokens[i] == fmt.pad_id:
        pads[0], i = pads[0] + 1, i + 1
    for _ in range(n_records):
        starts.append(i)
        key, value = records[tuple(tokens[i : i + fmt.record_len])]
        keys.append(key)
        values.append(value)
        i += fmt.record_len
        pads.append(0)
        while tokens[i] in fmt.filler_ids:
            pads[-1], i = pads[-1] + 1, i + 1
    assert tokens[i : i + 2] == [fmt.sep_id, fmt.sep_id]
    i += 2
    queried, answer_positions = [], []
    while i < len(tokens):
        key = queries[tuple(tokens[i : i + fmt.query_len])]
        i += fmt.query_len
        answer_positions.append(i)
        assert answers[tuple(tokens[i : i + fmt.answer_len])] == values[keys.index(key)]  # the record's value
        i += fmt.answer_len
        queried.append(keys.index(key))
    assert i == len(tokens)
    return dict(keys=keys, values=values, pads=pads, queried=queried, starts=starts, answer_positions=answer_positions)


def _random_format(rng: np.random.Generator) -> LookupFormat:
    return LookupFormat(
        record=RECORDS[int(rng.integers(len(RECORDS)))],
        n_keys=int(rng.integers(2, 26)),
        n_values=int(rng.integers(1, 26)),
        n_filler=int(rng.choice([1, 2, 3, 5])),
        offset=int(rng.integers(0, 40)),
    )


def test_training_examples_and_evaluation_prompts_come_from_one_assembler() -> None:
    """For random layouts, records, pads and queries: the assembled sequence reads back to its inputs; a
    training example reads back to its recorded draws; an evaluation prompt plus its answer reads back to a
    sequence of the same layout whose last query asks the target record; fillers use every filler id."""
    from ckv.eval.lookup import LookupSpec, LookupTask

    rng = np.random.default_rng(2024)
    fillers_seen: dict[int, set] = {}
    for case in range(300):
        fmt = _random_format(rng)
        n = int(rng.integers(1, fmt.n_keys + 1))
        keys = rng.choice(fmt.n_keys, n, replace=False)
        values = rng.integers(0, fmt.n_values, n)
        pads = rng.integers(0, 4, n + 1)
        queried = rng.integers(0, n, int(rng.integers(1, 7)))
        ex = assemble_lookup(fmt, keys, values, pads, queried, np.random.default_rng(case))
        got = _read_back(fmt, ex.tokens.tolist(), n)
        assert (got["keys"], got["values"], got["pads"], got["queried"]) == (
            keys.tolist(),
            values.tolist(),
            pads.tolist(),
            queried.tolist(),
        )
        assert got["starts"] == ex.record_starts.tolist() and got["answer_positions"] == ex.answer_positions.tolist()
        mask = np.zeros(len(ex.tokens), dtype=bool)
        for pos in ex.answer_positions:
            mask[pos : pos + fmt.answer_len] = True
        assert (ex.loss_mask == mask).all()
        assert len(ex.tokens) == fmt.example_len(n, len(queried), int(pads[1:].sum()), int(pads[0]))
        # the evaluation prompt is the sequence up to the last query's scored answer
        assert ex.prompt.tolist() + [ex.answer_id] == ex.tokens[: ex.answer_positions[-1] + 1].tolist()
        assert ex.answer_id == fmt.answer_tokens(int(values[queried[-1]]))[0]
        fillers_seen.setdefault(fmt.n_filler, set()).update(
            t - fmt.filler_ids.start for t in ex.tokens.tolist() if t in fmt.filler_ids
        )

        train = make_lookup_example(fmt, np.random.default_rng(case), n, 4, filler=(0, 2), prefix_pad=int(pads[0]))
        got = _read_back(fmt, train.tokens.tolist(), n)
        assert got["keys"] == train.keys.tolist() and got["values"] == train.values.tolist()
        assert got["queried"] == train.query_records.tolist() and got["pads"][0] == pads[0]

        if case % 10 == 0 and n >= 2:
            spec = LookupSpec(
                n_records=n,
                n_demos=min(2, n - 1),
                n_base=8,
                modulus=4,
                fixed_query=False,
                padding=("prefix", "in_sequence")[case % 20 // 10],
                seed=case,
            )
            task = LookupTask(spec, fmt, max_len=10_000)
            tab = task.table
            for j, prompt in enumerate(task.prompts):
                full = prompt.tolist() + fmt.answer_tokens(int(tab["value"][j]))
                got = _read_back(fmt, full, n)
                target = int(tab["target_record"][j])
                assert got["queried"][-1] == target and got["starts"][target] == tab["target_position"][j]
                assert (got["keys"][target], got["values"][target]) == (tab["key"][j], tab["value"][j])
                assert tab["answer_id"][j] == full[len(prompt)] and len(got["queried"]) == spec.n_demos + 1
    for n_filler, seen in fillers_seen.items():
        assert seen == set(range(n_filler)), f"n_filler={n_filler}: filler ids used {sorted(seen)}"
