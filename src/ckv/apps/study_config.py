"""The studies' loader: ``load_study`` reads ``conf/study/<name>.yaml`` (the keys: ``ckv.apps.study``'s docstring)
into a ``Study`` of ``Run``s and ``Analysis``es; a control's ``phase_of`` becomes the compared model's stride
(``compared_stride``, from its attention backend).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from omegaconf import OmegaConf

from ckv.attention import model_phase_stride
from ckv.checks import ConfigError
from ckv.io.layout import yaml_problem
from ckv.train.plan import compose_train_config, model_config

ROOT = Path(__file__).resolve().parents[3]  # the checkout: train.py, eval.py and conf/ live here
STUDY_DIR = ROOT / "conf" / "study"
ANALYSIS_DIR = ROOT / "conf" / "eval" / "analysis"  # eval.py's analyses (analysis=<name>)
TASK_DIR = ROOT / "conf" / "eval" / "task"  # eval.py's tasks (task=<name>)
TASK = "demo_lookup"  # the lookup task of every study so far (a study's ``task`` key)
STUDY_KEYS = {
    "base",
    "title",
    "out",
    "record",
    "task",
    "evals",
    "workers",
    "seeds",
    "runs",
    "criteria",
    "params",
    "scales",
    "report",
    "analyses",
    "checkpoints",
    "probes",
}
SCALE_KEYS = {"params", "train", "eval", "launcher"}
RUN_KEYS = {"experiment", "role", "name", "train", "eval", "entry", "seeds", "phase_of", "task"}
ANALYSIS_KEYS = {"roles", "eval"}
CHECKPOINT_KEYS = {"runs", "eval", "overrides"}
PROBE_KEYS = {"runs", "task"}


@dataclass(frozen=True)
class Run:
    """One model of a study: an experiment config, a seed, its role in the checks, and extra overrides."""

    experiment: str
    seed: int
    role: str  # what the study's checks make of it, e.g. "gate", "baseline", "fix", "control"
    train_overrides: tuple[str, ...] = ()
    eval_overrides: tuple[str, ...] = ()
    name: str = ""  # the run folder's name under <out>/runs (default: the experiment)
    entry: tuple[str, ...] = ("train.py",)  # the trainer command after ``python``; it takes train.py's overrides
    task: str = ""  # eval.py's task for this run (conf/eval/task/), "" : the study's

    @property
    def label(self) -> str:
        return f"{(self.name or self.experiment).removeprefix('demo_')}/seed={self.seed}"


@dataclass(frozen=True)
class Analysis:
    """One entry of a study's ``analyses``: ``eval.py analysis=<name>`` with ``overrides`` on every finished run whose
    role is in ``roles`` (every run when empty)."""

    name: str
    roles: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()

    def applies_to(self, run: Run) -> bool:
        return not self.roles or run.role in self.roles


@dataclass(frozen=True)
class RunPatterns:
    """A study key that applies to the runs whose label matches one of ``runs`` (fnmatch patterns)."""

    runs: tuple[str, ...]

    def applies_to(self, run: Run) -> bool:
        return any(fnmatch.fnmatchcase(run.label, p) for p in self.runs)


@dataclass(frozen=True)
class CheckpointEvals(RunPatterns):
    """A study's ``checkpoints``: its evaluation ``eval`` (a name of its ``evals``, or its task without ``evals``)
    repeated on every kept checkpoint of each finished run ``runs`` matches, with ``overrides`` added (e.g. a
    ``limit`` on the prompts: a trajectory costs less than a verdict): how the measured numbers grow over training."""

    eval: str = ""
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeEvals(RunPatterns):
    """A study's ``probes``: a second ``eval.py`` task (``task``, a YAML of conf/eval/task/, e.g. the filler-length
    probe ``probe_bible``) run once on each finished run ``runs`` matches, beside the study's own evaluations (its
    results in the run's ``eval/<task>/``; the run's eval overrides, e.g. a control's ``task.stride``, apply)."""

    task: str = ""


