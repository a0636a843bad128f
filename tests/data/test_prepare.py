"""``python -m ckv.data.prepare``: byte-identical shards for any --num-proc, the hash split, literal special tokens,
the manifest and the no-op rerun."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckv.data.config import TextConfig
from ckv.data.prepare import is_val, main, prepare, sha256_file
from ckv.data.text import build_text_source
from ckv.data.tokenizer import load_tokenizer, text_tokenizer, train_bpe
from tests.helpers import as_other_user, assert_documented, tree_state

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
    with pytest.raises(SystemExit):  # another setting: refused without --overwrite, the shards kept
        main([*args[:-1], "0.2"])
    assert "--overwrite to replace them" in capsys.readouterr().err
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    main([*args[:-1], "0.2", "--overwrite"])  # prepared again
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


GOOD = [json.dumps({"text": t}) for t in make_docs(6)]


@pytest.mark.parametrize(
    "content, line",
    [
        (  # was "DatasetGenerationError: An error occurred while generating the dataset"
            ("\n".join(GOOD) + "\n").encode("utf-16"),
            "ckv: error: --input: 'corpus.jsonl' is UTF-16 text; ckv reads UTF-8: convert it (iconv -f UTF-16 -t UTF-8 "
            "corpus.jsonl > corpus.jsonl.utf8)",
        ),
        (
            bytes(range(256)) * 4,
            "ckv: error: --input: 'corpus.jsonl' is a binary file (it holds NUL bytes), not text; give jsonl/json, txt "
            "or parquet files",
        ),
        (
            "\n".join([*GOOD[:3], '{"text": "a broken', *GOOD[3:]]).encode() + b"\n",
            "ckv: error: --input: 'corpus.jsonl' line 4 is not JSON (Unterminated string starting at: column 10); fix "
            "or remove that line",
        ),
        (  # was "'utf-8' codec can't decode byte 0xe9 in position 3", naming neither the file nor the row
            "\n".join(GOOD[:2]).encode() + b'\n{"text": "caf\xe9"}\n',
            "ckv: error: --input: 'corpus.jsonl' line 3 is not UTF-8 text (byte 0xe9 at column 14); fix that line's "
            "encoding or remove it (ckv reads UTF-8)",
        ),
    ],
)
def test_an_unreadable_corpus_names_the_file_and_line(
    content: bytes, line: str, tokenizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """UTF-16, binary, a row that is not JSON, a row that is not UTF-8: one line naming the file, the line and the
    way out, exit code 2, and no folder left (``--out`` two levels deep)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_bytes(content)
    with pytest.raises(SystemExit) as e:
        main(["--input", "corpus.jsonl", "--tokenizer", tokenizer, "--out", "data/shards"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1] == line and [x for x in err if "error" in x] == [line]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]  # no data/, no temporary folders
    assert_documented(line)


def _prepare_line(args: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("ckv: error:")]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_a_bad_tokenizer_or_out_is_one_line_before_any_work(
    tokenizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """--tokenizer that is not a tokenizer.json (was called data.text.tokenizer) or missing; --out that is a file,
    empty (was taken as the current folder), or a folder of other files: one line each, nothing written."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in make_docs(5)])
    (tmp_path / "tok.json").write_text("hello")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    before = tree_state(tmp_path)
    args = ["--input", "corpus.jsonl", "--tokenizer"]
    cases = {
        ("tok.json", "out"): "ckv: error: --tokenizer: 'tok.json' is not a tokenizer.json (expected value at line 1 "
        "column 1); give a tokenizer.json written by the tokenizers library (Tokenizer.save)",
        ("nothing.json", "out"): "ckv: error: --tokenizer: 'nothing.json' is not a file; give the tokenizer.json to "
        "tokenise with",
        (
            tokenizer,
            "corpus.jsonl",
        ): "ckv: error: --out 'corpus.jsonl' is a file, not a folder; give a new folder, or a "
        "prepared one to update: --out DIR",
        (tokenizer, ""): "ckv: error: --out '' is empty: it names no folder; give a new folder, or a prepared one to "
        "update: --out DIR",
        (tokenizer, "notes"): "ckv: error: --out 'notes' holds other files (todo.txt) and is not a prepared folder (no "
        "manifest.json); give a new folder, or a prepared one to update: --out DIR",
    }
    for (tok, out), line in cases.items():
        assert _prepare_line([*args, tok, "--out", out], capsys) == line
        assert_documented(line)
    assert tree_state(tmp_path) == before


def test_a_prepared_folder_is_replaced_only_with_overwrite(
    tokenizer: str, cache_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Shards prepared with one tokenizer are never replaced by another tokenizer's (was: silently, losing the old
    shards and tokenizer) unless --overwrite says so."""
    monkeypatch.chdir(tmp_path)
    other = train_bpe(make_docs(200, seed=1), vocab_size=300, special_tokens=[EOD], cache_dir=cache_dir)
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in make_docs(5)])
    main(["--input", "corpus.jsonl", "--tokenizer", tokenizer, "--out", "shards"])
    before = tree_state(tmp_path / "shards")
    line = _prepare_line(["--input", "corpus.jsonl", "--tokenizer", other, "--out", "shards"], capsys)
    was, now = (sha256_file(t)[:12] for t in (tokenizer, other))
    assert line == (
        f"ckv: error: --out 'shards' holds shards prepared otherwise: tokenizer sha256 {was} (now {now}); give another "
        "--out, or --overwrite to replace them (runs trained on them will not resume on the new ones)"
    )
    assert_documented(line.replace(was, "<old>").replace(now, "<new>"))
    assert tree_state(tmp_path / "shards") == before
    main(["--input", "corpus.jsonl", "--tokenizer", other, "--out", "shards", "--overwrite"])
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["tokenizer"]["sha256"][:12] == now


def test_an_out_another_user_can_not_write_is_one_line(tokenizer: str, tmp_path: Path) -> None:
    locked = tmp_path / "shared"
    locked.mkdir()
    locked.chmod(0o555)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in make_docs(5)])
    code, _, err = as_other_user(
        lambda: main(["--input", str(corpus), "--tokenizer", tokenizer, "--out", str(locked / "shards")])
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"ckv: error: --out {str(locked / 'shards')!r} is not writable by user ")
    assert lines[0].endswith(
        f"(Permission denied: {str(locked)!r}); give a new folder, or a prepared one to update: --out DIR"
    )
    assert list(locked.iterdir()) == []
    if "by user nobody " in lines[0]:
        assert_documented(lines[0].replace(str(tmp_path), "/data"))
