"""The run folder: resolved config, provenance (git SHA, package versions) and the resume compatibility check."""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import yaml

from ckv.io.atomic import write_text_atomic
from ckv.io.layout import CONFIG_FILE, RUN_INFO_FILE, list_checkpoints, read_run_config
from ckv.train.config import TrainConfig, resume_conflicts, upgrade_run_config

PACKAGES = (
    "ckv",
    "torch",
    "deepspeed",
    "numpy",
    "safetensors",
    "hydra-core",
    "omegaconf",
    "datasets",
    "tokenizers",
    "wandb",
    "triton",
    "transformers",
)


class ResumeError(RuntimeError):
    """The run folder holds a checkpoint of a run whose config is incompatible with the current one."""


def plain(obj: Any) -> Any:
    """Tuples to lists, recursively (YAML/JSON-safe)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def git_info(path: Path) -> dict[str, Any]:
    """Commit SHA and dirty flag of the git checkout holding ``path`` (``None``s outside a checkout)."""

    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if sha else None
    return {"git_sha": sha, "git_dirty": None if status is None else bool(status)}


def package_versions() -> dict[str, Optional[str]]:
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Where, when and with what code a run (or a resumption of it) started."""
    return {
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        **git_info(Path(__file__).resolve().parent),
        "packages": package_versions(),
        **(extra or {}),
    }


def check_resumable(cfg: TrainConfig) -> None:
    """Refuse to resume a run folder whose checkpoints come from an incompatible config (every rank calls this
    before any collective, so that all of them fail alike)."""
    run_dir = Path(cfg.run_dir)
    if not (run_dir / CONFIG_FILE).is_file() or not list_checkpoints(run_dir):
        return
    conflicts = resume_conflicts(upgrade_run_config(read_run_config(run_dir)), plain(cfg.to_dict()))
    if conflicts:
        raise ResumeError(
            f"cannot resume {run_dir}: its checkpoints were trained with a different config "
            f"(saved -> current):\n  "
            + "\n  ".join(conflicts)
            + "\nrestore these values, or train into a new run folder (another name, seed or out_dir)"
        )


def write_run_files(cfg: TrainConfig, info: dict[str, Any]) -> None:
    """Rank 0: write the resolved ``config.yaml`` and add one provenance line to ``run_info.jsonl`` (both
    atomically: the file is rewritten with the new line)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / CONFIG_FILE, yaml.safe_dump(plain(cfg.to_dict()), sort_keys=False))
    info_file = run_dir / RUN_INFO_FILE
    before = info_file.read_text() if info_file.is_file() else ""
    write_text_atomic(info_file, before + json.dumps(plain(info)) + "\n")
