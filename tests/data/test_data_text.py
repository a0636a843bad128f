"""Text data: corpora, tokenizers, packing (in memory and streaming), held-out split, clear errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from ckv.config import ConfigError
from ckv.data import DataConfig, DataError, build_batches
from ckv.data import tokenizer as tokenizer_module
from ckv.data.corpus import SkippedDocumentsWarning, bible_chapters, iter_documents, load_corpus
from ckv.data.tokenizer import train_bpe

T = 32


def text_cfg(corpus_dir: Path, seq_len: int = T, **text: Any) -> DataConfig:
    text = {"paths": [str(corpus_dir / "docs.jsonl")], "text_field": "body", "vocab_size": 300, "val_every": 10, **text}
    return DataConfig(kind="text", seq_len=seq_len, text=text)


def encoded(tokenizer_path: str, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(tokenizer_path)
    eod = tok.token_to_id("<|endoftext|>")
    return [e.ids + [eod] for e in tok.encode_batch(texts, add_special_tokens=False)]


def windows(stream: Any, n: int) -> list[np.ndarray]:
    """The next ``n`` packed windows (inputs plus the last target) of a stream's text source."""
    out = []
    for _ in range(n):
        x, y = stream.source.next()
        assert len(x) == len(y) == stream.source.seq_len and (x[1:] == y[:-1]).all()
        out.append(np.concatenate([x, y[-1:]]))
    return out


def split_docs(docs: list[str], split: str, val_every: int = 10) -> list[str]:
    return [d for i, d in enumerate(docs) if (i % val_every == val_every - 1) == (split == "val")]


def test_formats_give_the_same_documents(corpus_dir: Path, docs: list[str], cache_dir: str) -> None:
    for paths, field in [("docs.jsonl", "body"), ("docs.txt", "text"), ("saved", "text"), ("doc*.jsonl", "body")]:
        cfg = text_cfg(corpus_dir, paths=[str(corpus_dir / paths)], text_field=field).text
        ds = load_corpus(cfg, cache_dir=cache_dir)
        assert list(iter_documents(ds, field, split=0, val_every=10)) == split_docs(docs, "train"), paths
        assert list(iter_documents(ds, field, split=1, val_every=10)) == split_docs(docs, "val"), paths


def test_documents_are_dealt_to_ranks_disjointly(corpus_dir: Path, docs: list[str], cache_dir: str) -> None:
    ds = load_corpus(text_cfg(corpus_dir).text, cache_dir=cache_dir)
    parts = [list(iter_documents(ds, "body", split=0, val_every=10, rank=r, world_size=3)) for r in range(3)]
    assert sorted(sum(parts, [])) == sorted(split_docs(docs, "train"))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_packed_windows_cover_the_tokenised_split_once_per_epoch(
    corpus_dir: Path, docs: list[str], cache_dir: str
) -> None:
    s = build_batches(text_cfg(corpus_dir), batch_size=4, seed=0, cache_dir=cache_dir)
    tokens = np.concatenate(encoded(s.tokenizer_path, split_docs(docs, "train")))  # every document ends with eod
    assert (s.source.tokens == tokens).all()
    n = (len(tokens) - 1) // T
    in_order = [tuple(tokens[i * T : i * T + T + 1]) for i in range(n)]
    got = [tuple(w) for w in windows(s, n)]
    assert len(set(got)) == n and set(got) == set(in_order)  # a permutation of all windows of T + 1 tokens
    assert got != in_order
    second_epoch = [tuple(w) for w in windows(s, n)]
    assert set(second_epoch) == set(in_order) and second_epoch != got  # reshuffled each epoch


def test_packed_ranks_are_disjoint(corpus_dir: Path, cache_dir: str) -> None:
    streams = [
        build_batches(text_cfg(corpus_dir), batch_size=4, seed=3, rank=r, world_size=2, cache_dir=cache_dir)
        for r in range(2)
    ]
    per_rank = streams[0].source.per_rank
    seen = [{tuple(w) for w in windows(s, per_rank)} for s in streams]
    assert len(seen[0]) == len(seen[1]) == per_rank and not seen[0] & seen[1]


