"""The eval-task registry: a task kind (``task.kind`` in ``conf/eval/task/*.yaml``) is a subclass of ``EvalTask``
registered with ``@register_task``, in its own module.

A task kind declares, next to its spec dataclass: how a config dict becomes a spec (``parse``: unknown keys and bad
values are one-line ``ConfigError``s), how the spec's prompts are built for a model (``build``, from the model's
``ModelFacts`` only, so every vocabulary and length check runs before the weights load), which logits callable it
scores with (``logits``, e.g. the needle's chunked prefill), how it scores, summarises and writes its rows (``run``),
what a dry run prints (``dry_run``), its plot (``plot``) and its lines of the summary printed at the end (``summary``).
``ckv.eval.runner`` only calls these; it never switches on the task type. The kinds register when ``ckv.eval`` is
imported (its ``__init__`` imports every module of the package: ``lookup``, ``needle``, ``probe`` and any new one),
so ``TASKS`` is complete whichever module a caller imports first. Checklist for a new kind: docs/evaluation.md,
"Adding a task".
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, get_type_hints

from ckv.config import ConfigError, check_bool, check_int, field_names, reject_unknown
from ckv.eval.mitigation import MitigationSpec
from ckv.eval.models import LoadedModel, ModelFacts
from ckv.eval.scoring import LogitsFn
from ckv.eval.stats import StatsOptions


@dataclass(frozen=True)
class RunOptions:
    """How to run: ``limit`` caps base examples (lookup, needle) or lengths (probe) for a quick look;
    ``progress`` shows tqdm bars; ``plots`` writes the task's plot next to results.json; ``mitigation``: an
    inference-time mitigation of weak phases (``ckv.eval.mitigation``; a mapping of its fields is parsed)."""

    batch_size: int = 64
    limit: Optional[int] = None
    progress: bool = True
    device: str = "auto"
    out_dir: Optional[str] = None
    plots: bool = True
    stats: StatsOptions = field(default_factory=StatsOptions)
    mitigation: MitigationSpec = field(default_factory=MitigationSpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mitigation", MitigationSpec.parse(self.mitigation))
        if isinstance(self.stats, dict):
            reject_unknown(self.stats, field_names(StatsOptions), "stats")
            for name, value in self.stats.items():  # numbers' types here, their ranges in StatsOptions
                hint = get_type_hints(StatsOptions)[name]
                if hint is int:
                    check_int(f"stats.{name}", value, 0)
                elif hint is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ConfigError(f"stats.{name}={value!r} must be a number")
            try:
                object.__setattr__(self, "stats", StatsOptions(**self.stats))
            except (TypeError, ValueError) as e:  # StatsOptions checks with ValueError: make it a user error
                raise ConfigError(str(e) if "stats." in str(e) else f"stats: {e}") from e
        if not isinstance(self.stats, StatsOptions):
            raise ConfigError(f"stats={self.stats!r} must be a mapping of {field_names(StatsOptions)}")
        check_int("batch_size", self.batch_size)
        if self.limit is not None:
            check_int("limit", self.limit)
        check_bool("progress", self.progress)
        check_bool("plots", self.plots)
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device={self.device!r} must be auto, cpu, cuda or cuda:<index>")
        if self.out_dir is not None and (not isinstance(self.out_dir, str) or not self.out_dir):
            raise ConfigError(f"out_dir={self.out_dir!r} must be null or a folder")


def check_name(spec: Any) -> None:
    """``task.name`` names the output folder: a non-empty string without path separators."""
    if not isinstance(spec.name, str) or not spec.name or "/" in spec.name or "\\" in spec.name:
        raise ConfigError(f"task.name={spec.name!r} must be a non-empty string without '/' (the output folder)")


@dataclass
class TaskResult:
    """What a task's ``run`` returns: the JSON-ready ``report`` (``results.json``'s ``results``) and the rows of
    ``results.csv``."""

    report: dict
    rows: list[dict]


class EvalTask(ABC):
    """One kind of evaluation task. Subclasses set ``kind`` (the config's ``task.kind``) and ``spec`` (a frozen
    dataclass with a ``name`` field that validates every field in ``__post_init__``), implement ``build`` and
    ``run``, and may override the other methods; ``@register_task`` makes the kind known."""

    kind: ClassVar[str]
    spec: ClassVar[type]

    def parse(self, config: dict[str, Any]) -> Any:
        """The spec of ``config`` (the task config minus ``kind``): unknown keys and bad values are ConfigErrors."""
        reject_unknown(config, field_names(self.spec), f"task (kind {self.kind!r})")
        return self.spec(**config)

    @abstractmethod
    def build(self, spec: Any, model: ModelFacts, limit: Optional[int] = None) -> Any:
        """The built prompts of ``spec`` for ``model`` (needs no weights: vocabulary, context and stride checks
        happen here)."""

    def logits(self, spec: Any, model: LoadedModel, built: Any, options: RunOptions) -> LogitsFn:
        """The logits callable the task scores with (default: the model's own last-position logits)."""
        return model.logits

    @abstractmethod
    def run(self, built: Any, logits: LogitsFn, options: RunOptions, device: Any) -> TaskResult:
        """Score ``built`` with ``logits`` and report."""

    def shift_stride(self, built: Any) -> Optional[int]:
        """The stride over which ``mitigation=shift_ensemble`` moves the targets of ``built``'s prompts (the task
        then scores each prompt's moved copies in its ``run``); ``None`` (the default): the task's groups are not
        the target's position, so its prompts are not shifted."""
        return None

    def dry_run(self, spec: Any, built: Any, model: ModelFacts, options: RunOptions) -> list[str]:
        """What ``eval.py dry_run=true`` prints for this task (no weights are loaded)."""
        return [f"{spec.name}: {len(built.prompts)} prompts; settings valid"]

    def plot(self, report: dict, path: Path, title: str) -> Optional[Path]:
        """Write the task's plot to ``path`` (``<out>/<name>.png``); ``None``: the task has no plot."""
        return None

    def summary(self, report: dict) -> list[str]:
        """The task's lines of the one-screen summary ``eval.py`` prints at the end."""
        return []


TASKS: dict[str, EvalTask] = {}


def register_task(cls: type[EvalTask]) -> type[EvalTask]:
    """Class decorator: make ``cls`` (an ``EvalTask`` with ``kind`` and ``spec``) the task of ``task.kind=<kind>``.
    A kind is registered once, and one spec class belongs to one kind."""
    if not (isinstance(cls, type) and issubclass(cls, EvalTask)):
        raise TypeError(f"{cls!r} is not an EvalTask subclass")
    kind, spec = getattr(cls, "kind", None), getattr(cls, "spec", None)
    if not isinstance(kind, str) or not kind or not dataclasses.is_dataclass(spec):
        raise TypeError(f"{cls.__name__} must set kind (a non-empty string) and spec (a dataclass)")
    if "name" not in field_names(spec):
        raise TypeError(f"{cls.__name__}.spec {spec.__name__} needs a 'name' field (the output folder)")
    old = TASKS.get(kind)
    if old is not None and type(old) is not cls:
        raise ValueError(f"task kind {kind!r} is already registered (by {type(old).__module__})")
    clash = [k for k, t in TASKS.items() if t.spec is spec and k != kind]
    if clash:
        raise ValueError(f"spec {spec.__name__} already belongs to task kind {clash[0]!r}")
    TASKS[kind] = cls()
    return cls


def task_from_dict(d: dict[str, Any]) -> Any:
    """A task spec from its config (``kind`` plus the spec's fields)."""
    if not isinstance(d, dict):
        raise ConfigError(f"task={d!r} must be a mapping with a 'kind' (choose one of {sorted(TASKS)})")
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in TASKS:
        raise ConfigError(f"task.kind={kind!r} is not allowed; choose one of {sorted(TASKS)}")
    return TASKS[kind].parse(d)


def task_type(spec: Any) -> EvalTask:
    """The registered task kind whose spec class ``spec`` is an instance of."""
    for task in TASKS.values():
        if type(spec) is task.spec:
            return task
    raise ConfigError(f"{type(spec).__name__} is not the spec of a registered task kind; known: {sorted(TASKS)}")
