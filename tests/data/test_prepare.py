"""``python -m ckv.data.prepare``: byte-identical shards for any --num-proc, the hash split, literal special tokens,
the manifest and the no-op rerun."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckv.data.config import TextConfig
from ckv.data.prepare import is_val, main, prepare
from ckv.data.text import build_text_source
from ckv.data.tokenizer import load_tokenizer, text_tokenizer
from tests.helpers import assert_documented

from .conftest import EOD, make_docs

LITERAL = f"a document quoting {EOD} inside its text"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def split_docs(out: Path, split: str, tokenizer: str) -> list[str]:
    """The documents of a prepared split, decoded, in shard order."""
    m = json.loads((out / "manifest.json").read_text())
    tokens = np.concatenate(
        [np.fromfile(out / s["tokens"], dtype=m["dtype"]) for s in m["splits"][split]["shards"]]
    ).astype(np.int64)
    eod = m["tokenizer"]["eod_id"]
    ends = np.flatnonzero(tokens == eod)
    tok = load_tokenizer(tokenizer)
    return [tok.decode(tokens[a + 1 : b].tolist()) for a, b in zip(np.r_[-1, ends[:-1]], ends)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    docs = make_docs(300)
    docs[7] = LITERAL
    return write_jsonl(tmp_path_factory.mktemp("prep") / "docs.jsonl", [{"text": t} for t in docs])


def test_shards_are_byte_identical_for_any_num_proc(corpus: Path, tokenizer: str, tmp_path: Path) -> None:
    kw = dict(val_fraction=0.1, seed=3, shard_tokens=3000)
    m1 = prepare([str(corpus)], tokenizer, str(tmp_path / "one"), num_proc=1, **kw)
    m2 = prepare([str(corpus)], tokenizer, str(tmp_path / "two"), num_proc=2, **kw)
    assert m1 == m2
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    assert len(m1["splits"]["train"]["shards"]) > 1  # several shards, documents crossing their boundaries
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_manifest_offsets_and_counts(corpus: Path, tokenizer: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    m = prepare([str(corpus)], tokenizer, str(out), val_fraction=0.1, shard_tokens=3000)
    assert m["dtype"] == "uint16" and m["inputs"][0]["bytes"] == corpus.stat().st_size
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 300
    for split in ("train", "val"):
        info, starts_seen = m["splits"][split], 0
        for s in info["shards"]:
            tokens = np.memmap(out / s["tokens"], dtype=np.uint16, mode="r")
            starts = np.load(out / s["documents"])
            assert len(tokens) == s["n_tokens"] <= 3000
            # every document start but the split's first follows an end-of-document token
            before = starts[starts > 0] - 1
            assert (tokens[before] == m["tokenizer"]["eod_id"]).all()
            starts_seen += len(starts)
        assert starts_seen == info["documents"]
        assert sum(s["n_tokens"] for s in info["shards"]) == info["tokens"]
        assert len(split_docs(out, split, tokenizer)) == info["documents"]  # one EOD per document, no more
    assert (out / "tokenizer.json").read_bytes() == Path(tokenizer).read_bytes()


def test_rerun_is_a_noop(corpus: Path, tokenizer: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    args = ["--input", str(corpus), "--tokenizer", tokenizer, "--out", str(out), "--val-fraction", "0.1"]
    main(args)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    capsys.readouterr()
    main(args)
    assert "up to date" in capsys.readouterr().out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    main([*args[:-1], "0.2"])  # another setting: prepared again
    assert json.loads((out / "manifest.json").read_text())["val_fraction"] == 0.2
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not shards")
    with pytest.raises(ValueError, match="is not a prepared folder"):  # never replaces a folder it did not write
        prepare([str(corpus)], tokenizer, str(tmp_path / "mine"))


def test_literal_special_token_text_stays_text(corpus: Path, tokenizer: str, tmp_path: Path) -> None:
    eod = load_tokenizer(tokenizer).token_to_id(EOD)
    assert eod in load_tokenizer(tokenizer).encode(LITERAL, add_special_tokens=False).ids  # the bug being avoided
    assert eod not in text_tokenizer(tokenizer).encode(LITERAL, add_special_tokens=False).ids
    out = tmp_path / "out"
    prepare([str(corpus)], tokenizer, str(out), val_fraction=0.0)
    assert LITERAL in split_docs(out, "train", tokenizer)
    # the in-training text sources (streaming and packed) encode the same way
    cfg = TextConfig(paths=[str(corpus)], tokenizer=tokenizer, streaming=True)
    src = build_text_source(
        cfg, 16, extra_special_tokens=[], cache_dir=str(tmp_path), seed=0, split=0, rank=0, world_size=1
    )
    (ids,) = src.encode(iter([LITERAL]))
    assert list(ids).count(eod) == 1 and ids[-1] == eod


def test_val_split_follows_document_ids_not_rows(tokenizer: str, tmp_path: Path) -> None:
    docs = make_docs(200, seed=1)
    rows = [{"id": f"d{i}", "text": t} for i, t in enumerate(docs)]
    rng = np.random.default_rng(0)
    variants = {
        "base": rows,
        "reordered": [rows[i] for i in rng.permutation(len(rows))],
        "added": rows + [{"id": f"new{i}", "text": t} for i, t in enumerate(make_docs(50, seed=2))],
    }
    val = {}
    for name, rs in variants.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", rs)
        prepare([str(path)], tokenizer, str(tmp_path / name), val_fraction=0.2)
        val[name] = set(split_docs(tmp_path / name, "val", tokenizer))
    expected = {r["text"] for r in rows if is_val(r["id"], 0.2)}
    assert 0 < len(expected) < len(rows)
    assert val["base"] == val["reordered"] == expected
    assert val["added"] & set(docs) == expected  # the old documents stay where they were


def test_txt_and_saved_folder_inputs(corpus_dir: Path, docs: list[str], tokenizer: str, tmp_path: Path) -> None:
    for name in ("docs.txt", "saved"):
        m = prepare([str(corpus_dir / name)], tokenizer, str(tmp_path / name), val_fraction=0.0)
        assert m["splits"]["train"]["documents"] == len(docs)
        assert sorted(split_docs(tmp_path / name, "train", tokenizer)) == sorted(docs)


BAD_ROWS = [{"text": 5}, {"text": [1, 2]}, {"text": None}, {"text": ""}]


@pytest.mark.parametrize(
    "rows, flags, line",
    [
        (  # every row without text: refused, nothing written (was "0 train and 0 val tokens" and exit 0)
            BAD_ROWS,
            [],
            "ckv: error: --input: 4 of 4 rows have no text in --text-field='text' (first: corpus.jsonl:0 (int), "
            "corpus.jsonl:1 (list), corpus.jsonl:2 (null), corpus.jsonl:3 (empty text)): nothing to write; fix the "
            "corpus or choose --text-field",
        ),
        (
            [{"text": "a good document"}, *BAD_ROWS[2:]],
            ["--strict"],
            "ckv: error: --strict: 2 of 3 rows have no text in --text-field='text' (first: corpus.jsonl:1 (null), "
            "corpus.jsonl:2 (empty text)); fix or remove those rows, or leave out --strict to skip them",
        ),
        (  # was "could not read ... as json: StopIteration"
            [],
            [],
            "ckv: error: --input: 'corpus.jsonl' is empty (0 bytes); remove it or give a corpus with text",
        ),
        (  # was named data.text.paths
            None,
            [],
            "ckv: error: --input: 'corpus.jsonl' does not exist (or the pattern matches no file)",
        ),
    ],
)
def test_bad_corpus_is_one_line(
    rows: list | None, flags: list, line: str, tokenizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A corpus without a usable row, a bad row under --strict, an empty or missing file: one documented line, exit
    code 2, and no output folder."""
    monkeypatch.chdir(tmp_path)
    if rows is not None:
        write_jsonl(tmp_path / "corpus.jsonl", rows)
    with pytest.raises(SystemExit) as e:
        main(["--input", "corpus.jsonl", "--tokenizer", tokenizer, "--out", "out", *flags])
    err = capsys.readouterr().err.strip().splitlines()  # datasets' progress bars, then the error
    assert e.value.code == 2 and err[-1] == line and [x for x in err if "error" in x] == [line]
    assert not (tmp_path / "out").exists()
    assert_documented(line)


def test_skipped_rows_are_reported(tokenizer: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Rows without text are skipped with a line that counts them, names the first and why; the rest is written."""
    rows = [{"id": f"d{i}", "text": t} for i, t in enumerate(make_docs(7))]
    rows[2]["text"], rows[5]["text"] = None, 3
    m = prepare([str(write_jsonl(tmp_path / "c.jsonl", rows))], tokenizer, str(tmp_path / "out"), val_fraction=0.0)
    report = [x for x in capsys.readouterr().out.splitlines() if x.startswith("skipped")]
    assert report == [
        "skipped 2 of 7 rows with no text in --text-field='text' (first: d2 (null), d5 (int)); --strict refuses them"
    ]
    assert m["skipped_rows"] == 2 and m["splits"]["train"]["documents"] == 5