@pytest.mark.parametrize("block", [1, 7])
def test_streaming_packs_documents_in_block_shuffled_order(
    corpus_dir: Path, docs: list[str], cache_dir: str, block: int
) -> None:
    s = build_batches(
        text_cfg(corpus_dir, streaming=True, shuffle_block=block), batch_size=4, seed=0, cache_dir=cache_dir
    )
    train = encoded(s.tokenizer_path, split_docs(docs, "train"))
    n_tokens = sum(map(len, train))
    ws = windows(s, 2 * n_tokens // T + 2)  # more than two epochs
    stream = np.concatenate([ws[0]] + [w[1:] for w in ws[1:]])  # consecutive windows share one token
    eod = train[0][-1]
    cuts = np.flatnonzero(stream == eod) + 1
    segments = [stream[a:b].tolist() for a, b in zip(np.r_[0, cuts[:-1]], cuts)]
    for epoch in range(2):
        got = segments[epoch * len(train) : (epoch + 1) * len(train)]
        for b in range(0, len(train), block):  # each block is a permutation of its documents
            assert sorted(got[b : b + block]) == sorted(train[b : b + block])
        assert (got == train) == (block == 1)


def test_streaming_ranks_read_disjoint_documents(corpus_dir: Path, docs: list[str], cache_dir: str) -> None:
    cfg = text_cfg(corpus_dir, streaming=True, shuffle_block=4)
    seen = []
    for r in range(2):
        s = build_batches(cfg, batch_size=4, seed=0, rank=r, world_size=2, cache_dir=cache_dir)
        mine = [d for i, d in enumerate(split_docs(docs, "train")) if i % 2 == r]
        n = sum(map(len, encoded(s.tokenizer_path, mine))) // T
        seen.append(np.concatenate(windows(s, n)))
    tok = Tokenizer.from_file(s.tokenizer_path)
    names = [set(re.findall(r"doc\d+", tok.decode(w.tolist()))) for w in seen]
    assert names[0] and names[1] and not names[0] & names[1]


def test_val_split_holds_out_documents(corpus_dir: Path, docs: list[str], cache_dir: str) -> None:
    for streaming in (False, True):
        cfg = text_cfg(corpus_dir, streaming=streaming, shuffle_block=3)
        s = build_batches(cfg, batch_size=2, seed=0, split="val", cache_dir=cache_dir)
        text = Tokenizer.from_file(s.tokenizer_path).decode(np.concatenate(windows(s, 10)).tolist())
        ids = set(re.findall(r"doc\d+", text))
        assert ids and ids <= {d.split()[0] for d in split_docs(docs, "val")}


def test_user_tokenizer_and_cache(corpus_dir: Path, cache_dir: str) -> None:
    trained = build_batches(text_cfg(corpus_dir), batch_size=4, seed=0, cache_dir=cache_dir)
    mtime = os.path.getmtime(trained.tokenizer_path)
    again = build_batches(text_cfg(corpus_dir), batch_size=4, seed=0, cache_dir=cache_dir)
    assert again.tokenizer_path == trained.tokenizer_path and os.path.getmtime(again.tokenizer_path) == mtime
    user = build_batches(
        text_cfg(corpus_dir, tokenizer=trained.tokenizer_path), batch_size=4, seed=0, cache_dir=cache_dir
    )
    assert user.tokenizer_path == trained.tokenizer_path and user.vocab_size == trained.vocab_size == 300
    assert all((a == b).all() for a, b in zip(next(user).values(), next(trained).values()))


def test_shipped_corpus() -> None:
    chapters = bible_chapters()
    assert len(chapters) == 1189 and chapters[0].startswith("In the beginning God created the heavens")
    assert 3_500_000 < sum(map(len, chapters)) < 4_500_000


def test_shipped_corpus_builds_batches(cache_dir: str) -> None:
    cfg = DataConfig(kind="text", seq_len=64, text={"vocab_size": 512, "bpe_max_chars": 100_000})
    s = build_batches(cfg, batch_size=3, seed=0, cache_dir=cache_dir)
    b = next(s)
    assert b["input_ids"].shape == b["labels"].shape == (3, 64) and int(b["input_ids"].max()) < s.vocab_size == 512
    assert 0.9e6 < len(s.source.tokens) < 2.5e6  # the whole train split, ~2 tokens per word


def _build(corpus_dir: Path, cache_dir: str, **text: Any) -> Any:
    return build_batches(text_cfg(corpus_dir, **text), batch_size=2, seed=0, cache_dir=cache_dir)


def test_missing_and_unreadable_inputs_are_named(corpus_dir: Path, cache_dir: str, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.text.paths: '/no/such.jsonl' does not exist"):
        _build(corpus_dir, cache_dir, paths=["/no/such.jsonl"])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        _build(corpus_dir, cache_dir, paths=[str(tmp_path / "*.parquet")])
    with pytest.raises(DataError, match="mixes file types"):
        _build(corpus_dir, cache_dir, paths=[str(corpus_dir / "docs.jsonl"), str(corpus_dir / "docs.txt")])
    with pytest.raises(DataError, match="not a jsonl/json, parquet or txt file"):
        _build(corpus_dir, cache_dir, paths=[__file__])
    with pytest.raises(DataError, match="not a readable saved `datasets` folder"):
        _build(corpus_dir, cache_dir, paths=[str(tmp_path)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DataError, match="could not read"):
        _build(corpus_dir, cache_dir, paths=[str(bad)])
    with pytest.raises(DataError, match="text_field='content' is not a column"):
        _build(corpus_dir, cache_dir, text_field="content")
    with pytest.raises(FileNotFoundError, match="data.text.tokenizer: '/no/tok.json' does not exist"):
        _build(corpus_dir, cache_dir, tokenizer="/no/tok.json")
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"model": 3}')
    with pytest.raises(DataError, match=f"data.text.tokenizer: '{garbage}' is not a readable tokenizer.json"):
        _build(corpus_dir, cache_dir, tokenizer=str(garbage))
    path = train_bpe(["no specials here"] * 10, vocab_size=280, special_tokens=["<s>"], cache_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"data.text.eod_token='<\|endoftext\|>' is not a token"):
        _build(corpus_dir, cache_dir, tokenizer=path)
    with pytest.raises(ConfigError, match="data.text.vocab_size=200 is too small"):
        _build(corpus_dir, cache_dir, vocab_size=200)


def test_too_little_data_is_an_error(corpus_dir: Path, cache_dir: str) -> None:
    with pytest.raises(DataError, match="'val' split .* val_every"):
        build_batches(text_cfg(corpus_dir, val_every=1000), batch_size=2, seed=0, split="val", cache_dir=cache_dir)
    with pytest.raises(DataError, match="'val' split .* no documents"):
        s = build_batches(
            text_cfg(corpus_dir, val_every=1000, streaming=True), batch_size=2, seed=0, split="val", cache_dir=cache_dir
        )
        next(s)


def test_stale_tokenizer_lock_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "LOCK_WAIT_S", 0.3)
    kwargs = dict(vocab_size=280, special_tokens=["<e>"], cache_dir=str(tmp_path))
    path = train_bpe(["some text"] * 5, **kwargs)
    os.remove(path)
    Path(path + ".lock").touch()
    with pytest.raises(DataError, match="remove the stale lock"):
        train_bpe(["some text"] * 5, **kwargs)


def _with_missing_text(path: Path, docs: list[str], missing: set[int]) -> Path:
    """``docs`` as jsonl, where rows ``missing`` have an ``id`` but no ``body``."""
    path.write_text(
        "".join(json.dumps({"id": i} if i in missing else {"body": t, "id": i}) + "\n" for i, t in enumerate(docs))
    )
    return path


def test_rows_without_text_are_counted_and_stop_above_the_threshold(
    docs: list[str], cache_dir: str, tmp_path: Path
) -> None:
    third = _with_missing_text(tmp_path / "third.jsonl", docs, set(range(1, len(docs), 3)))
    with pytest.raises(
        DataError,
        match=rf"40 of {len(docs)} corpus rows \(33.3%\) have no 'body' value, more than "
        r"data.text.max_skipped_fraction=0.01; the first is row 1: \{'body': None, "
        r"'id': 1\}",
    ):
        _build(tmp_path, cache_dir, paths=[str(third)])
    one = _with_missing_text(tmp_path / "one.jsonl", docs, {5})
    with pytest.warns(
        SkippedDocumentsWarning,
        match=rf"skipped 1 of {len(docs)} corpus rows \(0.8%\) without a "
        r"'body' value; the first is row 5",
    ):
        _build(tmp_path, cache_dir, paths=[str(one)], max_skipped_fraction=0.01)
    with pytest.warns(SkippedDocumentsWarning):  # a raised threshold lets it train, still reporting the count
        _build(tmp_path, cache_dir, paths=[str(third)], max_skipped_fraction=0.5)
    with pytest.raises(ConfigError, match="max_skipped_fraction=2 must be a number in"):
        text_cfg(tmp_path, max_skipped_fraction=2)


def test_empty_txt_corpus_is_named(cache_dir: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"data.text.paths: '{empty}' is empty"):
        _build(tmp_path, cache_dir, paths=[str(empty)])
