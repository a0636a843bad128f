"""The one runner of ckv's studies: a study is a YAML in ``conf/study/`` (its runs, seeds and criteria numbers) and at
most a small module (its science checks, extra tables and plots).

``make demo``, ``make demo-grid``, ``make demo-v4``, ``make robust`` (``-confirm``, ``-ablation``) and ``make
selection`` all go through here: ``load_study`` reads ``conf/study/<name>.yaml``; ``run_plan`` trains every run with
``train.py`` (a finished folder is resumed, i.e. reused) and evaluates it with ``eval.py`` on the study's lookup task,
``workers`` at a time; ``result_row`` is the one row of a run's results every table, criterion and record reads;
``table`` prints the per-phase table; ``write_study_record`` writes ``<out>/<record>.json``.

A study's YAML (``Study``; every key optional but ``out``):

    base: robust            # start from conf/study/robust.yaml; keys here replace its keys (criteria, params merged)
    title: robust           # the study's name in its first printed line (default: the file's name)
    out: outputs/robust     # the default output folder
    record: robust          # <out>/<record>.json (default: the file's name)
    task: demo_lookup       # eval.py's task (conf/eval/task/) every run is scored on
    workers: all            # models trained at once: a number, ``all`` (every run) or absent (default_workers)
    seeds: [0]              # every run once per seed (run-major order)
    runs:                   # experiment (conf/experiment/) + role, and optionally name (the run folder's),
      - {experiment: demo_full, role: control, phase_of: demo_gate_s4}  # train/eval overrides, entry (trainer),
                                  # seeds (this run's, instead of the study's), phase_of (another run's name or
                                  # experiment: this run's phases are read mod that run's model's stride)
    criteria: {min_gain: 0.30}   # the numbers the study's checks compare with
    params: {...}           # anything else the study's module reads (e.g. a model table its flags choose from)
    evals:                  # several evaluations per run (default: one, on ``task``): name -> eval overrides;
      prefix: [task.padding=prefix]   # each writes its own results folder (task.name=<task>_<name>)
    scales:                 # other scales of the same study (``--scale NAME``): params merged over ``params``,
      paper: {params: {experiment: paper_base}, train: [hydra/launcher=slurm]}   # overrides added to every run
    report: ckv.apps.paper:report   # the study's own tables and claims after the runs (module:function): it
                                    # returns its checks and the keys it adds to the record (e.g. its figures)
    analyses:               # eval.py analysis=<name> (conf/eval/analysis/) on the first evaluation of every finished
      knockout: {roles: [baseline], eval: [analysis.units=layers]}   # run of these roles (none: every run)

The generic command runs any of them: ``python -m ckv.apps.study NAME [--quick] [--out DIR] [--workers N]
[--scale S] [--dry-run]`` (``main``): a failed run is reported and the others go on; a rerun reuses finished
training (train.py resumes a finished folder) and evaluations and analyses newer than the run's last checkpoint. An
analysis that does not apply to a run (eval.py's ``EXIT_NOT_APPLICABLE``: no gates, W != S) is skipped with one line.

A model without a stride (full attention) has no phase of its own: ``phase_of`` names the run it is compared with,
and its evaluation groups positions mod that run's stride (``task.stride=S`` added after its own eval overrides),
as that run's attention backend declares it (``phase_stride``) for the config ``train.py`` composes; a study never
restates a model's stride. Values are OmegaConf: ``${params.n_base}`` interpolates. The "control learned" bar
every study's control is judged against is not one study's number: ``CONTROL_LEARNED`` (here).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import OmegaConf

from ckv.apps.cli import EXIT_NOT_APPLICABLE
from ckv.attention import check_attention
from ckv.checks import ConfigError, error_message
from ckv.eval.summary import flatness_fields, results_file
from ckv.io.layout import STATE_FILE, analysis_file, eval_dir, latest_checkpoint, read_run_config
from ckv.io.results import read_json, write_json
from ckv.train.plan import compose_train_config, model_config

ROOT = Path(__file__).resolve().parents[3]  # the checkout: train.py, eval.py and conf/ live here
STUDY_DIR = ROOT / "conf" / "study"
ANALYSIS_DIR = ROOT / "conf" / "eval" / "analysis"  # eval.py's analyses (analysis=<name>)
TASK = "demo_lookup"  # the lookup task of every study so far (a study's ``task`` key)
# a full-attention control has learned a lookup task when its mean accuracy reaches this; below it, "as good as full
# attention" means nothing (the bar of make demo, make demo-v4 and make robust's goal and confirmation)
CONTROL_LEARNED = 0.40
DISTRIBUTED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
# --quick: a few steps per model and a small evaluation: checks the pipeline, not the science
QUICK_TRAIN = (
    "trainer.max_steps=12",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.log_every=4",
    "optim.warmup_steps=2",
)
QUICK_EVAL = ("task.n_base=64", "stats.n_bootstrap=200", "stats.n_permutations=200")
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
}
SCALE_KEYS = {"params", "train", "eval", "launcher"}
RUN_KEYS = {"experiment", "role", "name", "train", "eval", "entry", "seeds", "phase_of"}
ANALYSIS_KEYS = {"roles", "eval"}


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


def _raw_study(name: str) -> Any:
    """The OmegaConf node of ``conf/study/<name>.yaml`` merged over its ``base`` (recursively)."""
    path = STUDY_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))
        raise ConfigError(f"no study {name!r} in {STUDY_DIR}; known: {known}")
    node = OmegaConf.load(path)
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
    its attention backend declares it (``phase_stride``) for the config ``train.py`` composes from the run's
    experiment and train overrides (``ConfigError``, one line, for no such run or a model without a stride)."""
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
        _STRIDES[key] = check_attention(config).phase_stride(config)
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
    )


