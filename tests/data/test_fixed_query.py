"""The fixed-query design of make demo / make robust: training draws filler after the last record (``tail_filler``),
and the evaluation's prompts use only layouts training drew (``LookupConfig.pads_outside``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
from omegaconf import OmegaConf

from ckv.config import ConfigError
from ckv.data import DataConfig
from ckv.data.config import LookupConfig
from ckv.data.lookup import make_lookup_example
from ckv.data.synthetic import LookupSequences

CONF = Path(__file__).resolve().parents[2] / "conf"
TASK_FIELDS = ("n_base", "modulus", "padding", "fixed_query")


def data_preset(name: str) -> DataConfig:
    return DataConfig.from_dict(OmegaConf.to_container(OmegaConf.load(CONF / "data" / f"{name}.yaml")))


def demo_task(training: LookupConfig, max_len: int = 128, **overrides: object):
    """The demo's evaluation (conf/eval/task/demo_lookup.yaml, 64 base examples) of a run trained on
    ``training``, in a context of ``max_len`` tokens."""
    from ckv.eval.lookup import LookupSpec, LookupTask

    task = OmegaConf.to_container(OmegaConf.load(CONF / "eval" / "task" / "demo_lookup.yaml"))
    spec = LookupSpec(**{**{k: task[k] for k in TASK_FIELDS}, "n_base": 64, "stride": 4, **overrides})
    return LookupTask(spec, training.format(0), max_len=max_len, training=training)


def test_tail_filler_goes_after_the_last_record_only() -> None:
    cfg = LookupConfig(record="split", key_base=4, filler=(0, 0), tail_filler=(0, 8), prefix_pad=(0, 8))
    fmt = cfg.format(0)
    seen_tail, seen_prefix = set(), set()
    for i in range(400):
        rng = np.random.default_rng(i)
        pad = int(rng.integers(0, 9))
        ex = make_lookup_example(fmt, rng, 16, 8, filler=cfg.filler, prefix_pad=pad, tail_filler=cfg.tail_filler)
        starts = ex.record_starts
        assert starts[0] == 1 + pad and (np.diff(starts) == fmt.record_len).all()  # records back to back
        sep = int(np.flatnonzero(ex.tokens == fmt.sep_id)[0])
        tail = sep - (starts[-1] + fmt.record_len)
        assert all(int(t) in fmt.filler_ids for t in ex.tokens[sep - tail : sep])
        seen_tail.add(tail)
        seen_prefix.add(pad)
        assert len(ex.tokens) <= cfg.max_len
    assert seen_tail == set(range(9)) and seen_prefix == set(range(9))
    assert cfg.max_len == 1 + 8 + 32 + 8 + 2 + 16


def test_the_training_stream_draws_the_tail_range() -> None:
    cfg = data_preset("lookup_split")
    stream = LookupSequences(cfg.lookup, cfg.lookup.format(0), cfg.seq_len, seed=0, split=0, rank=0, world_size=1)
    fmt = cfg.lookup.format(0)
    tails = set()
    for _ in range(300):
        tokens, _ = stream.next()
        sep = int(np.flatnonzero(tokens == fmt.sep_id)[0])
        tails.add(int(np.isin(tokens[:sep], list(fmt.filler_ids)).sum()))
    assert tails == set(range(9))


def split_stream(seq_len: Optional[int] = None, **lookup: Any) -> tuple[LookupSequences, Any]:
    """The ``lookup_split`` preset's training stream with ``lookup`` settings changed (and ``seq_len``), and its
    format."""
    d = data_preset("lookup_split").to_dict()
    d["lookup"] |= lookup
    d["seq_len"] = seq_len or d["seq_len"]
    cfg = DataConfig.from_dict(d)
    fmt = cfg.lookup.format(0)
    return LookupSequences(cfg.lookup, fmt, cfg.seq_len, seed=0, split=0, rank=0, world_size=1), fmt


def records_held(tokens: np.ndarray, fmt: Any) -> int:
    """How many records a training sequence lays out: its record tokens between bos and the first separator."""
    sep = int(np.flatnonzero(tokens == fmt.sep_id)[0])
    return int((~np.isin(tokens[1:sep], [fmt.pad_id, *fmt.filler_ids])).sum()) // fmt.record_len


def queries_asked(tokens: np.ndarray, fmt: Any, n: int) -> np.ndarray:
    """The first ``n`` query tokens of a training sequence: its (query, answer) pairs after the last separator."""
    sep = int(np.flatnonzero(tokens == fmt.sep_id)[-1])
    return tokens[sep + 1 :: 2][:n]


@pytest.mark.parametrize("min_records", [None, 8])
def test_min_records_draws_each_sequence_s_record_count_from_the_range(min_records) -> None:
    stream, fmt = split_stream(min_records=min_records)
    counts = set()
    for _ in range(300):
        tokens, labels = stream.next()
        counts.add(records_held(tokens, fmt))
        assert (labels != -100).sum() == stream.cfg.n_queries  # every sequence still asks n_queries
    assert counts == ({16} if min_records is None else set(range(8, 17)))


@pytest.mark.parametrize("distinct", [False, True])
def test_distinct_queries_ask_each_record_at_most_once(distinct: bool) -> None:
    stream, fmt = split_stream(106, n_queries=16, distinct_queries=distinct)
    repeats = 0
    for _ in range(100):
        tokens, labels = stream.next()
        asked = queries_asked(tokens, fmt, 16)
        assert (labels != -100).sum() == 16
        repeats += 16 - len(set(asked.tolist()))
    # with replacement 16 queries of 16 records repeat about 6 of them (16 - 16 * (1 - (15/16)**16))
    assert repeats == 0 if distinct else repeats > 400, repeats


def test_distinct_queries_ask_every_record_of_a_sequence_that_holds_fewer_than_n_queries() -> None:
    """min_records 8, 16 distinct queries: a sequence of r records asks min(16, r) distinct ones, i.e. all r of
    them (each record once), and nothing after the last answer but pads."""
    stream, fmt = split_stream(106, n_queries=16, min_records=8, distinct_queries=True)
    counts = set()
    for _ in range(200):
        tokens, labels = stream.next()
        n = records_held(tokens, fmt)
        answered = int((labels != -100).sum())
        asked = queries_asked(tokens, fmt, answered)
        assert answered == n and len(set(asked.tolist())) == n, (n, answered)
        counts.add(n)
    assert counts == set(range(8, 17))


def test_the_demo_evaluation_uses_only_layouts_the_demo_data_draws(caplog: pytest.LogCaptureFixture) -> None:
    for name in ("lookup_split", "lookup_dense"):
        training = data_preset(name).lookup
        with caplog.at_level(logging.WARNING, logger="ckv.eval.lookup"):
            task = demo_task(training)
        assert not caplog.records, (name, caplog.text)
        assert len(np.unique(task.table["query_position"])) == 1  # the query stays put
        assert set(task.table["phase"].tolist()) == {0, 1, 2, 3}  # while the target visits every phase
        moving = demo_task(training, fixed_query=False)  # the moving-query design is inside training too
        assert len(np.unique(moving.table["query_position"])) == 9 and not caplog.records


def test_a_layout_training_never_drew_is_named_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    # the earlier demo data: no filler at all and prefix pads 0-7; the moving-query evaluation needs 8 pads
    old = LookupConfig(record="split", key_base=4, filler=(0, 0), prefix_pad=(0, 7))
    with caplog.at_level(logging.WARNING, logger="ckv.eval.lookup"):
        demo_task(old, fixed_query=False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "32 of 512 prompts carry prefix pads outside what training drew (data.lookup.prefix_pad=[0, 7]; "
        "these prompts have 8..8)"
    )  # 64 base examples x 8 shifts; 1 in 16 has base pad 1 and shift 7
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckv.eval.lookup"):
        demo_task(LookupConfig(record="split", key_base=4, filler=(0, 0), prefix_pad=(0, 8)))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "filler tokens after the last record outside what training drew (data.lookup.filler=[0, 0]" in line
    pads = np.zeros((3, 17), dtype=np.int64)
    assert old.pads_outside(pads) is None
    pads[1, 5] = 1
    assert old.pads_outside(pads).startswith("1 of 3 prompts carry filler tokens between records outside")
    assert "n_records=16" in old.pads_outside(np.zeros((3, 9), dtype=np.int64))


def test_bad_tail_filler_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"data.lookup.tail_filler=\[4, 2\]"):
        LookupConfig(tail_filler=[4, 2])
    with pytest.raises(ConfigError, match="data.lookup.tail_filler=.*set data.lookup.n_filler >= 1"):
        LookupConfig(tail_filler=[0, 2], n_filler=0)
    with pytest.raises(ConfigError, match="data.seq_len=64 is too short"):
        DataConfig.from_dict({**data_preset("lookup_split").to_dict(), "seq_len": 64})


def test_a_pad_budget_splits_one_budget_between_the_prefix_and_the_tail(caplog: pytest.LogCaptureFixture) -> None:
    """``pad_budget``: every training sequence's prefix pads and tail fillers sum to it, every split drawn, so the
    longest sequence is the evaluation's (make selection's wide prompts: modulus 80, a 207-token budget), whose
    layouts are all ones training drew."""
    d = data_preset("lookup_split").to_dict()
    d["lookup"] = {**d["lookup"], "tail_filler": None, "prefix_pad": [0, 207], "pad_budget": 207}
    cfg = DataConfig.from_dict({**d, "seq_len": 1 + 207 + 32 + 2 + 16})
    fmt = cfg.lookup.format(0)
    assert cfg.lookup.max_len == cfg.seq_len and cfg.lookup.last_filler == (0, 207)
    stream = LookupSequences(cfg.lookup, fmt, cfg.seq_len, seed=0, split=0, rank=0, world_size=1)
    prefixes = set()
    for _ in range(600):
        tokens, _ = stream.next()
        sep = int(np.flatnonzero(tokens == fmt.sep_id)[0])
        prefix = int((tokens[1:sep] == fmt.pad_id).sum())
        assert prefix + int(np.isin(tokens[:sep], list(fmt.filler_ids)).sum()) == 207
        prefixes.add(prefix)
    assert len(prefixes) > 190 and min(prefixes) <= 2 and max(prefixes) >= 205  # ~every split of the budget
    with caplog.at_level(logging.WARNING, logger="ckv.eval.lookup"):
        wide = demo_task(cfg.lookup, modulus=80, n_base=80, max_len=288)
    assert not caplog.records and len(wide.prompts) == 80 * 80
    assert {len(p) for p in wide.prompts} == {cfg.seq_len - 1}  # the longest sequence but its last answer
    longer = cfg.lookup.pads_outside(np.array([[0] * 16 + [208]]))  # a tail beyond the budget is named by it
    assert "filler tokens after the last record outside what training drew (data.lookup.pad_budget=[0, 207]" in longer


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(pad_budget=8, tail_filler=[0, 8]), r"data.lookup.pad_budget=8 and data.lookup.tail_filler=\[0, 8\]"),
        (dict(pad_budget=4, prefix_pad=[0, 8]), "data.lookup.pad_budget=4 is below the most prefix pads"),
        (dict(pad_budget=8, n_filler=0), "data.lookup.pad_budget=8 needs filler ids"),
        (dict(pad_budget=-1), "data.lookup.pad_budget=-1"),
    ],
)
def test_a_bad_pad_budget_names_the_field(fields: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        LookupConfig(**fields)
    assert "\n" not in str(err.value)


def test_a_prompt_that_breaks_the_pad_budget_is_named() -> None:
    cfg = LookupConfig(filler=(0, 0), prefix_pad=(0, 8), pad_budget=8)
    pads = np.zeros((2, 17), dtype=np.int64)
    pads[:, 0], pads[:, -1] = 3, 5
    assert cfg.pads_outside(pads) is None
    pads[1, -1] = 4  # each slot inside its range, the two together short of the budget
    assert cfg.pads_outside(pads) == (
        "1 of 2 prompts hold other than data.lookup.pad_budget=8 pads before the first and after the last record"
    )


def paper_cpu_lookup() -> LookupConfig:
    """make paper's training data (conf/experiment/paper_cpu.yaml over conf/data/lookup_split.yaml)."""
    base = OmegaConf.load(CONF / "data" / "lookup_split.yaml")
    recipe = OmegaConf.load(CONF / "experiment" / "paper_cpu.yaml")["data"]
    return DataConfig.from_dict(OmegaConf.to_container(OmegaConf.merge(base, recipe))).lookup


def test_make_paper_trains_on_exactly_the_layouts_of_its_prefix_evaluation(caplog: pytest.LogCaptureFixture) -> None:
    """paper_cpu's pad budget is the mod-24 evaluation's: every prefix-padded prompt is a layout training draws
    (in-sequence padding puts pads between records, which training never does: named, not hidden)."""
    from ckv.eval.lookup import LookupSpec, LookupTask

    training = paper_cpu_lookup()
    task = OmegaConf.to_container(OmegaConf.load(CONF / "eval" / "task" / "lookup.yaml"))
    for padding in ("prefix", "in_sequence"):
        caplog.clear()
        spec = LookupSpec(**{**{k: task[k] for k in TASK_FIELDS}, "n_base": 48, "padding": padding, "stride": 8})
        with caplog.at_level(logging.WARNING, logger="ckv.eval.lookup"):
            built = LookupTask(spec, training.format(0), max_len=training.max_len, training=training)
        assert len(np.unique(built.table["query_position"])) == 1
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [] if padding == "prefix" else "filler tokens between records" in lines[0], (padding, lines)
