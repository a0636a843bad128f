"""Train a ckv model: ``python train.py [experiment=NAME] [group=option ...] [key=value ...]``.

One CPU:     python train.py experiment=cpu_smoke
GPUs:        deepspeed --no_local_rank train.py ...   or   torchrun --nproc_per_node 8 train.py ...
A grid:      python train.py -m experiment=cpu_grid     (add hydra/launcher=slurm on a cluster)
See docs/training.md. This file only turns the Hydra config into a ``TrainConfig`` and calls ``ckv.train.train``.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckv.train.distributed import strip_local_rank_arg

sys.argv = strip_local_rank_arg(sys.argv)  # the deepspeed launcher's --local_rank, which Hydra would reject

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import MissingMandatoryValue  # noqa: E402

from ckv.apps.cli import run_hydra_main  # noqa: E402
from ckv.checks import error_message  # noqa: E402
from ckv.config import ConfigError  # noqa: E402
from ckv.data import DataError  # noqa: E402
from ckv.io.access import check_output_dir, remove_empty_folders  # noqa: E402
from ckv.io.lock import remove_unused_lock  # noqa: E402
from ckv.train import (  # noqa: E402
    CheckpointError,
    DivergenceError,
    ResumeError,
    RunLockedError,
    TrainConfig,
    TrainingInterrupted,
    train,
)
from ckv.train.config import trajectory_neutral  # noqa: E402

USER_ERRORS = (
    ConfigError,
    DataError,
    ResumeError,
    CheckpointError,
    DivergenceError,
    RunLockedError,
    FileNotFoundError,
    ImportError,
)
EXIT_USER_ERROR = 1  # sys.exit(message)'s code
MAX_DIR_NAME = 200
# Keys that place the run folder rather than name it: ${out_dir}/${name}/ holds it (experiment sets name) and the
# seed is appended to every folder name.
PLACEMENT_KEYS = ("experiment", "out_dir", "seed")


def override_dirname(overrides: Sequence[str]) -> str:
    """The command-line overrides that change what is trained, sorted and joined by ``,`` (Hydra's
    ``override_dirname`` rule); ``PLACEMENT_KEYS`` and the keys of ``RESUMABLE_CHANGES`` are left out."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return ",".join(
        sorted(
            o.input_line
            for o in parsed
            if o.key_or_group not in PLACEMENT_KEYS and not trajectory_neutral(o.key_or_group)
        )
    )


def job_dir_name(overrides: Sequence[str], seed: int) -> str:
    """A job's folder name: its trajectory-changing command-line overrides plus its seed
    (``attention.stride=4,seed=0``); path separators are replaced, and an over-long name is shortened with a
    hash of the full one."""
    name = ",".join(p for p in (override_dirname(overrides), f"seed={seed}") if p).replace("/", "_")
    if len(name) > MAX_DIR_NAME:
        name = f"{name[: MAX_DIR_NAME - 17]}-{hashlib.sha1(name.encode()).hexdigest()[:16]}"
    return name


OmegaConf.register_new_resolver("ckv_job_dir", job_dir_name, replace=True)


def usable_out_dir(out_dir: str) -> str:
    """``out_dir``, checked before Hydra makes the run folder in it (``ckv.io.access.check_output_dir``): a path
    that can not be a folder this user writes to (empty, a file, below a file, not writable, under /proc) is a
    ConfigError naming it."""
    check_output_dir(out_dir, f"out_dir={out_dir!r}", "give a folder you can write to: out_dir=...")
    return out_dir


OmegaConf.register_new_resolver("ckv_out_dir", usable_out_dir, replace=True)


def check_kv_heads(overrides: Sequence[str], attention: Mapping[str, Any], option: str) -> None:
    """One count of KV heads: ``attention.kv_heads`` when the attention option sets it (every compressed option
    and ``full_kv*`` do), else ``model.n_kv_heads``. A ``model.n_kv_heads`` on the command line that the attention
    option's count overrides is a ConfigError naming both keys (it would be ignored while it names the run
    folder)."""
    kv_heads = attention.get("kv_heads")
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if o.key_or_group == "model.n_kv_heads" and kv_heads is not None and o.value() != kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={o.value()} conflicts with attention.kv_heads={kv_heads} (set by "
                f"attention={option}), which decides the KV head count when set: use attention.kv_heads={o.value()}"
                " instead (it must divide model.n_heads)"
            )


def plain_config(cfg: DictConfig) -> dict:
    """The composed config as plain values; a key left ``???`` is a ConfigError naming it."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        raise ConfigError(
            f"{e.full_key} is not set (it is marked ??? in the config): add {e.full_key}=... on the command line"
        ) from None


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    info = {"overrides": list(hydra_cfg.overrides.task), "choices": dict(hydra_cfg.runtime.choices)}
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        plain = plain_config(cfg)
        check_kv_heads(info["overrides"], plain["attention"], info["choices"].get("attention"))
        check_output_dir(  # Hydra made it; a run to resume may be another user's
            run_dir, f"the run folder {str(run_dir)!r}", "train into a folder you can write to: out_dir=... or name=..."
        )
        train(TrainConfig.from_dict(plain, run_dir=str(run_dir)), info)
    except TrainingInterrupted as e:
        print(f"ckv: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except USER_ERRORS as e:  # reported in here: Hydra adds a line of its own to an exception that leaves the job
        remove_unused_lock(run_dir)  # a run refused before it wrote anything leaves no folder
        remove_empty_folders(run_dir, Path(cfg.out_dir))
        sys.exit(error_message(str(e)))


if __name__ == "__main__":
    run_hydra_main(main, (), EXIT_USER_ERROR)
