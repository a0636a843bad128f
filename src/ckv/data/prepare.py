"""Tokenise a corpus once into memory-mapped token shards: ``python -m ckv.data.prepare --input GLOB... --tokenizer
FILE --out DIR``.

Every run of ``data=shards`` then reads those shards (``ckv.data.shards``) instead of tokenising the corpus again.

Pipeline (``datasets`` and ``tokenizers`` do the work; nothing is downloaded):

1. Read each input file (jsonl/json, parquet, txt) with ``datasets.load_dataset`` or a saved ``datasets`` folder
   with ``load_from_disk``. Each document gets a stable id: its ``id`` column when present, else
   ``<file>:<row>``, the file named by its path relative to the inputs' common folder (two ``part-0.jsonl`` in
   different folders get different ids; moving the whole corpus keeps them).
2. Tokenise with ``Dataset.map(batched=True, num_proc=N)`` and the tokenizer's batch encoder (with ``N = 1`` the
   encoder uses its own threads; with ``N > 1`` one thread per process). Special-token text
   inside a document stays text (``Tokenizer.encode_special_tokens``); the end-of-document id is appended.
3. A document belongs to the validation split iff a hash of its id falls below ``--val-fraction``, so the split does
   not depend on row order or on other documents. Each split's documents are shuffled by ``--seed``.
4. Each split is written shard by shard (``shard_tokens`` tokens each; a document may continue into the next shard)
   as raw ``numpy.memmap`` token files (uint16 when the vocabulary fits, else uint32) with the start offset of each
   document, a copy of the tokenizer and ``manifest.json``. Everything is written into a temporary folder moved
   into place at the end.

The token files depend only on the inputs, the tokenizer and the settings, never on ``--num-proc``. A rerun whose
inputs (paths and sizes), tokenizer and settings match the manifest is a no-op; a prepared folder made with anything
else (another tokenizer, other inputs or settings) is replaced only with ``--overwrite`` (runs trained on the old
shards can not resume on the new ones). ``--out`` is checked before any work (``ckv.io.access.check_output_dir``: a
folder this user can write, new, empty or a prepared folder); a failed prepare leaves no folder behind. A corpus file
that does not read names its first bad line (not UTF-8, not JSON) and what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from ckv.checks import error_message
from ckv.data.config import MANIFEST_FILE, TOKENIZER_FILE
from ckv.data.corpus import DataError, builder_for, check_not_empty, expand_paths, load_saved
from ckv.data.tokenizer import load_tokenizer, text_tokenizer, token_id
from ckv.io.access import check_output_dir, nearest_existing, remove_empty_folders
from ckv.io.atomic import replace_dir, write_text_atomic
from ckv.io.layout import CheckpointError, read_json_file

if TYPE_CHECKING:
    import datasets

VERSION = 1
SPLITS = ("train", "val")
MAP_BATCH = 1000  # documents per tokenizer call
WRITE_BATCH = 4096  # documents gathered per write
KEY_COLUMN = "_ckv_key"
INPUT = "--input"  # the option that names the corpus files, in errors
SHOW_SKIPPED = 5  # skipped rows named in the report


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_val(key: str, val_fraction: float) -> bool:
    """Whether the document with id ``key`` is held out: its 64-bit BLAKE2b hash, as a fraction of 2**64, is below
    ``val_fraction``. Depends on nothing but the id."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return h < val_fraction * 2.0**64


@lru_cache(maxsize=2)
def _worker_tokenizer(path: str) -> Tokenizer:  # one load per map worker process
    return text_tokenizer(path)


def _keys(batch: dict[str, list], indices: list[int], name: str, id_field: str) -> dict[str, list[str]]:
    ids = batch.get(id_field)
    return {KEY_COLUMN: [f"{name}:{i}" if ids is None else str(ids[k]) for k, i in enumerate(indices)]}


