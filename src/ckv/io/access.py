"""What this user may do with the folders ckv writes and the files it reads, checked before any work.

``check_output_dir`` is the one check every entry point (``train.py``, ``eval.py``, ``python -m ckv.data.prepare``,
the studies, ``python -m ckv.train.export``) makes of the folder it will write, before a model is loaded or trained:
the folder exists or can be made, is a folder, this user can write to it, and (for commands that replace a whole
folder) holds nothing but what that command writes. It leaves no folder behind (``remove_empty_folders``, which a
refused or failed command also calls on what it made). ``user_name`` names this user in the messages (here and in
``ckv.io.layout.check_readable``, for a file this user may not read).
"""

from __future__ import annotations

import os
import pwd
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Union

from ckv.checks import ConfigError

PathLike = Union[str, os.PathLike]
PROBE_PREFIX = ".ckv_write_check_"


def user_name() -> str:
    """The name of the user this process acts as (its effective uid), or ``uid <n>`` when it has none."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def nearest_existing(path: PathLike) -> Path:
    """``path`` or its nearest ancestor that exists (a folder, or the file that blocks the way), relative when
    ``path`` is; ``PermissionError`` when an ancestor can not be searched by this user."""
    path = Path(path)
    while True:
        try:
            os.stat(path)
            return path
        except (FileNotFoundError, NotADirectoryError):
            if path.parent == path:
                return path
            path = path.parent


def check_output_dir(
    path: PathLike, what: str, way_out: str, kind: Optional[tuple[str, Callable[[Path], bool]]] = None
) -> Path:
    """Check that the folder ``path`` can take what a command writes, before the command does any work, and return
    it (absolute). ``ConfigError``, one line ``<what> <problem>; <way_out>``, when it is empty text, a file, below a
    file, not writable by this user, can not be made or written (a read-only or virtual filesystem: a probe file is
    made and removed), or, with ``kind`` (a name and a test, e.g. ``("prepared folder", is_prepared)``), an existing
    folder that holds files but is not of that kind. Folders made for the probe are removed again."""
    text = os.fspath(path)

    def refuse(problem: str) -> ConfigError:
        return ConfigError(f"{what} {problem}; {way_out}")

    if not text.strip():
        raise refuse("is empty: it names no folder")
    target = Path(text)
    try:
        existing = nearest_existing(target)
    except PermissionError as e:
        raise refuse(f"can not be reached by user {user_name()} (Permission denied: {e.filename!r})") from None
    if not existing.is_dir():
        raise refuse(
            "is a file, not a folder" if existing == target else f"is below {str(existing)!r}, a file, not a folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise refuse(f"is not writable by user {user_name()} (Permission denied: {str(existing)!r})")
    if kind is not None and existing == target:
        name, is_kind = kind
        try:
            entries = sorted(p.name for p in target.iterdir())
        except OSError as e:
            raise refuse(f"can not be listed by user {user_name()} ({e.strerror})") from None
        if entries and not is_kind(target):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise refuse(f"holds other files ({shown}) and is not a {name}")
    try:
        target.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=target)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise refuse(f"can not be written ({e.strerror}: {e.filename or str(target)!r})") from None
    finally:
        remove_empty_folders(target, existing)
    return target.absolute()


def remove_empty_folders(folder: PathLike, stop: PathLike) -> None:
    """Remove ``folder`` and then each parent below ``stop`` (kept) while it is empty: the folders a refused or
    failed command made; a folder that holds anything is kept."""
    stop = Path(stop).resolve()
    for d in (Path(folder).resolve(), *Path(folder).resolve().parents):
        try:
            if d == stop or not d.is_relative_to(stop) or not d.is_dir() or any(d.iterdir()):
                return
            d.rmdir()
        except OSError:  # not ours to remove (another user's folder)
            return
