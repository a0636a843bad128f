"""DeepSpeed with two CPU processes (gloo): ZeRO-1/2/3 runs save, resume and match one process."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckv.train import latest_checkpoint, list_checkpoints, train

from .helpers import child_env, losses, worker_command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_two_processes_save_resume_and_match_one(make_config, stage: int) -> None:
    sections = dict(trainer={"max_steps": 6, "save_every": 2}, deepspeed={"zero_optimization": {"stage": stage}})
    two = make_config("two", **sections)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        *worker_command("stop-and-resume", two)[1:],
    ]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed at step 3" in proc.stderr

    ckpt = latest_checkpoint(two.run_dir)
    assert ckpt.name == "step_00000006" and [s for s, _ in list_checkpoints(two.run_dir)] == [4, 6]
    assert {"rank_00000.pt", "rank_00001.pt"} <= {p.name for p in ckpt.iterdir()}
    assert len(list((ckpt / "engine").glob("zero_pp_rank_*_optim_states.pt"))) == 2  # optimizer states sharded

    one = make_config("one", **sections)  # 1 rank x 2 accumulation steps = 2 ranks x 1: the same sequences
    train(one)
    assert losses(two.run_dir) == pytest.approx(losses(one.run_dir), rel=1e-5)
    w1 = load_file(str(Path(one.run_dir) / "model" / "model.safetensors"))
    w2 = load_file(str(Path(two.run_dir) / "model" / "model.safetensors"))
    assert all(torch.allclose(w1[k], w2[k], atol=1e-4) for k in w1)  # Adam amplifies rounding a little