def _encode(
    batch: dict[str, list], tokenizer_path: str, text_field: str, eod_id: int, val_fraction: float
) -> dict[str, list]:
    texts = batch[text_field]
    keep = [k for k, t in enumerate(texts) if isinstance(t, str) and t]
    enc = _worker_tokenizer(tokenizer_path).encode_batch([texts[k] for k in keep], add_special_tokens=False)
    ids: list[list[int]] = [[] for _ in texts]  # rows without text keep no tokens and are dropped when writing
    for k, e in zip(keep, enc):
        ids[k] = [*e.ids, eod_id]
    return {
        "ids": ids,
        "n": [len(x) for x in ids],
        "val": [is_val(key, val_fraction) for key in batch[KEY_COLUMN]],
        "skip": [f"{key} ({_why_skipped(t)})" if not x else "" for key, t, x in zip(batch[KEY_COLUMN], texts, ids)],
    }


def _why_skipped(text: Any) -> str:
    """Why a row's text value is not a document: null, empty, or its type."""
    return "null" if text is None else "empty text" if text == "" else type(text).__name__


def _check_skipped(skipped: list[str], rows: int, n_train: int, text_field: str, strict: bool) -> None:
    """Report the rows without text (``skipped``: ``"<id> (<why>)"`` each) in one line; raise DataError when
    ``strict`` and any was skipped, or when no document is left for the train split."""
    if not skipped and n_train:
        return
    first = ", ".join(skipped[:SHOW_SKIPPED]) + (", ..." if len(skipped) > SHOW_SKIPPED else "")
    share = f"{len(skipped):,} of {rows:,} rows"
    what = f"no text in --text-field={text_field!r} (first: {first})"
    if strict and skipped:
        raise DataError(f"--strict: {share} have {what}; fix or remove those rows, or leave out --strict to skip them")
    if len(skipped) == rows:
        raise DataError(f"--input: {share} have {what}: nothing to write; fix the corpus or choose --text-field")
    if not n_train:
        raise DataError("--input: every document fell into the validation split: lower --val-fraction")
    if skipped:
        print(f"skipped {share} with {what}; --strict refuses them")


def file_problem(path: str, builder: str) -> Optional[str]:
    """Why a text corpus file (jsonl/json, txt) does not read, and what to do: UTF-16, the first line that is not
    UTF-8, or (jsonl/json) the first line that is not JSON; ``None`` when nothing is found (or for parquet). Called
    only when a file failed to read: it reads the whole file."""
    if builder not in ("json", "text"):
        return None
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return f"is UTF-16 text; ckv reads UTF-8: convert it (iconv -f UTF-16 -t UTF-8 {path} > {path}.utf8)"
    if b"\0" in data:
        return "is a binary file (it holds NUL bytes), not text; give jsonl/json, txt or parquet files"
    for number, line in enumerate(data.splitlines(), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            return (
                f"line {number} is not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1}); fix that "
                "line's encoding or remove it (ckv reads UTF-8)"
            )
    if builder == "json":
        with contextlib.suppress(ValueError):
            json.loads(data)  # one JSON document (a list of rows); else JSON lines
            return None
        for number, line in enumerate(data.splitlines(), 1):
            try:
                if line.strip():
                    json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {number} is not JSON ({e.msg}: column {e.colno}); fix or remove that line"
    return None


def _root_cause(e: BaseException) -> BaseException:
    """The innermost exception that ``e`` was raised from (datasets wraps the reader's own in its own)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def _tokenizer(path: str) -> Tokenizer:
    """The ``--tokenizer`` file, loaded; its errors name ``--tokenizer`` and the way out."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer: {path!r} is not a file; give the tokenizer.json to tokenise with")
    try:
        return load_tokenizer(path)
    except DataError as e:
        raise DataError(
            f"--tokenizer: {path!r} is not a tokenizer.json ({e.__cause__ or e}); give a tokenizer.json written by "
            "the tokenizers library (Tokenizer.save)"
        ) from None