@dataclass
class Check:
    """One claim of a study and whether the run's numbers support it."""

    claim: str
    passed: bool
    detail: str
    decided: bool = True  # False: the numbers neither support nor refute the claim (``passed`` is then False)


def check_lines(checks: list[Check], words: tuple[str, ...]) -> list[str]:
    """One printed line per check: ``  [<words[0]>] claim: detail`` when it passed, ``[<words[1]>]`` when not, and
    ``[<words[2]>]`` (default ``undecided``) when the numbers decide neither way."""
    undecided = words[2] if len(words) > 2 else "undecided"
    return [
        f"  [{words[0] if c.passed else words[1] if c.decided else undecided}] {c.claim}: {c.detail}" for c in checks
    ]


@dataclass
class Timer:
    """Wall time since the study started, printed as ``m:ss``."""

    start: float = field(default_factory=time.monotonic)

    def __str__(self) -> str:
        s = int(time.monotonic() - self.start)
        return f"{s // 60:d}:{s % 60:02d}"


class CommandFailed(RuntimeError):
    """A study's command exited non-zero: ``returncode`` and the ``last_line`` of its log (its one-line error)."""

    def __init__(self, message: str, returncode: int, last_line: str) -> None:
        super().__init__(message)
        self.returncode, self.last_line = returncode, last_line


