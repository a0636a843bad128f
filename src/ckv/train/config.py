"""Training configuration: plain, validated dataclasses that the entry point builds from the Hydra config.

Library code never sees Hydra objects: ``train.py`` turns the composed config into a plain dict and calls
``TrainConfig.from_dict``. The same dict (``TrainConfig.to_dict``) is what a run folder's ``config.yaml`` holds,
and what a resumed run is compared against (``resume_conflicts``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ckv.config import AttentionConfig, ConfigError, ModelConfig, check_bool, check_choice, check_int
from ckv.data import DataConfig

SCHEDULES = ("cosine", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
RESUME_POLICIES = ("strict", "fallback")
PRECISIONS = ("auto", "fp32", "bf16")
WANDB_MODES = ("auto", "online", "offline", "disabled")

# Config keys (dotted, or a prefix ending in ".") that may change when a run resumes: they affect neither the
# model, the data order nor the optimisation trajectory.
RESUMABLE_CHANGES = (
    "name", "run_dir", "wandb.",
    "trainer.log_every", "trainer.val_every", "trainer.val_batches", "trainer.save_every", "trainer.keep_last",
    "trainer.keep_every", "trainer.stop_at_step", "trainer.progress", "trainer.data_cache_dir", "trainer.resume",
)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _from_dict(cls: type, d: Any, owner: str) -> Any:
    if isinstance(d, cls):
        return d
    _check(isinstance(d, dict), f"{owner} must be a mapping, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    _check(not unknown, f"unknown {owner} field(s) {sorted(unknown)}; valid fields: {sorted(names)}")
    return cls(**d)


@dataclass
class ModelSpec:
    """Which model to build: a ``ckv.config`` preset plus ``ModelConfig`` field overrides.

    ``vocab_size="auto"`` takes the data's vocabulary (the tokenizer's size, or the lookup layout's). The
    attention fields come from the separate ``attention`` group (see ``TrainConfig``).
    """

    preset: str = "tiny"
    vocab_size: Union[int, str] = "auto"
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, str):
            _check(self.vocab_size == "auto", f"model.vocab_size={self.vocab_size!r} must be an integer or 'auto'")
        else:
            check_int("model.vocab_size", self.vocab_size, 1)
        _check("attention" not in self.overrides, "set attention fields in the attention group, not under model")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        """``{"preset": ..., "vocab_size": ..., <any other ModelConfig field>: ...}`` (flat, as in conf/model)."""
        d = dict(d)
        _check("preset" in d, f"model needs a 'preset' (one of the ckv.config presets); got keys {sorted(d)}")
        preset, vocab = d.pop("preset"), d.pop("vocab_size", "auto")
        return cls(preset=preset, vocab_size=vocab, overrides=d)

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "vocab_size": self.vocab_size, **self.overrides}

    def build(self, attention: dict[str, Any], data_vocab_size: int) -> ModelConfig:
        """The validated ``ModelConfig``; ``data_vocab_size`` fills ``vocab_size="auto"`` and bounds a fixed one."""
        vocab = data_vocab_size if self.vocab_size == "auto" else self.vocab_size
        if vocab < data_vocab_size:
            raise ConfigError(f"model.vocab_size={vocab} is smaller than the data's vocabulary ({data_vocab_size} ids)")
        return ModelConfig.from_preset(self.preset, vocab_size=vocab, attention=dict(attention), **self.overrides)


@dataclass
class OptimConfig:
    """AdamW (torch's implementation; no fused DeepSpeed op) and its learning-rate schedule.

    ``schedule``: ``cosine`` (linear warmup to ``lr``, cosine decay to ``min_lr_ratio * lr`` at the last step),
    ``wsd`` (warmup, stable at ``lr``, then linear decay to ``min_lr_ratio * lr`` over the last
    ``decay_fraction`` of the steps) or ``constant`` (warmup, then flat). Weight decay applies to matrices only
    (not to norm gains or gate biases). ``grad_clip`` is the global-norm clip (0 turns it off).
    """

    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_int("optim.warmup_steps", self.warmup_steps, 0)
        _check(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        _check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
               f"optim betas ({self.beta1}, {self.beta2}) must lie in [0, 1)")
        _check(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        _check(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (0 turns clipping off)")
        _check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        _check(0 < self.decay_fraction <= 1, f"optim.decay_fraction={self.decay_fraction} must lie in (0, 1]")


@dataclass
class TrainerConfig:
    """How long and how the loop runs.

    Batch sizes count sequences of ``data.seq_len`` tokens: ``global_batch_size`` per optimizer step over all
    ranks, ``micro_batch_size`` per rank per forward/backward; gradient accumulation makes up the difference
    (``global = micro * accumulation * world_size``). ``device``/``precision`` ``auto``: CUDA with bf16 when
    available, else CPU with fp32. Intervals are in optimizer steps; 0 turns validation / periodic checkpoints
    off (a checkpoint is still written at the end and on SIGTERM/SIGINT). ``keep_last`` checkpoints are kept,
    plus every checkpoint whose step is a multiple of ``keep_every`` (for analyses over training).
    ``stop_at_step`` ends this invocation early (with a checkpoint) without ending the run, e.g. to split a run
    into time-limited jobs. Training always resumes from the run folder's latest checkpoint; when that one is
    damaged, ``resume=strict`` stops naming the damaged file and ``resume=fallback`` takes the newest intact one.
    """

    max_steps: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 8
    device: str = "auto"
    precision: str = "auto"
    log_every: int = 10
    val_every: int = 0
    val_batches: int = 4
    save_every: int = 0
    keep_last: int = 2
    keep_every: int = 0
    stop_at_step: Optional[int] = None
    progress: bool = True
    data_cache_dir: Optional[str] = None
    resume: str = "strict"

    def __post_init__(self) -> None:
        for name in ("max_steps", "global_batch_size", "micro_batch_size", "log_every", "val_batches", "keep_last"):
            check_int(f"trainer.{name}", getattr(self, name), 1)
        for name in ("val_every", "save_every", "keep_every"):
            check_int(f"trainer.{name}", getattr(self, name), 0)
        if self.stop_at_step is not None:
            check_int("trainer.stop_at_step", self.stop_at_step, 1)
        check_choice("trainer.device", self.device, DEVICES)
        check_choice("trainer.precision", self.precision, PRECISIONS)
        check_choice("trainer.resume", self.resume, RESUME_POLICIES)
        check_bool("trainer.progress", self.progress)


@dataclass
class WandbConfig:
    """Weights & Biases logging. ``mode=auto``: ``$WANDB_MODE`` if set, else online when ``$WANDB_API_KEY`` is
    set, else offline (``wandb sync`` uploads later). ``enabled=false`` turns it off."""

    enabled: bool = True
    project: str = "ckv"
    entity: Optional[str] = None
    mode: str = "auto"
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choice("wandb.mode", self.mode, WANDB_MODES)
        check_bool("wandb.enabled", self.enabled)


@dataclass
class TrainConfig:
    """Everything one training run needs. ``deepspeed`` is a DeepSpeed config fragment (ZeRO settings etc.);
    batch sizes, precision, clipping and the optimizer are filled in from the other sections."""

    run_dir: str
    model: ModelSpec = field(default_factory=ModelSpec)
    attention: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: dict[str, Any] = field(default_factory=lambda: {"zero_optimization": {"stage": 0}})
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    name: str = "run"

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelSpec.from_dict(self.model)
        if isinstance(self.data, dict):
            self.data = DataConfig.from_dict(self.data)
        self.optim = _from_dict(OptimConfig, self.optim, "optim")
        self.trainer = _from_dict(TrainerConfig, self.trainer, "trainer")
        self.wandb = _from_dict(WandbConfig, self.wandb, "wandb")
        _check(isinstance(self.deepspeed, dict), "deepspeed must be a mapping (a DeepSpeed config fragment)")
        _check(isinstance(self.attention, dict), "attention must be a mapping of AttentionConfig fields")
        self.attention = dataclasses.asdict(_from_dict(AttentionConfig, self.attention, "attention"))
        check_int("seed", self.seed, 0)
        _check(bool(self.run_dir), "run_dir must be a folder path")

    @classmethod
    def from_dict(cls, d: dict[str, Any], run_dir: Optional[str] = None) -> "TrainConfig":
        """Build from a plain nested dict (the resolved Hydra config). Keys the entry point uses for folder
        naming only (``out_dir``, ``experiment``) are ignored."""
        d = {k: v for k, v in d.items() if k not in ("out_dir", "experiment")}
        if run_dir is not None:
            d["run_dir"] = run_dir
        return _from_dict(cls, d, "config")

    def to_dict(self) -> dict[str, Any]:
        """The plain nested dict written to ``<run_dir>/config.yaml`` (``from_dict`` reads it back)."""
        return {
            "name": self.name, "seed": self.seed, "run_dir": str(self.run_dir),
            "model": self.model.to_dict(), "attention": dict(self.attention), "data": self.data.to_dict(),
            "optim": dataclasses.asdict(self.optim), "trainer": dataclasses.asdict(self.trainer),
            "deepspeed": dict(self.deepspeed), "wandb": dataclasses.asdict(self.wandb),
        }


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: list(d) if isinstance(d, tuple) else d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out if out or not prefix else {prefix: d}


def resume_conflicts(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Differences between a run folder's saved config and the current one that make resuming unsound, as
    ``"key: saved -> current"`` lines (empty when the run may resume). See ``RESUMABLE_CHANGES``."""
    a, b = _flatten(saved), _flatten(current)
    unset = object()

    def show(value: Any) -> str:
        return "(unset)" if value is unset else repr(value)

    lines = []
    for key in sorted(set(a) | set(b)):
        k = key.rstrip(".")
        if any(k == p or (p.endswith(".") and k.startswith(p)) for p in RESUMABLE_CHANGES):
            continue
        old, new = a.get(key, unset), b.get(key, unset)
        if old != new:
            lines.append(f"{k}: {show(old)} -> {show(new)}")
    return lines