def _differences(manifest: dict[str, Any], settings: dict[str, Any], changed: list[str]) -> str:
    """What differs between a prepared folder's manifest and this call, in words (the tokenizer by its hash)."""
    words = []
    for key in changed:
        if key == "tokenizer":
            was, now = (manifest.get(key) or {}).get("sha256", "?"), settings[key]["sha256"]
            words.append(f"tokenizer sha256 {str(was)[:12]} (now {now[:12]})")
        elif key == "inputs":
            words.append("other inputs (paths or sizes)")
        else:
            words.append(f"{key} {manifest.get(key)!r} (now {settings[key]!r})")
    return "; ".join(words)


def _input_size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def _read(files: list[str], text_field: str, id_field: str, txt_sample_by: str, cache_dir: str) -> datasets.Dataset:
    """All input documents, in input order, with the text and a stable id column."""
    import datasets  # pyarrow and pandas load only when a corpus is read (startup of every train.py / eval.py)

    parts = []
    paths = [os.path.abspath(os.path.normpath(path)) for path in files]
    root = os.path.commonpath([os.path.dirname(path) for path in paths])  # ids name files relative to it
    for path, full in zip(files, paths):
        name = os.path.basename(full)
        builder = "saved" if os.path.isdir(path) else builder_for(path, INPUT)
        try:
            if builder == "saved":
                ds = load_saved(path, INPUT)
            else:
                check_not_empty([path], INPUT)
                kwargs = {"sample_by": txt_sample_by} if builder == "text" else {}
                ds = datasets.load_dataset(builder, data_files=[path], split="train", cache_dir=cache_dir, **kwargs)
                if builder == "text":  # the text builder leaves newlines at paragraph/document ends
                    ds = ds.map(lambda row: {"text": row["text"].strip("\n")}, desc=f"strip {name}")
            if text_field not in ds.column_names:
                raise DataError(f"--text-field={text_field!r} is not a column of {path!r}; columns: {ds.column_names}")
            ds.data.column(text_field).validate(full=True)  # a row that is not UTF-8 (load_dataset lets it through)
            ds = ds.map(
                _keys,
                batched=True,
                with_indices=True,
                fn_kwargs={"name": os.path.relpath(full, root), "id_field": id_field},
                desc=f"ids of {name}",
            )
        except DataError:
            raise
        except Exception as e:  # datasets and pyarrow raise many types for unreadable files
            problem = file_problem(path, builder)
            cause = _root_cause(e)
            raise DataError(
                f"--input: {path!r} {problem}"
                if problem
                else f"--input: could not read {path!r} as {builder}: {type(cause).__name__}: {cause}"
            ) from e
        parts.append(ds.select_columns([text_field, KEY_COLUMN]))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _write_split(
    ds: datasets.Dataset, order: np.ndarray, n: np.ndarray, folder: Path, split: str, dtype: np.dtype, shard_tokens: int
) -> dict[str, Any]:
    """Write the documents ``order`` of ``ds`` (in that order) as token shards of ``shard_tokens`` tokens."""
    import pyarrow.compute as pc  # with datasets: only when a corpus is prepared

    total = int(n[order].sum())
    sizes = [min(shard_tokens, total - s) for s in range(0, total, shard_tokens)]
    shards: list[dict[str, Any]] = []
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"write {split}", file=sys.stderr, mininterval=1.0)
    k, pos = -1, 0  # current shard and its fill
    starts: list[np.ndarray] = []  # offsets in the current shard at which a document starts
    mm: Optional[np.memmap] = None

    def close() -> None:
        name = f"{split}_{k:05d}"
        assert mm is not None
        mm.flush()
        np.save(folder / f"{name}.docs.npy", np.concatenate([np.zeros(0, np.int64), *starts]))
        shards.append({"tokens": f"{name}.bin", "documents": f"{name}.docs.npy", "n_tokens": int(pos)})

    for lo in range(0, len(order), WRITE_BATCH):
        table = ds.select(order[lo : lo + WRITE_BATCH]).with_format("arrow")[:]
        flat = pc.list_flatten(table["ids"]).to_numpy().astype(dtype)  # (tokens of these documents,)
        doc_starts = np.cumsum(n[order[lo : lo + WRITE_BATCH]]) - n[order[lo : lo + WRITE_BATCH]]  # in flat
        at = 0
        while at < len(flat):
            if mm is None or pos == len(mm):
                if mm is not None:
                    close()
                k, pos, starts = k + 1, 0, []
                mm = np.memmap(folder / f"{split}_{k:05d}.bin", dtype=dtype, mode="w+", shape=(sizes[k],))
            take = min(len(mm) - pos, len(flat) - at)
            mm[pos : pos + take] = flat[at : at + take]
            inside = doc_starts[(doc_starts >= at) & (doc_starts < at + take)]
            starts.append((pos + inside - at).astype(np.int64))
            pos, at = pos + take, at + take
        bar.update(len(flat))
    if mm is not None:
        close()
    bar.close()
    return {"tokens": total, "documents": len(order), "shards": shards}