def run_command(cmd: list[str], log: Path, env: dict) -> None:
    """Run ``cmd`` in the checkout with its output in ``log``; a failure raises ``CommandFailed`` with the log's last
    lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        lines = log.read_text().splitlines(keepends=True)
        tail = "".join(lines[-15:])
        raise CommandFailed(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- {log} (last lines) ---\n{tail}",
            proc.returncode,
            lines[-1].strip() if lines else "",
        )


def run_dir(out: Path, run: Run) -> Path:
    """The run folder a study gives ``train.py`` (``hydra.run.dir``): ``<out>/runs/<name or experiment>/seed=<s>``."""
    return out / "runs" / (run.name or run.experiment) / f"seed={run.seed}"


def log_file(out: Path, run: Run, stage: str) -> Path:
    """The log of one stage (``train``, ``eval`` or ``eval_<name>``) of ``run``."""
    return out / "logs" / f"{stage}_{run.name or run.experiment}_seed{run.seed}.log"


def train_command(run: Run, out: Path, quick: bool, launcher: str = "") -> list[str]:
    """``train.py``'s command line for ``run`` (its folder: ``run_dir``); with ``launcher`` (e.g. ``slurm``) a
    one-job multirun submitted through ``hydra/launcher=<launcher>`` into the same folder."""
    rdir = run_dir(out, run)
    where = (
        ("-m", f"hydra/launcher={launcher}", f"hydra.sweep.dir='{rdir}'", "hydra.sweep.subdir=.")
        if launcher
        else (f"hydra.run.dir='{rdir}'",)
    )
    return [
        sys.executable,
        *run.entry,
        *where,
        f"experiment={run.experiment}",
        f"seed={run.seed}",
        "trainer.progress=false",
        "wandb.enabled=false",
        *run.train_overrides,
        *(QUICK_TRAIN if quick else ()),
    ]


def eval_names(task: str, evals: Optional[dict[str, tuple[str, ...]]]) -> dict[str, str]:
    """Evaluation name -> the task name its results folder has: ``{task: task}`` without ``evals``, else
    ``<task>_<name>`` per entry."""
    return {task: task} if not evals else {k: f"{task}_{k}" for k in evals}


def eval_commands(
    run: Run, out: Path, quick: bool, task: str = TASK, evals: Optional[dict[str, tuple[str, ...]]] = None
) -> dict[str, tuple[str, list[str]]]:
    """``eval.py``'s command lines for ``run``: evaluation name -> (task name, command). No ``evals``: one, named
    ``task``, on ``task``; else one per entry, named ``<task>_<name>`` (its own results folder), with its
    overrides."""
    specs = {k: (name, (evals or {}).get(k, ())) for k, name in eval_names(task, evals).items()}
    return {
        k: (
            name,
            [
                sys.executable,
                "eval.py",
                f"model.path='{run_dir(out, run)}'",
                f"task={task}",
                *(() if name == task else (f"task.name={name}",)),
                "progress=false",
                *run.eval_overrides,
                *extra,
                *(QUICK_EVAL if quick else ()),
            ],
        )
        for k, (name, extra) in specs.items()
    }


def is_current(rdir: Path, path: Path) -> bool:
    """Whether ``path`` (an evaluation's or analysis' results in run folder ``rdir``) was written after the run's last
    checkpoint (a rerun reuses it; train.py rewrites the final weights when it resumes a finished run, never the
    checkpoint it resumed from)."""
    ckpt = latest_checkpoint(rdir)
    return path.is_file() and ckpt is not None and path.stat().st_mtime > (ckpt / STATE_FILE).stat().st_mtime


def evaluation_is_current(rdir: Path, task_name: str) -> bool:
    """Whether ``rdir`` holds ``task_name``'s results written after its last checkpoint (``is_current``)."""
    return is_current(rdir, results_file(rdir, task_name))


def train_and_evaluate(
    run: Run,
    out: Path,
    quick: bool,
    env: dict,
    clock: Timer,
    task: str = TASK,
    evals: Optional[dict[str, tuple[str, ...]]] = None,
    reuse: bool = False,
) -> dict:
    """Train one model with ``train.py`` (resuming if its folder exists), then evaluate it with ``eval.py``
    (``eval_commands``; ``reuse``: an evaluation still current is not rerun). Returns ``{"run", "dir",
    "train_seconds", "steps", "results", "evaluations"}`` (``results``: the first evaluation's report;
    ``evaluations``: every report by evaluation name)."""
    t0 = time.monotonic()
    rdir = run_dir(out, run)
    run_command(train_command(run, out, quick), log_file(out, run, "train"), env)
    train_s = time.monotonic() - t0
    reports = {}
    for key, (name, cmd) in eval_commands(run, out, quick, task, evals).items():
        if not (reuse and evaluation_is_current(rdir, name)):
            run_command(cmd, log_file(out, run, "eval" if name == task else f"eval_{key}"), env)
        reports[key] = read_json(results_file(rdir, name))["results"]
    steps = read_run_config(rdir)["trainer"]["max_steps"]
    print(
        f"[{clock}] {run.label}: trained in {train_s:.0f} s, evaluated in {time.monotonic() - t0 - train_s:.0f} s",
        flush=True,
    )
    first = next(iter(reports.values()))
    return {"run": run, "dir": rdir, "train_seconds": train_s, "steps": steps, "results": first, "evaluations": reports}


