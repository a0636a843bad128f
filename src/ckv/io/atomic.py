"""Atomic, durable writes: the one implementation every stage uses.

A reader sees the old content or the new one, never a partial file: data goes to a temp sibling, is flushed and
fsync'ed, renamed over the target, and the parent folder is fsync'ed so the rename survives a power cut."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Union

PathLike = Union[str, os.PathLike]


def fsync_dir(path: PathLike) -> None:
    """Make renames inside ``path`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: PathLike) -> None:
    """Flush a written file to disk."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: PathLike) -> None:
    """Flush every file under ``path`` and the folders holding them (before a folder is renamed into place)."""
    for folder, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


@contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temp path to write ``path``'s new content to (by any writer: safetensors, csv, torch.save); on a
    clean exit it is fsync'ed and renamed over ``path``; on an error it is removed and ``path`` is untouched."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")  # per process: ranks may race to write it
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def write_text_atomic(path: PathLike, text: str) -> Path:
    """Write a text file atomically and durably. Returns its path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def replace_dir(tmp: PathLike, out: PathLike) -> None:
    """Move a finished folder into place; an older folder at ``out`` is removed only after that."""
    tmp, out = Path(tmp), Path(out)
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
