"""Atomic, durable writes: the one implementation every stage uses.

A reader sees the old content or the new one, never a partial file: data goes to a temp sibling, is flushed and
fsync'ed, renamed over the target, and the parent folder is fsync'ed so the rename survives a power cut. Every file
gets the mode the user's umask gives a plain ``open`` (``umask_mode``), whatever its writer chose: safetensors, for
one, creates its files with mode 0600, which would hide a run's weights from the colleagues who read its other
files."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Union

PathLike = Union[str, os.PathLike]


def umask() -> int:
    """This process' umask, read without changing it (``/proc/self/status``; elsewhere set and restored at once)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(path: PathLike) -> None:
    """Give the file ``path`` the mode a plain ``open`` gives a new file: ``0o666 & ~umask``."""
    os.chmod(path, 0o666 & ~umask())


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
    clean exit it gets the umask's mode (``umask_mode``), is fsync'ed and renamed over ``path``; on an error it is
    removed and ``path`` is untouched."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")  # per process: ranks may race to write it
    try:
        yield tmp
        umask_mode(tmp)
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
