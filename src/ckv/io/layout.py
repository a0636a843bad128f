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

Training writes run folders, evaluation and the analyses read them, both through this module; ``read_text``,
``read_json_file`` and ``read_run_config`` read a run's files with one-line errors that name the file, the cause
(damaged, or not readable by this user) and the way out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from ckv.io.access import user_name

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


RUN_CONFIG_FIX = (
    "restore it from a copy (train.py wrote it when the run started), or train into a new run folder (another name, "
    "seed or out_dir)"
)


def damaged(path: PathLike, problem: str, fix: str = "") -> CheckpointError:
    """The one-line error for a damaged file: ``<path> is damaged: <problem>[; <fix>]``."""
    return CheckpointError(f"{os.fspath(path)} is damaged: {problem}" + (f"; {fix}" if fix else ""))


def check_readable(path: PathLike) -> None:
    """``CheckpointError`` naming ``path`` when it exists but this user may not read it (``FileNotFoundError`` when
    it does not exist; safetensors reports both as "No such file or directory")."""
    try:
        open(path, "rb").close()  # opening is the check
    except PermissionError:
        raise CheckpointError(
            f"{os.fspath(path)} exists but user {user_name()} may not read it (Permission denied); ask its owner "
            "for read access (chmod a+r), or work on a copy you can read"
        ) from None


def read_text(path: PathLike, fix: str = "") -> str:
    """The UTF-8 text of the file ``path``; ``CheckpointError`` naming it when this user may not read it
    (``check_readable``) or it is not UTF-8 text (``fix``: what to do about a damaged file)."""
    check_readable(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise damaged(path, f"not UTF-8 text (byte {e.start})", fix) from None


def read_json_file(path: PathLike, fix: str = "") -> Any:
    """The JSON value of the file ``path``; ``CheckpointError`` naming it, where the JSON breaks and ``fix`` for a
    damaged file (``read_text`` for an unreadable one)."""
    text = read_text(path, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise damaged(path, f"not JSON ({e.msg}: line {e.lineno} column {e.colno})", fix) from None


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


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in a few words: what is wrong and where (``expected ',' or ']' at line 3 column 1``)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


def read_run_config(run_dir: PathLike) -> dict[str, Any]:
    """The resolved training config a run saved (``config.yaml``) as a plain dict; ``CheckpointError``, one line
    naming the file, where it breaks and what to do, when it is damaged or not readable by this user."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {run_dir}: not a ckv run folder")
    text = read_text(path, RUN_CONFIG_FIX)
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise damaged(path, f"not YAML ({yaml_problem(e)})", RUN_CONFIG_FIX) from None
    if not isinstance(cfg, dict):
        raise damaged(path, f"it holds a {type(cfg).__name__}, not a config mapping", RUN_CONFIG_FIX)
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
