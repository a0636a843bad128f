"""Helpers for the training tests: small configs, composed experiments, metrics, host-sync counts, and a clean
environment for child processes."""

from __future__ import annotations

import collections
import copy
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ckv.train import TrainConfig, read_metrics, train
from ckv.train import loop as loop_module

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
USER_DATA = ["data.shards.path=/data/shards/pretrain"]  # a folder written by python -m ckv.data.prepare


def base_config(run_dir: Path, cache_dir: Path | str) -> dict[str, Any]:
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


def compose_config(overrides: list[str], hydra_node: bool = False) -> Any:
    """``python train.py <overrides>``'s composed config (with the ``hydra`` node when ``hydra_node``)."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="train"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_node)


def train_config(overrides: list[str]) -> TrainConfig:
    """The validated ``TrainConfig`` of ``python train.py <overrides>`` (a value left ``???`` is an error)."""
    return TrainConfig.from_dict(
        OmegaConf.to_container(compose_config(overrides), resolve=True, throw_on_missing=True), run_dir="unused"
    )


def sweep(experiment: str) -> dict[str, list[str]]:
    """The sweep an experiment declares (``hydra.sweeper.params``): each swept key and its values, as strings."""
    params = compose_config([f"experiment={experiment}"], hydra_node=True).hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return {o.key_or_group: [str(v) for v in o.sweep_string_iterator()] for o in parsed}


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


# what reads a tensor's value into Python (a device-to-host sync when the tensor lives on an accelerator)
SYNC_METHODS = ("item", "__bool__", "tolist", "__int__", "__float__", "__index__", "cpu", "numpy")
# AdamW keeps each parameter's step count as a host (CPU) tensor also on a GPU and reads it with .item(): no sync
HOST_ONLY_CALLERS = ("torch/optim/",)


def syncs_per_step(monkeypatch: pytest.MonkeyPatch, cfg: TrainConfig) -> list[collections.Counter]:
    """Train ``cfg`` counting value reads between consecutive ``train_step`` entries: element i covers step i's
    loop iteration (the log/validation/stop work after step i, then nothing else) minus the host-only reads above."""
    current: collections.Counter = collections.Counter()
    per_step: list[collections.Counter] = []

    def counting(name: str):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0].filename
            if not any(part in caller for part in HOST_ONLY_CALLERS):
                current[name] += 1
            return real(self, *args, **kwargs)

        return read

    real_step = loop_module._Loop.train_step

    def train_step(self):
        per_step.append(collections.Counter(current))
        current.clear()
        return real_step(self)

    monkeypatch.setattr(loop_module._Loop, "train_step", train_step)
    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    train(cfg)
    monkeypatch.undo()
    return per_step[1:]  # per_step[0] is the setup before step 1
