"""One writer per run folder: an exclusive ``flock`` on ``<run_dir>/train.lock``, held while training runs.

The lock file records its holder (pid, host, start time). The kernel releases a ``flock`` when its process dies,
so a lock file left by a killed run is not a lock: the next run takes it over and says whose it was. A live
holder makes the next writer fail at once with ``RunLockedError`` naming it. Rank 0 of a job holds the lock for
the whole job (its ranks share the folder); ``flock`` needs a filesystem that supports it (local disks, Lustre
and NFSv4 do; some NFSv3 mounts do not).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional, Union

from ckv.io.layout import LOCK_FILE

PathLike = Union[str, os.PathLike]


class RunLockedError(RuntimeError):
    """Another process is training into the same run folder."""


def _holder_text(info: dict[str, Any]) -> str:
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {info.get('since', '?')})"


def _read_holder(path: Path) -> Optional[dict[str, Any]]:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


class RunLock:
    """The exclusive lock of one run folder. ``acquire()`` takes it or raises ``RunLockedError``; ``release()``
    (also on exit of a ``with`` block) gives it back. ``stale`` describes a dead holder that was taken over."""

    def __init__(self, run_dir: PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.stale: Optional[str] = None
        self._fd: Optional[int] = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for every run file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read_holder(self.path)
            raise RunLockedError(
                f"{self.path.parent} is being trained by another process "
                f"({_holder_text(holder) if holder else 'holder unknown'}); wait for it to finish, stop it, or "
                "train into another run folder"
            ) from None
        previous = _read_holder(self.path)
        if previous and previous.get("pid") != os.getpid():
            self.stale = f"took over the stale lock of a process that is gone: {_holder_text(previous)}"
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode() + b"\n", 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back; the file stays (an empty holder record), so its inode is never swapped under a
        waiting process."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def remove_unused_lock(run_dir: PathLike) -> None:
    """Remove ``run_dir``'s lock file when the folder holds nothing else and no process holds the lock: a run refused
    before it wrote anything leaves no folder (its caller then removes the empty folder). It is removed while held,
    so no other process can take it in between."""
    path = Path(run_dir) / LOCK_FILE
    try:
        alone = path.is_file() and all(p.name == LOCK_FILE for p in path.parent.iterdir())
        lock = RunLock(run_dir).acquire() if alone else None
    except (OSError, RunLockedError):
        return
    if lock is not None:
        try:
            path.unlink()
        finally:
            lock.release()