def prepare(
    inputs: list[str],
    tokenizer: str,
    out: str,
    *,
    num_proc: int = 1,
    val_fraction: float = 0.001,
    seed: int = 0,
    text_field: str = "text",
    id_field: str = "id",
    txt_sample_by: str = "paragraph",
    eod_token: str = "<|endoftext|>",
    shard_tokens: int = 1 << 30,
    strict: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenise ``inputs`` into shards under ``out`` (see the module docstring); returns the manifest. Rows whose
    text is not a non-empty string are skipped and reported in one line (``strict``: refused, ``DataError``); a
    corpus that leaves no training document is refused. ``out`` is checked first (``ConfigError``: not a folder this
    user can write, or a folder holding other files); a prepared folder whose manifest differs from these inputs,
    tokenizer and settings is replaced only with ``overwrite`` (``DataError`` naming what differs otherwise)."""
    import datasets  # pyarrow and pandas load only when a corpus is read (startup of every train.py / eval.py)
    import pyarrow.compute as pc

    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction={val_fraction} must be in [0, 1)")
    if num_proc < 1 or shard_tokens < 1 or seed < 0:
        raise ValueError(f"--num-proc={num_proc}, --shard-tokens={shard_tokens} must be >= 1 and --seed={seed} >= 0")
    out_dir = Path(out)
    check_output_dir(
        out,
        f"--out {out!r}",
        "give a new folder, or a prepared one to update: --out DIR",
        kind=("prepared folder (no manifest.json)", lambda d: (d / MANIFEST_FILE).is_file()),
    )
    files = expand_paths(inputs, INPUT)
    tok = _tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)
    settings = {
        "version": VERSION,
        "tokenizer": {
            "sha256": sha256_file(tokenizer),
            "vocab_size": vocab,
            "eod_token": eod_token,
            "eod_id": token_id(tok, eod_token, tokenizer, "--eod-token"),
        },
        "inputs": [{"path": os.path.abspath(f), "bytes": _input_size(f)} for f in files],
        "seed": seed,
        "val_fraction": val_fraction,
        "text_field": text_field,
        "id_field": id_field,
        "txt_sample_by": txt_sample_by,
        "shard_tokens": shard_tokens,
        "dtype": dtype.name,
    }
    old = out_dir / MANIFEST_FILE
    if old.is_file():
        manifest = read_json_file(old, "remove the folder, or give another --out")
        changed = [k for k in settings if manifest.get(k) != settings[k]]
        if not changed:
            print(f"{out_dir} is up to date (its manifest matches these inputs, tokenizer and settings): nothing to do")
            return manifest
        if not overwrite:
            raise DataError(
                f"--out {out!r} holds shards prepared otherwise: {_differences(manifest, settings, changed)}; give "
                "another --out, or --overwrite to replace them (runs trained on them will not resume on the new ones)"
            )

    if num_proc > 1:  # one tokenizer thread per process: the tokenizer's own thread pool would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    t0 = time.monotonic()
    work = out_dir.with_name(out_dir.name + ".work")  # datasets' caches; removed when done
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    existed = nearest_existing(out_dir.parent)  # folders made below it are removed again if this fails
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    done = False
    try:
        ds = _read(files, text_field, id_field, txt_sample_by, str(work / "datasets"))
        ds = ds.map(
            _encode,
            batched=True,
            batch_size=MAP_BATCH,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=ds.column_names,
            features=datasets.Features(
                {
                    "ids": datasets.Sequence(datasets.Value(dtype.name)),
                    "n": datasets.Value("int64"),
                    "val": datasets.Value("bool"),
                    "skip": datasets.Value("string"),
                }
            ),
            fn_kwargs={
                "tokenizer_path": tokenizer,
                "text_field": text_field,
                "eod_id": settings["tokenizer"]["eod_id"],
                "val_fraction": val_fraction,
            },
            desc="tokenise",
        )
        n = ds.data.column("n").to_numpy()  # (documents,) tokens per document, 0 for rows without text
        val = ds.data.column("val").to_numpy(zero_copy_only=False)
        t_tok = time.monotonic() - t0
        rate = n.sum() / t_tok
        print(f"tokenised {len(n):,} rows into {int(n.sum()):,} tokens in {t_tok:.1f} s ({rate:,.0f} tokens/s)")
        skip = ds.data.column("skip")
        skipped = pc.filter(skip, pc.not_equal(skip, "")).to_pylist()
        _check_skipped(skipped, len(n), int(((~val) & (n > 0)).sum()), text_field, strict)
        splits = {}
        for s, name in enumerate(SPLITS):
            docs = np.flatnonzero((val == (name == "val")) & (n > 0))
            order = docs[np.random.default_rng([seed, s]).permutation(len(docs))]
            splits[name] = _write_split(ds, order, n, tmp, name, dtype, shard_tokens)
        shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        manifest = {**settings, "splits": splits, "skipped_rows": int((n == 0).sum())}
        write_text_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2))
        replace_dir(tmp, out_dir)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        if not done:
            remove_empty_folders(out_dir.parent, existed)
    dt = time.monotonic() - t0
    total = splits["train"]["tokens"] + splits["val"]["tokens"]
    print(
        f"wrote {out_dir}: {splits['train']['tokens']:,} train and {splits['val']['tokens']:,} val tokens "
        f"({splits['train']['documents']:,} + {splits['val']['documents']:,} documents) in {dt:.1f} s "
        f"({total / dt:,.0f} tokens/s)"
    )
    return manifest


def main(argv: Optional[list[str]] = None) -> None:
    """The command line (``python -m ckv.data.prepare --help``)."""
    p = argparse.ArgumentParser(prog="python -m ckv.data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="jsonl/json, parquet, txt (globs), datasets folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json")
    p.add_argument("--out", required=True, help="output folder (data.shards.path)")
    p.add_argument("--num-proc", type=int, default=1, help="tokeniser processes")
    p.add_argument("--val-fraction", type=float, default=0.001, help="share of documents held out (by id hash)")
    p.add_argument("--seed", type=int, default=0, help="document shuffle seed")
    p.add_argument("--text-field", default="text")
    p.add_argument("--id-field", default="id", help="column holding a stable document id (else file:row)")
    p.add_argument("--txt-sample-by", default="paragraph", choices=("line", "paragraph", "document"))
    p.add_argument("--eod-token", default="<|endoftext|>")
    p.add_argument("--shard-tokens", type=int, default=1 << 30, help="tokens per shard file")
    p.add_argument("--strict", action="store_true", help="refuse rows without text (null, empty, not a string)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a prepared --out made with another tokenizer, other inputs or settings (refused without it)",
    )
    a = p.parse_args(argv)
    try:
        prepare(
            a.input,
            a.tokenizer,
            a.out,
            num_proc=a.num_proc,
            val_fraction=a.val_fraction,
            seed=a.seed,
            text_field=a.text_field,
            id_field=a.id_field,
            txt_sample_by=a.txt_sample_by,
            eod_token=a.eod_token,
            shard_tokens=a.shard_tokens,
            strict=a.strict,
            overwrite=a.overwrite,
        )
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        p.exit(2, error_message(str(e)) + "\n")


if __name__ == "__main__":
    main()
