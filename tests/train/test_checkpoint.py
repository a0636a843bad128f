"""Checkpoint folders: atomic writes, the ``latest`` pointer, pruning, and a process killed in mid-save."""

from __future__ import annotations

import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ckv.config import ModelConfig
from ckv.io.weights import load_weights
from ckv.model import Transformer
from ckv.train import latest_checkpoint, list_checkpoints, train
from ckv.train.checkpoint import CheckpointManager
from ckv.train.distributed import DistEnv
from ckv.train.export import export_checkpoint

from .helpers import child_env, losses, worker_command


class StubEngine:
    """The two engine operations a checkpoint uses, without DeepSpeed."""

    def __init__(self) -> None:
        self.model = Transformer(ModelConfig.from_preset("tiny"))

    def save(self, directory: Path) -> None:
        (directory / "engine").mkdir()
        torch.save(self.model.state_dict(), directory / "engine" / "state.pt")

    @contextmanager
    def full_module(self):
        yield self.model


def test_keep_last_and_keep_every(tmp_path):
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    manager = CheckpointManager(tmp_path, env, keep_last=2, keep_every=4)
    engine = StubEngine()
    for step in range(1, 10):
        manager.save(engine, step, {"tokens": step}, {"data": {}})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 8, 9]
    assert latest_checkpoint(tmp_path).name == "step_00000009"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000009"
    assert manager.save(engine, 9, {}, {}) == latest_checkpoint(tmp_path)  # a step is written once
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    out = export_checkpoint(tmp_path, "step_00000004")
    assert out == tmp_path / "model" and load_weights(out).config.to_dict() == engine.model.config.to_dict()


def test_kill_during_save_keeps_previous_checkpoint(make_config):
    """A process SIGKILLed while writing checkpoint 4 leaves checkpoint 2 as latest and loadable; the run then
    resumes from it and reproduces an uninterrupted run exactly."""
    cfg = make_config("killed", trainer={"max_steps": 6, "save_every": 2})
    proc = subprocess.Popen(
        worker_command("hang-in-save", cfg),
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    marker = Path(cfg.run_dir) / "HANGING"
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "child never reached the save"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    root = Path(cfg.run_dir) / "checkpoints"
    assert (root / ".tmp_step_00000004" / "engine").is_dir()  # the half-written checkpoint
    assert latest_checkpoint(cfg.run_dir) == root / "step_00000002"
    assert load_weights(root / "step_00000002" / "weights").config.n_layers == 2

    train(cfg)
    assert not (root / ".tmp_step_00000004").exists()
    straight = make_config("straight", trainer={"max_steps": 6})
    train(straight)
    assert losses(cfg.run_dir) == losses(straight.run_dir)
