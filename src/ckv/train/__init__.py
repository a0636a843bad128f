"""Training: DeepSpeed engine set-up, the loop, LR schedules, atomic resumable checkpoints and run logging.

``train(TrainConfig) -> run_dir`` is the one entry point (``train.py`` builds the config from Hydra). DeepSpeed
is imported only when a run starts.
"""

from ckv.io.layout import CheckpointError, latest_checkpoint, list_checkpoints
from ckv.io.lock import RunLockedError
from ckv.train.config import ModelSpec, OptimConfig, TrainConfig, TrainerConfig, WandbConfig, resume_conflicts
from ckv.train.loop import DivergenceError, train
from ckv.train.metrics import read_metrics
from ckv.train.run import ResumeError
from ckv.train.signals import TrainingInterrupted

__all__ = [
    "CheckpointError",
    "DivergenceError",
    "ModelSpec",
    "OptimConfig",
    "ResumeError",
    "RunLockedError",
    "TrainConfig",
    "TrainerConfig",
    "TrainingInterrupted",
    "WandbConfig",
    "latest_checkpoint",
    "list_checkpoints",
    "read_metrics",
    "resume_conflicts",
    "train",
]