def job_env() -> dict:
    """The environment of every train/eval job: one thread, offline, headless plots, no launcher rank variables
    (every run is its own single-process job: rank variables left behind would make two runs rendezvous on the
    same port)."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }


def run_plan(
    plan: tuple[Run, ...],
    out: Path,
    quick: bool,
    workers: int,
    env: dict,
    clock: Timer,
    task: str = TASK,
    evals: Optional[dict[str, tuple[str, ...]]] = None,
    keep_going: bool = False,
) -> list[dict]:
    """Train and evaluate every run, ``workers`` at a time; returns ``train_and_evaluate``'s records in plan order.
    By default the first failure stops the plan (queued runs never start); ``keep_going`` (the generic command)
    lets the others finish, reuses current evaluations, and records a failed run as ``{"run", "dir", "error"}``."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(train_and_evaluate, r, out, quick, env, clock, task, evals, keep_going): r for r in plan}
        results = {}
        for fut in as_completed(futures):
            run, error = futures[fut], fut.exception()
            if error is not None and not keep_going:
                for f in futures:
                    f.cancel()
                raise error
            if error is not None:
                print(f"[{clock}] {run.label}: FAILED ({str(error).splitlines()[0]})", flush=True)
                results[run] = {"run": run, "dir": run_dir(out, run), "error": str(error)}
            else:
                results[run] = fut.result()
    return [results[r] for r in plan]


def analysis_command(study: Study, run: Run, analysis: Analysis, out: Path, quick: bool) -> tuple[Path, list[str]]:
    """``eval.py analysis=<name>``'s command line for ``run``, on the study's first evaluation (its task and
    overrides, so its results sit in that evaluation's folder), and the analysis' results file."""
    task_name, cmd = next(iter(eval_commands(run, out, quick, study.task, study.evals).values()))
    return analysis_file(eval_dir(run_dir(out, run), task_name), analysis.name), [
        *cmd,
        f"analysis={analysis.name}",
        *analysis.overrides,
    ]


def run_analyses(
    study: Study, done: list[dict], out: Path, quick: bool, workers: int, env: dict, clock: Timer
) -> list[dict]:
    """The study's ``analyses`` on the finished runs (``done``) of their roles, ``workers`` at a time; an analysis
    still current (``is_current``) is not rerun. Returns one record per run and analysis: ``{"label", "analysis"}``
    and ``file`` (its results), ``skipped`` (the one line why it does not apply to that model) or ``error`` (it
    failed; the others go on); each run's records are also under its ``done`` record's ``analyses``, by name."""

    def one(d: dict, a: Analysis) -> dict:
        run = d["run"]
        path, cmd = analysis_command(study, run, a, out, quick)
        record = {"label": run.label, "analysis": a.name}
        try:
            if not is_current(d["dir"], path):
                run_command(cmd, log_file(out, run, a.name), env)
        except CommandFailed as e:
            if e.returncode != EXIT_NOT_APPLICABLE:
                raise
            print(f"[{clock}] {run.label}: {a.name} skipped, it does not apply ({e.last_line})", flush=True)
            return {**record, "skipped": e.last_line}
        print(f"[{clock}] {run.label}: {a.name} done", flush=True)
        return {**record, "file": str(path)}

    jobs = [(d, a) for d in done for a in study.analyses if a.applies_to(d["run"])]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(one, d, a) for d, a in jobs]
    records = []
    for (d, a), fut in zip(jobs, futures):
        if fut.exception() is None:
            records.append(fut.result())
        else:
            print(f"[{clock}] {d['run'].label}: {a.name} FAILED ({str(fut.exception()).splitlines()[0]})", flush=True)
            records.append({"label": d["run"].label, "analysis": a.name, "error": str(fut.exception())})
        d.setdefault("analyses", {})[a.name] = records[-1]
    return records


def start(study: Study, runs: tuple[Run, ...], out: Path, quick: bool, workers: int) -> tuple[Timer, dict]:
    """Print the study's first line and return its clock and the jobs' environment."""
    print(
        f"ckv {study.title} -> {out}: {len(runs)} models, {workers} at a time"
        f"{' (quick: pipeline check, not the science)' if quick else ''}",
        flush=True,
    )
    return Timer(), job_env()


