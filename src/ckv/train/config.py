"""Training configuration: plain, validated dataclasses that the entry point builds from the Hydra config.

Library code never sees Hydra objects: ``train.py`` turns the composed config into a plain dict and calls
``TrainConfig.from_dict``. The same dict (``TrainConfig.to_dict``) is what a run folder's ``config.yaml`` holds,
and what a resumed run is compared against (``resume_conflicts``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from ckv.attention import SlidingAttentionConfig, check_attention
from ckv.config import (
    REGISTRY,
    AttentionConfig,
    ConfigError,
    ModelConfig,
    ModelSpec,
    check_bool,
    check_choice,
    check_float,
    check_int,
    field_names,
    reject_unknown,
    saved_attention,
)
from ckv.data import DataConfig
from ckv.train.checkpointing import MODES as CHECKPOINTING_MODES
from ckv.train.gate_entropy import GateEntropyConfig
from ckv.train.indexer import IndexerTrainingConfig

SCHEDULES = ("cosine", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
RESUME_POLICIES = ("strict", "fallback")
PRECISIONS = ("auto", "fp32", "bf16")
WANDB_MODES = ("auto", "online", "offline", "disabled")

# The one list of config keys (dotted, or a prefix ending in ".") that do not change a run's trajectory: they
# affect neither the model, the data order nor the optimisation. They may change when a run resumes, and they are
# left out of a run's folder name (train.py's ckv_job_dir resolver).
RESUMABLE_CHANGES = (
    "name",
    "run_dir",
    "wandb.",
    "trainer.log_every",
    "trainer.val_every",
    "trainer.val_batches",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.keep_every",
    "trainer.stop_at_step",
    "trainer.progress",
    "trainer.data_cache_dir",
    "trainer.resume",
    "trainer.stop_check_every",
    "trainer.peak_flops",
    "trainer.debug_checks",
)


def trajectory_neutral(key: str) -> bool:
    """Whether dotted config ``key`` is in ``RESUMABLE_CHANGES`` (itself, or under one of its prefixes)."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUMABLE_CHANGES)


