"""Helpers for the training tests: small configs, metrics, and a clean environment for child processes."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

from ckv.train import TrainConfig, read_metrics

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).with_name("workers.py")

# split fused records at 64 tokens: a task a tiny model makes progress on within a few dozen steps
LOOKUP_DATA = {
    "kind": "lookup",
    "seq_len": 64,
    "lookup": {
        "record": "split",
        "n_keys": 16,
        "n_values": 16,
        "key_base": 4,
        "n_records": 16,
        "n_queries": 8,
        "prefix_pad": [0, 7],
    },
}
MERGED_SECTIONS = ("model", "optim", "trainer", "wandb")  # make_config updates these; other sections are replaced
TEXT_DATA = {"kind": "text", "seq_len": 64, "text": {"vocab_size": 1024}}  # the tokenizer cpu_smoke uses too


def base_config(run_dir: Path, cache_dir: Path) -> dict[str, Any]:
    return {
        "name": "test",
        "seed": 0,
        "run_dir": str(run_dir),
        "model": {"preset": "tiny"},
        "attention": {"kind": "full"},
        "data": copy.deepcopy(LOOKUP_DATA),
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "trainer": {
            "max_steps": 8,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "log_every": 1,
            "val_every": 0,
            "device": "cpu",
            "progress": False,
            "data_cache_dir": str(cache_dir),
        },
        "deepspeed": {"zero_optimization": {"stage": 0}},
        "wandb": {"enabled": False},
    }


def losses(run_dir: Path | str) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(run_dir)) if "loss" in r]


def child_env() -> dict[str, str]:
    """This environment without the rank variables an in-process run may have set (a child must not join the
    test process's process group)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def worker_command(mode: str, cfg: TrainConfig) -> list[str]:
    """``python tests/train/workers.py MODE CONFIG_JSON`` (see workers.py)."""
    return [sys.executable, str(WORKERS), mode, json.dumps(cfg.to_dict())]