def result_row(d: dict) -> dict:
    """The one row of a finished run (``train_and_evaluate``'s record) every study's tables, criteria and records
    read: its role, seed, budget, and its lookup report's mean, per-phase accuracy with intervals, worst phase,
    phase gap (interval, permutation p, noise floor), residue gap, both gaps' flatness fields
    (``ckv.eval.summary.flatness_fields``: one-sided upper bound, margin, verdict, MDE), the dominant period, and
    the run folder (``results``)."""
    rep, run = d["results"], d["run"]
    h, phase, residue = rep["headline"], rep["phase"], rep["residue"]["gap"]
    return {
        "role": run.role,
        "seed": run.seed,
        "steps": d["steps"],
        "train_seconds": d["train_seconds"],
        "stride": rep["stride"],
        "mean": h["mean"],
        "per_phase": [g["accuracy"] for g in phase["groups"]],
        "per_phase_lower": [g["lower"] for g in phase["groups"]],
        "per_phase_upper": [g["upper"] for g in phase["groups"]],
        "mean_lower": phase["mean"]["lower"],
        "mean_upper": phase["mean"]["upper"],
        "worst_phase": h["worst_phase"],
        "worst_phase_accuracy": h["worst_phase_accuracy"],
        "phase_gap": h["phase_gap"],
        "phase_gap_lower": h["phase_gap_lower"],
        "phase_gap_upper": h["phase_gap_upper"],
        "phase_p_value": h["phase_p_value"],
        "phase_noise_floor": h["phase_noise_floor"],
        "residue_gap": residue["value"],
        "residue_gap_lower": residue["lower"],
        "residue_gap_upper": residue["upper"],
        "residue_noise_floor": residue["noise_floor"],
        **flatness_fields(rep, "phase"),
        **flatness_fields(rep, "residue"),
        "dominant_period": h["dominant_period"],
        "periodicity_score": h["periodicity_score"],
        "results": str(d["dir"]),
    }


def pp(x: Optional[float]) -> str:
    """A fraction as percentage points with one decimal, ``-`` when not computed."""
    return "-" if x is None else f"{100 * x:.1f}"


@dataclass(frozen=True)
class Column:
    """One column of a study's printed table: its ``header``, the ``cell`` text of a row, the ``width`` both are
    padded to (``align``: ``<`` left, ``>`` right) and the ``gap`` printed before it (none before the first)."""

    header: str
    cell: Callable[[dict], str]
    width: int = 0
    align: str = ">"
    gap: str = " "


def write_table(rows: list[dict], columns: Sequence[Column]) -> str:
    """The one table writer of the studies: a header line, then one line per row (a dict, e.g. ``result_row``'s)."""

    def line(texts: list[str]) -> str:
        return "".join((c.gap if i else "") + f"{t:{c.align}{c.width}}" for i, (c, t) in enumerate(zip(columns, texts)))

    return "\n".join([line([c.header for c in columns]), *(line([c.cell(r) for c in columns]) for r in rows)])


def interval_text(r: dict, key: str) -> str:
    """``r[key]`` with its interval (``<key>_lower``, ``<key>_upper``) in pp: ``40.0 [30.0, 50.0]``."""
    return f"{100 * r[key]:.1f} [{100 * r[key + '_lower']:.1f}, {100 * r[key + '_upper']:.1f}]"


def gap_text(r: dict, prefix: str = "phase") -> str:
    """A row's ``<prefix>`` gap in a check's words: ``gap 40.0 pp [30.0, 50.0]``."""
    g = f"{prefix}_gap"
    return f"gap {100 * r[g]:.1f} pp [{100 * r[g + '_lower']:.1f}, {100 * r[g + '_upper']:.1f}]"


def per_phase_column(width: int, decimals: int, gap: str = "  ", sep: str = "  ") -> Column:
    """The per-phase accuracy column: each phase's accuracy in % with ``decimals``, then ``(S=<stride>)``."""

    def cell(r: dict) -> str:
        return " / ".join(f"{100 * a:.{decimals}f}" for a in r["per_phase"]) + f"{sep}(S={r['stride']})"

    return Column("per-phase accuracy % (phase = pos mod S)", cell, width, "<", gap)


# the cell of each statistic of a grouping's gap (``<grouping>_gap`` ... in ``result_row``), by name
GAP_CELLS: dict[str, Callable[[str], Callable[[dict], str]]] = {
    "gap": lambda g: lambda r: interval_text(r, f"{g}_gap"),
    "p": lambda g: lambda r: f"{r[f'{g}_p_value']:.4f}",
    "floor": lambda g: lambda r: f"{100 * r[f'{g}_noise_floor']:.1f}",
    "upper": lambda g: lambda r: pp(r[f"{g}_upper_one_sided"]),
    "mde": lambda g: lambda r: pp(r[f"{g}_mde"]),
    "verdict": lambda g: lambda r: str(r[f"{g}_verdict"]),
}