def named_attention(model: ModelConfig) -> list[tuple[str, AttentionConfig]]:
    """Each attention config the model's layers use, once, with the config path a message names it by: ``attention``
    (the run's attention group: a uniform stack's, and a layer schedule's segments that take it) or
    ``model.layers[k].attention`` (segment ``k``'s own), in layer order."""
    if model.layers is None:
        return [("attention", model.attention)]
    out: list[tuple[str, AttentionConfig]] = []
    for k, seg in enumerate(model.layers):
        if all(a is not seg.attention for _, a in out):
            out.append(
                ("attention" if seg.attention is model.attention else f"model.layers[{k}].attention", seg.attention)
            )
    return out


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _from_dict(cls: type, d: Any, owner: str) -> Any:
    if isinstance(d, cls):
        return d
    _check(isinstance(d, Mapping), f"{owner} must be a mapping, got {type(d).__name__}")
    reject_unknown(d, field_names(cls), owner)
    return cls(**d)


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
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_int("optim.warmup_steps", self.warmup_steps, 0)
        check_float("optim.lr", self.lr, 0, low_open=True)
        check_float("optim.weight_decay", self.weight_decay, 0)
        check_float("optim.beta1", self.beta1, 0, 1, high_open=True)
        check_float("optim.beta2", self.beta2, 0, 1, high_open=True)
        check_float("optim.eps", self.eps, 0, low_open=True)
        check_float("optim.grad_clip", self.grad_clip, 0)  # 0 turns clipping off
        check_float("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_float("optim.decay_fraction", self.decay_fraction, 0, 1, low_open=True)


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

    Memory and speed (docs/training.md, "Memory, throughput and planning"): ``activation_checkpointing``
    (``none | full | selective``, ``ckv.train.checkpointing``), ``loss_chunk_tokens`` (0: the LM head's full logits and
    ``F.cross_entropy``; N: ``ckv.train.loss.chunked_cross_entropy`` over N tokens at a time, refused under ZeRO-3
    whose partitioned head weight it cannot read), ``compile`` (``torch.compile`` of the model). The hot path
    makes no host sync: a stop signal is acted on at the next multiple of ``stop_check_every`` steps (a
    collective), token-id range checks run at the data boundary, and ``debug_checks`` turns the model's own
    value check back on (one sync per forward). ``peak_flops`` (FLOP/s per device) overrides the ``ckv.flops``
    table for MFU; without it MFU is left out where the device is not in the table (e.g. on CPU).

    Training-only losses (the model is unchanged): ``gate_entropy`` (``ckv.train.gate_entropy``) and ``indexer``,
    the lightning indexer's loss and dense warm-up wherever the model has one (``ckv.train.indexer``).
    """

    max_steps: int = 1000
    global_batch_size: int = 32
    micro_batch_size: int = 8
    device: str = "auto"
    precision: str = "auto"
    log_every: int = 10
    val_every: int = 200
    val_batches: int = 8
    save_every: int = 200
    keep_last: int = 2
    keep_every: int = 0
    stop_at_step: Optional[int] = None
    progress: bool = True
    data_cache_dir: Optional[str] = None
    resume: str = "strict"
    activation_checkpointing: str = "none"
    loss_chunk_tokens: int = 0
    compile: bool = False
    stop_check_every: int = 10
    peak_flops: Optional[float] = None
    debug_checks: bool = False
    gate_entropy: GateEntropyConfig = field(default_factory=GateEntropyConfig)
    indexer: IndexerTrainingConfig = field(default_factory=IndexerTrainingConfig)

    def __post_init__(self) -> None:
        self.gate_entropy = _from_dict(GateEntropyConfig, self.gate_entropy, "trainer.gate_entropy")
        self.indexer = _from_dict(IndexerTrainingConfig, self.indexer, "trainer.indexer")
        for name in (
            "max_steps",
            "global_batch_size",
            "micro_batch_size",
            "log_every",
            "val_batches",
            "keep_last",
            "stop_check_every",
        ):
            check_int(f"trainer.{name}", getattr(self, name), 1)
        for name in ("val_every", "save_every", "keep_every", "loss_chunk_tokens"):
            check_int(f"trainer.{name}", getattr(self, name), 0)
        if self.stop_at_step is not None:
            check_int("trainer.stop_at_step", self.stop_at_step, 1)
        check_choice("trainer.device", self.device, DEVICES)
        check_choice("trainer.precision", self.precision, PRECISIONS)
        check_choice("trainer.resume", self.resume, RESUME_POLICIES)
        check_choice("trainer.activation_checkpointing", self.activation_checkpointing, CHECKPOINTING_MODES)
        for name in ("progress", "compile", "debug_checks"):
            check_bool(f"trainer.{name}", getattr(self, name))
        if self.peak_flops is not None:
            check_float("trainer.peak_flops", self.peak_flops, 0, low_open=True)


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
        _check(
            isinstance(self.tags, list) and all(isinstance(t, str) for t in self.tags),
            f"wandb.tags={self.tags!r} must be a list of strings",
        )


@dataclass
class TrainConfig:
    """Everything one training run needs. The field defaults are the defaults of ``python train.py`` too: the
    option each conf/ group takes by default states these values and no others (tests/train/test_entry.py).
    ``deepspeed`` is a DeepSpeed config fragment (ZeRO settings etc.);
    batch sizes, precision, clipping and the optimizer are filled in from the other sections.

    Construction validates every section, including the model the ``model`` and ``attention`` sections describe
    (its field values and the attention backend's checks), so a bad override fails before any data is prepared.
    """

    run_dir: str
    model: ModelSpec = field(default_factory=ModelSpec)
    attention: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: dict[str, Any] = field(default_factory=lambda: {"zero_optimization": {"stage": 0}})
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    name: str = "default"

    def __post_init__(self) -> None:
        if isinstance(self.model, Mapping):
            self.model = ModelSpec.from_dict(self.model)
        if isinstance(self.data, Mapping):
            self.data = DataConfig.from_dict(self.data)
        self.optim = _from_dict(OptimConfig, self.optim, "optim")
        self.trainer = _from_dict(TrainerConfig, self.trainer, "trainer")
        self.wandb = _from_dict(WandbConfig, self.wandb, "wandb")
        _check(isinstance(self.deepspeed, dict), "deepspeed must be a mapping (a DeepSpeed config fragment)")
        _check(isinstance(self.attention, Mapping), "attention must be a mapping of AttentionConfig fields")
        self.attention = AttentionConfig.from_dict(self.attention).to_dict()
        check_int("seed", self.seed, 0)
        _check(bool(self.run_dir), "run_dir must be a folder path")
        # the model's values and the backend's checks; vocab_size=1 stands in for the data's vocabulary, whose
        # bound on a fixed model.vocab_size is checked once the data is prepared
        model = self.model.build(self.attention, data_vocab_size=1)
        check_attention(model)
        attentions = named_attention(model)
        for name, a in attentions:
            self._check_window(name, a)
        if self.trainer.gate_entropy.enabled:
            floor = self.trainer.gate_entropy.floor
            gated = [(name, a) for name, a in attentions if a.option("gate") is not None]
            a = model.attention
            _check(
                bool(gated),
                f"trainer.gate_entropy.floor={floor} keeps a learned gate spread: the model needs one "
                + (
                    f"(attention.kind={a.kind!r} with attention.gate set; got gate={a.option('gate')})"
                    if model.layers is None
                    else f"(a layer with attention.gate set; its layers are {model.layer_kinds}, none gated)"
                ),
            )
            for name, a in gated:
                _check(
                    a.window >= 2,
                    f"trainer.gate_entropy.floor={floor} needs {name}.window >= 2 (a 1-token window's gate has "
                    "nothing to spread over)",
                )
        selection = next((a.option("selection") for _, a in attentions if a.option("selection") is not None), None)
        self.trainer.indexer = self.trainer.indexer.resolved(
            self.trainer.max_steps, has_indexer=selection is not None and not selection.oracle
        )
        ix = self.trainer.indexer
        stages = [(k, v) for k, v in (("dense_steps", ix.dense_steps), ("warmup_steps", ix.warmup_steps)) if v]
        stage_name = " + ".join(f"trainer.indexer.{k}={v}" for k, v in stages) or "trainer.indexer.dense_steps=0"
        if selection is not None and selection.oracle:
            _check(
                ix.dense_stage == 0,
                f"{stage_name} is a dense stage for a lightning indexer, but "
                "attention.selection.by='oracle' selects by the main attention's own scores (no indexer to train): "
                "set it to 0",
            )
        elif selection is not None:
            _check(
                ix.weight > 0,
                f"trainer.indexer.weight={ix.weight} would leave the lightning indexer (attention.selection) "
                "untrained: top-k selection gives it no gradient from the LM loss, only its own loss does; set it > 0",
            )
            _check(
                ix.dense_stage < self.trainer.max_steps,
                f"{stage_name} covers all trainer.max_steps={self.trainer.max_steps}: the model "
                "would never train sparse; make the dense stage shorter",
            )
        else:
            _check(
                ix.dense_stage == 0,
                f"{stage_name} is a dense stage for a lightning indexer, which the model does not "
                "have: set attention.selection (attention/selection=indexer) or set it to 0",
            )
        stage = (self.deepspeed.get("zero_optimization") or {}).get("stage", 0)
        _check(
            not (self.trainer.loss_chunk_tokens and stage == 3),
            f"trainer.loss_chunk_tokens={self.trainer.loss_chunk_tokens} needs the whole LM head weight on every "
            "rank, which ZeRO stage 3 partitions: use trainer.loss_chunk_tokens=0 or ZeRO stage 0-2",
        )

    def _check_window(self, name: str, attention: AttentionConfig) -> None:
        """The training sequence holds the window of the attention ``name`` (``named_attention``): a compressor's
        window completes in it, and a sliding window drops a token of it."""
        T, window = self.data.seq_len, attention.describe()["window"]
        _check(
            window is None or T >= window,
            f"data.seq_len={T} is shorter than {name}.window={window}: no window of a sequence completes, so "
            f"compression never takes part; use data.seq_len >= {window} or a smaller {name}.window",
        )
        if isinstance(attention, SlidingAttentionConfig):
            w = attention.sliding_window
            _check(
                T > w,
                f"data.seq_len={T} is not longer than {name}.sliding_window={w}: every query sees the whole "
                f"sequence, so the layer trains as full attention; use data.seq_len > {w} or a smaller "
                f"{name}.sliding_window",
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any], run_dir: Optional[str] = None) -> TrainConfig:
        """Build from a plain nested dict (the resolved Hydra config, or ``to_dict``'s; a run folder's saved
        config goes through ``upgrade_run_config`` first). Keys the entry point uses for folder naming only
        (``out_dir``, ``experiment``) are ignored."""
        d = {k: v for k, v in d.items() if k not in ("out_dir", "experiment")}
        if run_dir is not None:
            d["run_dir"] = run_dir
        return _from_dict(cls, d, "config")

    def to_dict(self) -> dict[str, Any]:
        """The plain nested dict written to ``<run_dir>/config.yaml`` (``from_dict`` reads it back)."""
        return {
            "name": self.name,
            "seed": self.seed,
            "run_dir": str(self.run_dir),
            "model": self.model.to_dict(),
            "attention": dict(self.attention),
            "data": self.data.to_dict(),
            "optim": dataclasses.asdict(self.optim),
            "trainer": dataclasses.asdict(self.trainer),
            "deepspeed": dict(self.deepspeed),
            "wandb": dataclasses.asdict(self.wandb),
        }


def upgrade_run_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """A run folder's saved config in today's shape: the attention section goes through ``saved_attention`` (the
    option groups, one config per kind), and the training-only keys it carried move to the trainer section (a run
    folder of an earlier ckv resumes and evaluates). Today's configs are returned unchanged."""
    d = dict(d)
    if isinstance(d.get("attention"), Mapping):
        d["attention"], training = saved_attention(d["attention"])
        if training:
            d["trainer"] = {**(d.get("trainer") or {}), **training}
    return d


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: list(d) if isinstance(d, tuple) else d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out if out or not prefix else {prefix: d}


def field_defaults() -> dict[str, Any]:
    """Every config key's default (flattened ``section.field.``, as ``_flatten`` writes keys), from the config
    classes themselves; ``attention``'s from every registered kind's config."""
    return _flatten(
        {
            "model": ModelSpec().to_dict(),
            "attention": {k: v for kind in REGISTRY for k, v in _attention_defaults(kind).items() if k != "kind"},
            "data": DataConfig().to_dict(),
            "optim": dataclasses.asdict(OptimConfig()),
            "trainer": dataclasses.asdict(TrainerConfig()),
            "wandb": dataclasses.asdict(WandbConfig()),
        }
    )


def _attention_defaults(kind: str) -> dict[str, Any]:
    """The defaults of the config of attention ``kind``."""
    return AttentionConfig.from_dict({"kind": kind}).to_dict()


def _group_field_defaults(saved_attention: Any) -> dict[str, Any]:
    """The defaults of the fields of each attention option group that ``saved_attention`` sets (flattened like
    ``field_defaults``): a group set in a run folder written before one of its fields existed lacks that key."""
    if not isinstance(saved_attention, Mapping):
        return {}
    groups = {name: cls for backend in REGISTRY.values() for name, cls in backend.config_class.GROUPS.items()}
    return {
        f"attention.{name}.{f.name}.": f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for name, cls in groups.items()
        if isinstance(saved_attention.get(name), Mapping)
        for f in dataclasses.fields(cls)
    }


def resume_conflicts(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Differences between a run folder's saved config and the current one that make resuming unsound, as
    ``"key: saved -> current"`` lines (empty when the run may resume). See ``RESUMABLE_CHANGES``. A key the saved
    config lacks is no conflict when the current value is that key's default: the option came after the run was
    saved, and its default is the behaviour the run trained with (a field of an option group counts so when the
    saved config sets that group)."""
    a, b = _flatten(saved), _flatten(current)
    unset = object()
    defaults = {**field_defaults(), **_group_field_defaults(saved.get("attention"))}

    def show(value: Any) -> str:
        return "(unset)" if value is unset else repr(value)

    lines = []
    for key in sorted(set(a) | set(b)):
        k = key.rstrip(".")
        if trajectory_neutral(k):
            continue
        old, new = a.get(key, unset), b.get(key, unset)
        if old is unset and key in defaults and new == defaults[key]:
            continue
        if old != new:
            lines.append(f"{k}: {show(old)} -> {show(new)}")
    return lines