@dataclass(frozen=True)
class Study:
    """A study as its ``conf/study/<name>.yaml`` declares it (the module docstring lists the keys); ``runs`` is the
    plan: every declared run once per seed."""

    name: str
    title: str
    out: str
    record: str
    task: str
    workers: Union[int, str, None]
    seeds: tuple[int, ...]
    runs: tuple[Run, ...]
    criteria: dict[str, float]
    params: dict[str, Any]
    evals: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> eval overrides; empty: one, on task
    scale: str = ""  # the scale chosen from the YAML's ``scales`` ("": the study's own)
    scales: tuple[str, ...] = ()  # the scales the YAML declares
    report: str = ""  # ``module:function`` the generic command calls after the runs ("" : none)
    launcher: str = ""  # the chosen scale's Hydra launcher (conf/hydra/launcher/): training is submitted through it
    analyses: tuple[Analysis, ...] = ()  # run after the evaluations (``run_analyses``)
    checkpoints: Optional[CheckpointEvals] = None  # evaluations of the runs' checkpoints (``run_checkpoint_evals``)
    probes: Optional[ProbeEvals] = None  # a second task on some runs (``run_probe_evals``)

    def workers_for(self, n_runs: int) -> int:
        """Models trained at once when ``--workers`` is not given: ``workers`` (``all``: ``n_runs``), else
        ``default_workers``."""
        if self.workers == "all":
            return n_runs
        return default_workers() if self.workers is None else int(self.workers)