def gap_columns(grouping: str, stats: str, headers: Sequence[str], widths: Sequence[int]) -> tuple[Column, ...]:
    """Columns of the gap statistics of ``grouping`` (``phase`` or ``residue``): ``stats`` names them in order
    (space-separated keys of ``GAP_CELLS``), with their ``headers`` and ``widths``."""
    return tuple(Column(h, GAP_CELLS[s](grouping), w) for s, h, w in zip(stats.split(), headers, widths, strict=True))


# the phase gap's statistics in the compact tables (make robust's, make selection's)
COMPACT_PHASE_COLUMNS = gap_columns(
    "phase",
    "gap floor p upper mde verdict",
    ("phase gap pp [95%]", "floor", "p", "<= pp", "MDE", "verdict"),
    (19, 5, 6, 5, 5, 9),
)
STUDY_COLUMNS = (
    Column("model", lambda r: r["label"], 22, "<", ""),
    Column("steps", lambda r: f"{r['steps']:d}", 6),
    Column("train s", lambda r: f"{r['train_seconds']:.0f}", 8),
    Column("mean %", lambda r: f"{100 * r['mean']:.1f}", 7),
    per_phase_column(44, 1),
    *gap_columns(
        "phase",
        "gap p floor upper mde verdict",
        ("gap pp [95%]", "perm p", "floor pp", "<= pp", "MDE pp", "verdict"),
        (20, 7, 8, 5, 6, 9),
    ),
    Column("period", lambda r: str(r["dominant_period"]), 6),
)


def table(done: list[dict], learned: Optional[list[bool]] = None) -> str:
    """The per-phase table (make demo, make demo-grid, make demo-v4), one line per run: mean, per-phase accuracy,
    phase gap (mod S) with interval, permutation p and noise floor, the gap's one-sided 95% upper bound, the minimum
    detectable gap (80% power), the verdict (gap / flat / undecided, ``ckv.eval.flatness.gap_verdict``), the dominant
    period, and with ``learned`` (one flag per run) a last column ``learned``: ``yes`` or ``NO``."""
    rows = [{**result_row(d), "label": d["run"].label} for d in done]
    columns = STUDY_COLUMNS
    if learned is not None:
        rows = [{**r, "learned": flag} for r, flag in zip(rows, learned)]
        columns += (Column("learned", lambda r: "yes" if r["learned"] else "NO", 0, "<", "  "),)
    return write_table(rows, columns)


def every_seed(claim: str, seeds: Sequence[int], passed: Sequence[bool], details: Sequence[str]) -> Check:
    """A criterion that must hold in every seed: passed when it holds in each, its detail ``seed <s>: ...``."""
    return Check(claim, all(passed), "; ".join(f"seed {s}: {d}" for s, d in zip(seeds, details)))


def control_learned(r: dict) -> bool:
    """Whether a control (its ``result_row``) has learned the task: its mean reaches ``CONTROL_LEARNED``."""
    return r["mean"] >= CONTROL_LEARNED


def run_records(done: list[dict], task: str = TASK) -> list[dict]:
    """The runs as a study's JSON record lists them: label, role, folder, budget, results file."""
    return [
        {
            "label": d["run"].label,
            "role": d["run"].role,
            "dir": str(d["dir"]),
            "steps": d["steps"],
            "train_seconds": d["train_seconds"],
            "results": str(results_file(d["dir"], task)),
        }
        for d in done
    ]


def exit_code(checks: list[Check], quick: bool) -> int:
    """1 when a science check failed, else 0 (no checks: 0). Quick mode (a pipeline check whose thresholds are not
    expected to hold) always gives 0."""
    return 0 if quick or all(c.passed for c in checks) else 1


def write_study_record(out: Path, name: str, quick: bool, clock: Timer, png: Optional[Path], record: dict) -> None:
    """A study's last step (``make robust``, ``make selection``, the generic command): ``<out>/<name>.json`` holds
    ``quick``, the seconds so far, ``record`` and the plot's path (``None``: no plot); then the quick-mode warning
    and where everything is."""
    path = out / f"{name}.json"
    plot = None if png is None else str(png)
    write_json(path, {"quick": quick, "seconds": time.monotonic() - clock.start, **record, "plot": plot})
    if quick:
        print("quick mode: a few steps per model; the numbers above check the pipeline, not the science")
    print(f"[{clock}] {'' if png is None else f'plot: {png}; '}record: {path}")


def default_workers() -> int:
    """Models trained at once unless a study says otherwise: one per core, at most two (each job has one thread)."""
    return min(2, os.cpu_count() or 1)


