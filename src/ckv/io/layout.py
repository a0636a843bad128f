"""The run-folder contract: every file and folder name of a run, what makes a folder a run, its checkpoints.

    <run_dir>/
        config.yaml          resolved training config (CONFIG_FILE)
        run_info.jsonl       provenance: git SHA, package versions (RUN_INFO_FILE)
        metrics.jsonl        one row per log step (METRICS_FILE)
        train.lock           held by the process training into the folder (LOCK_FILE; ``ckv.io.lock``)
        checkpoints/         step_XXXXXXXX/ {engine/, rank_XXXXX.pt, weights/, trainer_state.json}, latest;
                             damaged_step_XXXXXXXX/: a damaged checkpoint set aside by a fallback resume
        model/               the final consolidated weights (MODEL_DIR; ``ckv.io.weights`` format)
        eval/<task>/         results.json, results.csv, plots (written by evaluation; ``eval_dir``)
            <analysis>/      <analysis>.json and its plots (``eval.py analysis=<analysis>``; ``analysis_file``)

Training writes run folders, evaluation and the analyses read them, both through this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import yaml

CONFIG_FILE = "config.yaml"
RUN_INFO_FILE = "run_info.jsonl"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"
EVAL_DIR = "eval"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
WEIGHTS_DIR = "weights"
TOKENIZER_FILE = "tokenizer.json"
LOCK_FILE = "train.lock"
STEP_PREFIX, TMP_PREFIX, TRASH_PREFIX, DAMAGED_PREFIX = "step_", ".tmp_", ".trash_", "damaged_"

PathLike = Union[str, Path]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the current run."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def eval_dir(run_dir: PathLike, task: str) -> Path:
    """Where evaluation writes a run's results on ``task``: ``<run_dir>/eval/<task>``."""
    return Path(run_dir) / EVAL_DIR / task


def analysis_file(task_dir: PathLike, analysis: str) -> Path:
    """The results file of ``analysis`` run on a task whose output folder is ``task_dir`` (``eval_dir`` for a run's
    own): ``<task_dir>/<analysis>/<analysis>.json``."""
    return Path(task_dir) / analysis / f"{analysis}.json"


def is_run_dir(path: PathLike) -> bool:
    """A run folder: it holds the resolved ``config.yaml`` and final weights or a checkpoints folder."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and ((p / MODEL_DIR).is_dir() or (p / CHECKPOINTS_DIR).is_dir())


def read_run_config(run_dir: PathLike) -> dict[str, Any]:
    """The resolved training config a run saved (``config.yaml``) as a plain dict."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {run_dir}: not a ckv run folder")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path} is not readable YAML: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} does not hold a config mapping (got {type(cfg).__name__})")
    return cfg


def list_checkpoints(run_dir: PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as ``(step, folder)``, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        digits = p.name[len(STEP_PREFIX) :]
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and digits.isdigit() and (p / STATE_FILE).is_file():
            found.append((int(digits), p))
    return sorted(found)


def latest_checkpoint(run_dir: PathLike) -> Optional[Path]:
    """The folder ``latest`` names (falling back to the newest complete folder), or ``None`` for a fresh run."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    pointer = root / LATEST_FILE
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"{pointer} names {path.name}, which is not a complete checkpoint")
        return path
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None
