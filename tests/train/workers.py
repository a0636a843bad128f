"""Child processes of the training tests: ``python tests/train/workers.py MODE CONFIG_JSON``.

- ``hang-in-save``: train, and hang (after writing ``<run_dir>/HANGING``) in the middle of writing the second
  checkpoint, after the engine state is on disk; the test kills the process there.
- ``stop-and-resume``: train to half of ``max_steps`` (a checkpoint), then resume from the run folder to the end
  with a new engine; run under ``torchrun`` for the multi-process tests.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import ckv.train.checkpoint as checkpoint
from ckv.train import TrainConfig, train


def hang_in_save(cfg: TrainConfig) -> None:
    saves = []
    real_save_weights = checkpoint.save_weights

    def save_weights(model, directory):
        saves.append(directory)
        if len(saves) == 2:
            (Path(cfg.run_dir) / "HANGING").write_text(str(directory))
            time.sleep(600)
        return real_save_weights(model, directory)

    checkpoint.save_weights = save_weights
    train(cfg)


def stop_and_resume(cfg: TrainConfig) -> None:
    half = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, stop_at_step=cfg.trainer.max_steps // 2))
    train(half)
    train(cfg)


if __name__ == "__main__":
    mode, config = sys.argv[1], TrainConfig.from_dict(json.loads(sys.argv[2]))
    {"hang-in-save": hang_in_save, "stop-and-resume": stop_and_resume, "train": train}[mode](config)