def study_arguments(
    doc: str, out: str, quick_help: str = "a few steps per model: pipeline check only"
) -> argparse.ArgumentParser:
    """The options every study's command shares: ``--out``, ``--workers`` (models trained at once), ``--quick``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out, help=f"output folder (default: {out})")
    ap.add_argument("--workers", type=int, default=default_workers(), help="models trained at once")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    return ap


def dry_run(study: Study, out: Path, quick: bool) -> list[str]:
    """The jobs the study would run, one line each: every run's train command, its eval commands, then the
    analyses of its role."""
    lines = []
    for run in study.runs:
        lines.append(f"train {run.label}: {' '.join(train_command(run, out, quick, study.launcher))}")
        for key, (_, cmd) in eval_commands(run, out, quick, study.task, study.evals).items():
            lines.append(f"eval  {run.label} [{key}]: {' '.join(cmd)}")
        for a in study.analyses:
            if a.applies_to(run):
                lines.append(
                    f"analyse {run.label} [{a.name}]: {' '.join(analysis_command(study, run, a, out, quick)[1])}"
                )
    return lines


def n_jobs(study: Study) -> int:
    """How many jobs the study runs: per run, its training, its evaluations and the analyses of its role."""
    per_run = 1 + len(eval_names(study.task, study.evals))
    return sum(per_run + sum(a.applies_to(r) for a in study.analyses) for r in study.runs)


def study_report(study: Study) -> Optional[Any]:
    """The study's ``report`` function (``module:function``), or ``None`` when it declares none."""
    if not study.report:
        return None
    module, _, name = study.report.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"conf/study/{study.name}.yaml: report {study.report!r} cannot be loaded ({e})") from e


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ckv.apps.study NAME``: run any conf/study/NAME.yaml (module docstring)."""
    ap = study_arguments(__doc__, "the study's out")
    ap.add_argument("name", help="a study: conf/study/<name>.yaml")
    ap.add_argument("--scale", default="", help="one of the study's scales (default: its own)")
    ap.add_argument("--dry-run", action="store_true", help="print the jobs (train and eval commands); run nothing")
    ap.set_defaults(out=None, workers=None)
    args = ap.parse_args(argv)
    try:
        study = load_study(args.name, args.scale)
        report = study_report(study)
    except ConfigError as e:
        print(error_message(str(e)), file=sys.stderr)
        return 2
    out = Path(args.out or study.out).resolve()
    if study.launcher and not args.dry_run:
        print(
            error_message(
                f"scale {args.scale!r} submits through the {study.launcher} launcher: use --dry-run here and "
                "submit its train jobs on the cluster"
            ),
            file=sys.stderr,
        )
        return 2
    if args.dry_run:
        print("\n".join(dry_run(study, out, args.quick)))
        print(f"{len(study.runs)} runs, {n_jobs(study)} jobs")
        return 0
    workers = args.workers or study.workers_for(len(study.runs))
    clock, env = start(study, study.runs, out, args.quick, workers)
    done = run_plan(study.runs, out, args.quick, workers, env, clock, study.task, study.evals, keep_going=True)
    failed = [d for d in done if "error" in d]
    ok = [d for d in done if "error" not in d]
    analyses = run_analyses(study, ok, out, args.quick, workers, env, clock)
    for key in eval_names(study.task, study.evals):
        print(f"\n{key}:\n" + table([{**d, "results": d["evaluations"][key]} for d in ok]))
    checks, extra = report(study, ok, out, args.quick) if report is not None and ok else ([], {})
    for d in failed:
        print(f"FAILED {d['run'].label}: {d['error'].splitlines()[0]} (log: {out / 'logs'})")
    failed_analyses = [a for a in analyses if "error" in a]
    for a in failed_analyses:
        print(f"FAILED {a['label']} {a['analysis']}: {a['error'].splitlines()[0]} (log: {out / 'logs'})")
    record = {"all_passed": all(c.passed for c in checks), "checks": [c.__dict__ for c in checks]}
    record["runs"] = run_records(ok, next(iter(eval_names(study.task, study.evals).values())))
    record["failed"] = [{"label": d["run"].label, "error": d["error"]} for d in failed]
    record |= {"analyses": analyses, **extra}
    write_study_record(out, study.record, args.quick, clock, None, record)
    return 1 if failed or failed_analyses else exit_code(checks, args.quick)


if __name__ == "__main__":
    sys.exit(main())