def _overrides(value: Any, where: str) -> tuple[str, ...]:
    """Overrides as a YAML list or one space-separated string."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(value.split())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{where}: overrides are a list of strings or one space-separated string, not {value!r}")


def known_studies() -> list[str]:
    """The names of the studies in ``conf/study/`` (``STUDY_DIR``): what ``NAME`` of the study command may be."""
    return sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))


def _raw_study(name: str) -> Any:
    """The OmegaConf node of ``conf/study/<name>.yaml`` merged over its ``base`` (recursively); ``ConfigError``, one
    line, for a name that is a path or names no study and for a file that is not YAML (its line and column)."""
    if not name or Path(name).name != name or name.startswith(".") or name.endswith((".yaml", ".yml")):
        raise ConfigError(
            f"study {name!r} is not a study name: give the name of a YAML in conf/study/ without .yaml, not a path "
            f"(copy your file to conf/study/<name>.yaml); known: {known_studies()}"
        )
    path = STUDY_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no study {name!r} in {STUDY_DIR}; known: {known_studies()}")
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"conf/study/{name}.yaml is not valid YAML ({yaml_problem(e)}); fix the file") from None
    unknown = sorted(set(node) - STUDY_KEYS)
    if unknown:
        raise ConfigError(f"conf/study/{name}.yaml: unknown keys {unknown}; a study takes {sorted(STUDY_KEYS)}")
    base = node.get("base")
    return node if base is None else OmegaConf.merge(_raw_study(base), node)


def _scaled(node: Any, name: str, scale: str) -> Any:
    """The study's node with scale ``scale``'s params merged over its own (before interpolation, so ``${params.x}``
    reads the scale's)."""
    if not scale:
        return node
    scales = node.get("scales") or {}
    if scale not in scales:
        raise ConfigError(f"conf/study/{name}.yaml: no scale {scale!r}; its scales: {sorted(scales)}")
    unknown = sorted(set(scales[scale]) - SCALE_KEYS)
    if unknown:
        raise ConfigError(
            f"conf/study/{name}.yaml scales.{scale}: unknown keys {unknown}; a scale takes {sorted(SCALE_KEYS)}"
        )
    return OmegaConf.merge(node, {"params": scales[scale].get("params") or {}})


def _seeds(seeds: Any, where: str) -> tuple[int, ...]:
    """A seeds list: distinct integers >= 0 (``ConfigError`` otherwise)."""
    seeds = tuple(seeds)
    if len(set(seeds)) != len(seeds) or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise ConfigError(f"{where}: seeds {list(seeds)}: distinct integers >= 0, please")
    return seeds


def compared_stride(compared: str, runs: list[Run], where: str) -> int:
    """The stride of the model of the run named ``compared`` (its ``name``, else its ``experiment``) among ``runs``, as
    its attention declares it (``ckv.attention.model_phase_stride``: each layer's backend's ``phase_stride``) for
    the config ``train.py`` composes from the run's experiment and train overrides (``ConfigError``, one line, for
    no such run or a model without a stride)."""
    found = [r for r in runs if (r.name or r.experiment) == compared]
    if not found:
        known = [r.name or r.experiment for r in runs]
        raise ConfigError(f"{where}: phase_of={compared!r} is not a run of the study; its runs: {known}")
    run = found[0]
    key = (run.experiment, run.train_overrides)
    if key not in _STRIDES:
        try:  # vocab_size=1 stands in for the data's vocabulary (as in TrainConfig's checks): no stride depends on it
            config = model_config(compose_train_config([f"experiment={run.experiment}", *run.train_overrides]), 1)
        except Exception as e:  # Hydra's and the config's errors alike: one line naming the run
            detail = " ".join(str(e).split())
            raise ConfigError(f"{where}: phase_of={compared!r}: its config does not compose: {detail}") from e
        _STRIDES[key] = model_phase_stride(config)
    if _STRIDES[key] is None:
        raise ConfigError(f"{where}: phase_of={compared!r}: that run's model has no stride (full attention?)")
    return _STRIDES[key]


_STRIDES: dict[tuple[str, tuple[str, ...]], Optional[int]] = {}  # (experiment, train overrides) -> stride


def _analyses(value: Any, where: str) -> tuple[Analysis, ...]:
    """A study's ``analyses``: name (an ``eval.py analysis=`` option) -> ``{roles, eval}``."""
    out = []
    for name, spec in (value or {}).items():
        spec = spec or {}
        if not (ANALYSIS_DIR / f"{name}.yaml").is_file():
            known = sorted(p.stem for p in ANALYSIS_DIR.glob("*.yaml"))
            raise ConfigError(f"{where}: no analysis {name!r} in conf/eval/analysis; known: {known}")
        if not isinstance(spec, dict) or set(spec) - ANALYSIS_KEYS or not isinstance(spec.get("roles") or [], list):
            raise ConfigError(f"{where}.{name}: an analysis takes roles (a list) and eval (overrides); got {spec!r}")
        out.append(Analysis(name, tuple(spec.get("roles") or ()), _overrides(spec.get("eval"), f"{where}.{name}")))
    return tuple(out)


def _checkpoints(value: Any, evals: dict, task: str, where: str) -> Optional[CheckpointEvals]:
    """A study's ``checkpoints``: ``{runs: [patterns], eval: <name of evals>, overrides: [eval.py overrides]}``."""
    if value is None:
        return None
    names = list(evals) or [task]
    what = "runs (a list of label patterns), eval and optionally overrides"
    runs = _patterns(value, CHECKPOINT_KEYS, "checkpoints", what, where)
    name = value.get("eval", names[0])
    if name not in names:
        raise ConfigError(f"{where}: checkpoints.eval={name!r} is not one of the study's evaluations {names}")
    return CheckpointEvals(runs, name, _overrides(value.get("overrides"), f"{where} checkpoints"))


def _patterns(value: Any, keys: set[str], key: str, what: str, where: str) -> tuple[str, ...]:
    """The label patterns of a study key ``key`` that takes ``keys`` (``runs`` among them; ``what`` says what it
    takes): a non-empty list of non-empty strings, else ``ConfigError`` (one line)."""
    ok = isinstance(value, dict) and not set(value) - keys and isinstance(value.get("runs"), list)
    if not ok or not value["runs"] or not all(isinstance(p, str) and p for p in value["runs"]):
        raise ConfigError(f"{where}: {key} takes {what}; got {value!r}")
    return tuple(value["runs"])


def _probes(value: Any, where: str) -> Optional[ProbeEvals]:
    """A study's ``probes``: ``{runs: [patterns], task: <a YAML of conf/eval/task/>}``."""
    if value is None:
        return None
    runs = _patterns(value, PROBE_KEYS, "probes", "runs (a list of label patterns) and task", where)
    task = value.get("task")
    if not isinstance(task, str) or not (TASK_DIR / f"{task}.yaml").is_file():
        known = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
        raise ConfigError(f"{where}: probes.task={task!r} is not a task of conf/eval/task; known: {known}")
    return ProbeEvals(runs, task)


def load_study(name: str, scale: str = "") -> Study:
    """``conf/study/<name>.yaml`` as a ``Study`` (``ConfigError``, one line, for a missing study, scale or a bad
    key); ``scale`` (a key of its ``scales``) swaps in that scale's params and adds its overrides to every run."""
    raw = OmegaConf.to_container(_scaled(_raw_study(name), name, scale), resolve=True)
    spec = (raw.get("scales") or {}).get(scale) or {}
    scale_train = _overrides(spec.get("train"), f"conf/study/{name}.yaml scales.{scale}")
    scale_eval = _overrides(spec.get("eval"), f"conf/study/{name}.yaml scales.{scale}")
    if "out" not in raw:
        raise ConfigError(f"conf/study/{name}.yaml: no out (the default output folder)")
    seeds = _seeds(raw.get("seeds") or (0,), f"conf/study/{name}.yaml")
    declared, templates = list(raw.get("runs") or ()), []
    for i, r in enumerate(declared):
        where = f"conf/study/{name}.yaml runs[{i}]"
        unknown = sorted(set(r) - RUN_KEYS)
        if unknown or "experiment" not in r or "role" not in r:
            raise ConfigError(
                f"{where}: a run takes experiment, role and optionally "
                f"{sorted(RUN_KEYS - {'experiment', 'role'})}; got {sorted(r)}"
            )
        templates.append(
            Run(
                r["experiment"],
                0,
                r["role"],
                _overrides(r.get("train"), where) + scale_train,
                _overrides(r.get("eval"), where),
                name=r.get("name", ""),
                entry=_overrides(r.get("entry"), where) or ("train.py",),
                task=r.get("task", ""),
            )
        )
    runs = []
    for i, (r, template) in enumerate(zip(declared, templates)):
        where = f"conf/study/{name}.yaml runs[{i}]"
        phase = (
            () if r.get("phase_of") is None else (f"task.stride={compared_stride(r['phase_of'], templates, where)}",)
        )
        template = dataclasses.replace(template, eval_overrides=template.eval_overrides + phase + scale_eval)
        runs.append([dataclasses.replace(template, seed=s) for s in _seeds(r.get("seeds") or seeds, where)])
    workers = raw.get("workers")
    if not (workers is None or workers == "all" or (isinstance(workers, int) and workers > 0)):
        raise ConfigError(f"conf/study/{name}.yaml: workers {workers!r}: a number > 0, all, or absent")
    return Study(
        name=name,
        title=raw.get("title", name),
        out=raw["out"],
        record=raw.get("record", name),
        task=raw.get("task", TASK),
        workers=workers,
        seeds=seeds,
        runs=tuple(r for per_seed in runs for r in per_seed),
        criteria=dict(raw.get("criteria") or {}),
        params=dict(raw.get("params") or {}),
        evals={k: _overrides(v, f"conf/study/{name}.yaml evals.{k}") for k, v in (raw.get("evals") or {}).items()},
        scale=scale,
        launcher=spec.get("launcher", ""),
        scales=tuple(raw.get("scales") or ()),
        report=raw.get("report", ""),
        analyses=_analyses(raw.get("analyses"), f"conf/study/{name}.yaml analyses"),
        checkpoints=_checkpoints(
            raw.get("checkpoints"), raw.get("evals") or {}, raw.get("task", TASK), f"conf/study/{name}.yaml"
        ),
        probes=_probes(raw.get("probes"), f"conf/study/{name}.yaml"),
    )


def select_runs(study: Study, patterns: str) -> Study:
    """``study`` with only the runs whose label (``w8s8/seed=42``) matches one of ``patterns``, comma-separated
    fnmatch patterns (``full_kv1/*,w8s8/seed=42``), in the study's order; ``ConfigError`` (one line naming the
    study's labels) for a pattern that matches no run."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    labels = [r.label for r in study.runs]
    matches = {p: [lab for lab in labels if fnmatch.fnmatchcase(lab, p)] for p in wanted}
    unmatched = [p for p, found in matches.items() if not found]
    if not wanted or unmatched:
        raise ConfigError(
            f"conf/study/{study.name}.yaml: no run matches --runs {', '.join(unmatched) or repr(patterns)}; "
            f"its runs: {', '.join(labels)}"
        )
    kept = {lab for found in matches.values() for lab in found}
    return dataclasses.replace(study, runs=tuple(r for r in study.runs if r.label in kept))


def default_workers() -> int:
    """Models trained at once unless a study says otherwise: one per core, at most two (each job has one thread)."""
    return min(2, os.cpu_count() or 1)
