"""One writer per run folder (``ckv.io.lock``): a live holder refuses a second writer, naming it; the lock file of a
process that died is taken over, saying whose it was."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckv.io.lock import LOCK_FILE, RunLock, RunLockedError

HOLD = (
    "import sys\nfrom ckv.io.lock import RunLock\nwith RunLock(sys.argv[1]):\n    print('locked', flush=True)\n"
    "    sys.stdin.read()"
)  # holds the lock until its stdin closes, then releases it
DIE_HOLDING = (
    "import os, sys; from ckv.io.lock import RunLock; RunLock(sys.argv[1]).acquire(); print(os.getpid()); "
    "os._exit(0)"
)  # dies holding the lock: the kernel drops the flock, the holder record stays


def test_a_second_process_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            RunLockedError,
            match=rf"is being trained by another process \(pid {holder.pid} on host "
            rf"{socket.gethostname()}",
        ):
            RunLock(tmp_path).acquire()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with RunLock(tmp_path) as lock:  # released on exit: free again, and not stale
        assert lock.stale is None
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_the_lock_file_of_a_dead_process_is_taken_over_and_named(tmp_path: Path) -> None:
    pid = subprocess.run(
        [sys.executable, "-c", DIE_HOLDING, str(tmp_path)], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert f'"pid": {pid}' in (tmp_path / LOCK_FILE).read_text()
    with RunLock(tmp_path) as lock:
        assert lock.stale is not None and f"stale lock of a process that is gone: pid {pid} on host" in lock.stale
