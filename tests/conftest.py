"""Test environment: CPU only, Triton interpreter, offline, headless plots, few threads; what xdist workers share."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Must be set before triton or ckv_kernels is imported (read when @triton.jit runs).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Under pytest-xdist (`make test`: one worker per core) each worker, and every process it starts, keeps to one
# thread, so the workers do not oversubscribe the cores; a plain `pytest` keeps two. The few places that take more
# threads in a worker (the analysis fixture trains on two) then share the cores with the other workers: OpenMP
# threads that sleep instead of spinning at barriers make that 4x faster on 2 cores (read when torch loads OpenMP).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402

torch.set_num_threads(1 if XDIST_WORKER else min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@dataclass(frozen=True)
class SmokeRun:
    """What ``python train.py experiment=cpu_smoke out_dir=<out_dir>`` left: its exit status and its output."""

    out_dir: Path
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], object]], Path]:
    """``shared_folder(name, build)``: ``build(folder)`` once per test session, xdist workers included. The first
    worker builds the folder under the session's temporary root while the others wait on its lock; a build that
    failed is redone from scratch by the next one that asks."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if XDIST_WORKER else root  # the workers' own folders sit side by side in the session's

    def get(name: str, build: Callable[[Path], object]) -> Path:
        folder, done = root / name, root / f"{name}.done"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                build(folder)
                done.touch()
        return folder

    return get


@pytest.fixture(scope="session")
def cache_dir(shared_folder: Callable[[str, Callable[[Path], object]], Path]) -> str:
    """One data cache (tokenizers, token arrays) for the whole session and all its workers, as the ``cache_dir`` of
    ``ckv.data`` and a run's ``trainer.data_cache_dir`` take it: each small BPE is trained once (``train_bpe`` lets
    one process train while the others wait)."""
    return str(shared_folder("ckv_cache", lambda folder: folder.mkdir(parents=True)))


@pytest.fixture(scope="session")
def cpu_smoke_run(shared_folder: Callable[[str, Callable[[Path], object]], Path], cache_dir: str) -> SmokeRun:
    """CI's end-to-end run, once per session: ``python train.py experiment=cpu_smoke`` (shipped corpus, compressed
    W4/S4, wandb offline) into a fresh ``out_dir``; the tests check it and evaluate what it wrote."""
    from tests.train.helpers import REPO, child_env

    def build(folder: Path) -> None:
        out = folder / "out"
        args = [sys.executable, "train.py", "experiment=cpu_smoke", f"out_dir={out}"]
        args += [f"trainer.data_cache_dir={cache_dir}", "wandb.mode=offline"]
        proc = subprocess.run(args, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
        out.mkdir(parents=True, exist_ok=True)
        (folder / "proc.json").write_text(json.dumps([proc.returncode, proc.stdout, proc.stderr]))

    folder = shared_folder("cpu_smoke", build)
    returncode, stdout, stderr = json.loads((folder / "proc.json").read_text())
    return SmokeRun(folder / "out", returncode, stdout, stderr)
