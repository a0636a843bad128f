"""Batch streams: determinism, resume, ranks, lookup labels, and the text/lookup mixture."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from ckv.config import ConfigError
from ckv.data import IGNORE, BatchStream, DataConfig, DataError, LookupFormat, build_batches, lookup_format_for

LOOKUP_FMT = {"record": "split", "n_keys": 9, "n_values": 6}  # 55 ids
LOOKUP = {**LOOKUP_FMT, "n_records": 6, "n_queries": 4, "prefix_pad": [0, 3]}


def text_part(corpus_dir: Path, **kw: Any) -> dict[str, Any]:
    return {"paths": [str(corpus_dir / "docs.jsonl")], "text_field": "body", "vocab_size": 400, "val_every": 10, **kw}


def config(
    kind: str, corpus_dir: Path, *, seq_len: int = 32, lookup: dict | None = None, ratio: float = 0.3, **text: Any
) -> DataConfig:
    return DataConfig(
        kind=kind, seq_len=seq_len, text=text_part(corpus_dir, **text), lookup=lookup or LOOKUP, mixture_ratio=ratio
    )


CASES = {
    "text": dict(kind="text"),
    "text-streaming": dict(kind="text", streaming=True, shuffle_block=5),
    "lookup": dict(kind="lookup"),
    "mixture": dict(kind="mixture"),
    "mixture-streaming": dict(kind="mixture", streaming=True, shuffle_block=5),
}


def draw(stream: BatchStream, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(stream) for _ in range(n)]


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in ("input_ids", "labels"))


@pytest.mark.parametrize("case", CASES)
def test_same_seed_same_batches(case: str, corpus_dir: Path, cache_dir: str) -> None:
    cfg = config(corpus_dir=corpus_dir, **CASES[case])
    a = draw(build_batches(cfg, batch_size=4, seed=1, cache_dir=cache_dir), 5)
    b = draw(build_batches(cfg, batch_size=4, seed=1, cache_dir=cache_dir), 5)
    c = draw(build_batches(cfg, batch_size=4, seed=2, cache_dir=cache_dir), 5)
    assert same(a, b) and not same(a, c)
    for batch in a:
        assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("before", [3, 45])  # 45 batches of 4 cross an epoch of the text part
def test_resume_continues_exactly(case: str, before: int, corpus_dir: Path, cache_dir: str) -> None:
    cfg = config(corpus_dir=corpus_dir, **CASES[case])
    build = lambda: build_batches(cfg, batch_size=4, seed=0, rank=1, world_size=2, cache_dir=cache_dir)  # noqa: E731
    uninterrupted = draw(build(), before + 6)
    first = build()
    draw(first, before)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = build()
    resumed.load_state_dict(state)
    assert same(draw(resumed, 6), uninterrupted[before:])
    assert resumed.state_dict()["batches"] == before + 6


def test_resume_refuses_a_different_stream(corpus_dir: Path, cache_dir: str) -> None:
    cfg = config("lookup", corpus_dir)
    state = build_batches(cfg, batch_size=4, seed=0, cache_dir=cache_dir).state_dict()
    with pytest.raises(ValueError, match="batch_size=4->8"):
        build_batches(cfg, batch_size=8, seed=0, cache_dir=cache_dir).load_state_dict(state)
    other = config("lookup", corpus_dir, lookup={**LOOKUP, "n_queries": 5})
    with pytest.raises(ValueError, match="data.lookup.n_queries=4->5"):
        build_batches(other, batch_size=4, seed=0, cache_dir=cache_dir).load_state_dict(state)


def test_lookup_labels_cover_only_answers(corpus_dir: Path, cache_dir: str) -> None:
    cfg = config("lookup", corpus_dir)
    s = build_batches(cfg, batch_size=16, seed=0, cache_dir=cache_dir)
    fmt = s.lookup_format
    assert s.vocab_size == fmt.vocab_size and s.tokenizer_path is None and fmt.offset == 0
    b = next(s)
    x, y = b["input_ids"], b["labels"]
    assert int(x.max()) < fmt.vocab_size and (x[:, 0] == fmt.bos_id).all()
    scored = y != IGNORE
    assert (scored.sum(1) == LOOKUP["n_queries"]).all()  # one answer token per query
    assert all(int(t) in fmt.answer_range for t in y[scored])
    assert torch.equal(x[:, 1:][scored[:, :-1]], y[scored])  # the target is the next input token
    every = build_batches(
        config("lookup", corpus_dir, lookup={**LOOKUP, "loss_on": "all"}), batch_size=16, seed=0, cache_dir=cache_dir
    )
    xa, ya = next(every).values()
    assert torch.equal(xa, x)
    target = torch.cat([x[:, 1:], torch.full((16, 1), fmt.pad_id)], 1)
    assert torch.equal(ya != IGNORE, target != fmt.pad_id) and (ya != IGNORE).sum() > scored.sum() * 4


def test_lookup_streams_differ_across_ranks_and_splits(corpus_dir: Path, cache_dir: str) -> None:
    cfg = config("lookup", corpus_dir)
    rows = [
        next(build_batches(cfg, batch_size=8, seed=0, cache_dir=cache_dir, **kw))["input_ids"]
        for kw in (dict(rank=0, world_size=2), dict(rank=1, world_size=2), dict(split="val"))
    ]
    seen = [{tuple(r.tolist()) for r in x} for x in rows]
    assert not seen[0] & seen[1] and not seen[0] & seen[2]


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_mixture_ratio_and_shared_vocabulary(ratio: float, corpus_dir: Path, cache_dir: str) -> None:
    s = build_batches(config("mixture", corpus_dir, ratio=ratio), batch_size=8, seed=0, cache_dir=cache_dir)
    fmt = s.lookup_format
    tok = Tokenizer.from_file(s.tokenizer_path)
    assert tok.token_to_id("<|endoftext|>") == 0 and fmt.offset == tok.token_to_id("<|lookup_0|>") == 1
    assert tok.token_to_id(f"<|lookup_{fmt.layout_size - 1}|>") == fmt.vocab_size - 1 < s.vocab_size == 400
    layout = set(range(fmt.offset, fmt.vocab_size))
    rows = torch.cat([b["input_ids"] for b in draw(s, 25)])  # 200 rows
    is_lookup = rows[:, 0] == fmt.bos_id
    for n in range(1, len(rows) + 1):  # exact share on every prefix
        assert int(is_lookup[:n].sum()) == math.floor(n * ratio)
    for row, lk in zip(rows.tolist(), is_lookup.tolist()):
        assert (set(row) <= layout) if lk else not set(row) & layout  # text never produces reserved lookup ids


def test_lookup_format_for_recovers_a_runs_layout(corpus_dir: Path, cache_dir: str) -> None:
    cfg = config("mixture", corpus_dir)
    s = build_batches(cfg, batch_size=2, seed=0, cache_dir=cache_dir)
    assert lookup_format_for(cfg, Tokenizer.from_file(s.tokenizer_path)) == s.lookup_format
    assert lookup_format_for(config("text", corpus_dir)) is None
    assert lookup_format_for(config("lookup", corpus_dir)) == LookupFormat(**LOOKUP_FMT)
    with pytest.raises(ValueError, match="pass the run's tokenizer"):
        lookup_format_for(cfg)
    plain = build_batches(config("text", corpus_dir), batch_size=2, seed=0, cache_dir=cache_dir).tokenizer_path
    with pytest.raises(DataError, match="does not hold the reserved lookup tokens"):
        lookup_format_for(cfg, Tokenizer.from_file(plain))


def test_mixture_with_user_tokenizer_places_lookups_by_offset(corpus_dir: Path, cache_dir: str) -> None:
    tok_path = build_batches(config("text", corpus_dir), batch_size=2, seed=0, cache_dir=cache_dir).tokenizer_path
    with pytest.raises(ConfigError, match="set data.lookup.offset"):
        build_batches(config("mixture", corpus_dir, tokenizer=tok_path), batch_size=2, seed=0, cache_dir=cache_dir)
    with pytest.raises(ConfigError, match="reserved id 0 falls inside the lookup layout"):
        build_batches(
            config("mixture", corpus_dir, tokenizer=tok_path, lookup={**LOOKUP, "offset": 0}),
            batch_size=2,
            seed=0,
            cache_dir=cache_dir,
        )
    with pytest.raises(ConfigError, match="vocabulary has only 400 ids"):
        build_batches(
            config("mixture", corpus_dir, tokenizer=tok_path, lookup={**LOOKUP, "offset": 380}),
            batch_size=2,
            seed=0,
            cache_dir=cache_dir,
        )
    s = build_batches(
        config("mixture", corpus_dir, tokenizer=tok_path, lookup={**LOOKUP, "offset": 100}),
        batch_size=8,
        seed=0,
        cache_dir=cache_dir,
    )
    assert s.lookup_format.offset == 100 and s.tokenizer_path == tok_path
    rows = torch.cat([b["input_ids"] for b in draw(s, 2)])
    lookups = rows[rows[:, 0] == s.lookup_format.bos_id]
    assert len(lookups) > 0 and int(lookups.min()) >= 100


def test_bad_arguments(corpus_dir: Path, cache_dir: str) -> None:
    cfg = config("lookup", corpus_dir)
    with pytest.raises(ConfigError, match="split='test'"):
        build_batches(cfg, batch_size=2, seed=0, split="test")
    with pytest.raises(ConfigError, match="rank=2 must be in"):
        build_batches(cfg, batch_size=2, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        build_batches(cfg, batch_size=0, seed=0)
