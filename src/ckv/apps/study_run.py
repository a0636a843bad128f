"""The studies' runner: ``run_plan`` trains every run with ``train.py`` (a finished folder is resumed, i.e. reused)
and evaluates it with ``eval.py`` (``train_command``, ``eval_commands``), ``workers`` at a time; ``run_analyses``
runs a study's ``eval.py analysis=<name>`` on the finished runs (an analysis that does not apply is skipped with one
line); evaluations and analyses written by the same command line at the same commit after the run's last
checkpoint are reused (``is_current``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ckv.apps.cli import EXIT_NOT_APPLICABLE
from ckv.apps.study_config import ROOT, TASK, Analysis, Run, Study
from ckv.eval.summary import results_file
from ckv.io.layout import STATE_FILE, analysis_file, eval_dir, latest_checkpoint, list_checkpoints, read_run_config
from ckv.io.results import read_json
from ckv.train.run import git_info

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
# (``limit``: eval.py's cap on base examples, which the lookup's n_base and the needle's prompts per residue both obey)
QUICK_EVAL = ("limit=64", "stats.n_bootstrap=200", "stats.n_permutations=200")


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
    ``task``, on ``task`` (the run's own ``task`` when it names one); else one per entry, named ``<task>_<name>``
    (its own results folder), with its overrides."""
    task = run.task or task  # a run scored on another task than the study's
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


def command_file(path: Path) -> Path:
    """The file beside ``path`` (an evaluation's or analysis' results) that holds the command line which wrote it and
    the code's commit."""
    return path.with_name(path.name + ".command.json")


def code_version() -> Optional[str]:
    """The checkout's commit, None when it is unknown or has uncommitted changes (results it writes are never
    reused: the code that made them cannot be named)."""
    info = git_info(ROOT)
    return None if info["git_dirty"] is not False else info["git_sha"]


def same_command(a: list[str], b: list[str]) -> bool:
    """Whether two job command lines do the same thing: the same program (the arguments before the first
    ``key=value``) with the same Hydra overrides, in any order; order matters only between overrides of one key, so
    lines that set a key twice must be equal. Two studies that spell one evaluation's overrides in another order
    (make paper's and make mitigate's unmitigated lookups) share its results."""
    if a == b:
        return True

    def split(cmd: list[str]) -> tuple[list[str], Optional[list[str]]]:
        i = next((j for j, arg in enumerate(cmd) if "=" in arg), len(cmd))
        keys = [arg.split("=", 1)[0] for arg in cmd[i:]]
        return cmd[:i], sorted(cmd[i:]) if len(set(keys)) == len(keys) else None

    (pa, oa), (pb, ob) = split(a), split(b)
    return pa == pb and oa is not None and oa == ob


def is_current(rdir: Path, path: Path, stamp: dict) -> bool:
    """Whether ``path`` (an evaluation's or analysis' results in run folder ``rdir``) was written after the run's last
    checkpoint by the command (``same_command``) and commit in ``stamp`` (its ``command_file``): a rerun reuses it
    (train.py rewrites the final weights when it resumes a finished run, never the checkpoint it resumed from);
    results of another command line (other overrides, another task), of other code or of an earlier model are not."""
    ckpt, written = latest_checkpoint(rdir), command_file(path)
    if not (
        stamp["code"] is not None
        and path.is_file()
        and written.is_file()
        and ckpt is not None
        and path.stat().st_mtime > (ckpt / STATE_FILE).stat().st_mtime
    ):
        return False
    old = json.loads(written.read_text())
    return old.get("code") == stamp["code"] and same_command(old.get("command", []), stamp["command"])


def run_unless_current(cmd: list[str], log: Path, env: dict, rdir: Path, path: Path) -> bool:
    """Run ``cmd`` (``run_command``) unless ``path``, its results, is current for it at this commit (``is_current``);
    once it succeeds, record the command and commit in ``path``'s ``command_file``. Returns whether it ran."""
    stamp = {"command": cmd, "code": code_version()}
    if is_current(rdir, path, stamp):
        return False
    command_file(path).unlink(missing_ok=True)
    run_command(cmd, log, env)
    command_file(path).parent.mkdir(parents=True, exist_ok=True)
    command_file(path).write_text(json.dumps(stamp))
    return True


def train_and_evaluate(
    run: Run,
    out: Path,
    quick: bool,
    env: dict,
    clock: Timer,
    task: str = TASK,
    evals: Optional[dict[str, tuple[str, ...]]] = None,
) -> dict:
    """Train one model with ``train.py`` (resuming if its folder exists), then evaluate it with ``eval.py``
    (``eval_commands``; an evaluation still current for its command is not rerun: ``run_unless_current``). Returns
    ``{"run", "dir", "train_seconds", "steps", "results", "evaluations"}`` (``results``: the first evaluation's
    report; ``evaluations``: every report by evaluation name)."""
    t0 = time.monotonic()
    rdir = run_dir(out, run)
    run_command(train_command(run, out, quick), log_file(out, run, "train"), env)
    train_s = time.monotonic() - t0
    reports = {}
    for key, (name, cmd) in eval_commands(run, out, quick, task, evals).items():
        results = results_file(rdir, name)
        run_unless_current(cmd, log_file(out, run, "eval" if name == task else f"eval_{key}"), env, rdir, results)
        reports[key] = read_json(results)["results"]
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
    lets the others finish and records a failed run as ``{"run", "dir", "error"}``."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(train_and_evaluate, r, out, quick, env, clock, task, evals): r for r in plan}
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
    overrides, so its results sit in that evaluation's folder) with the analysis' ``overrides`` (``past_quick``),
    and the analysis' results file."""
    task_name, cmd = next(iter(eval_commands(run, out, quick, study.task, study.evals).values()))
    return analysis_file(eval_dir(run_dir(out, run), task_name), analysis.name), [
        *cmd,
        f"analysis={analysis.name}",
        *past_quick(analysis.overrides, quick),
    ]


Outcome = tuple[tuple, Optional[dict], Optional[BaseException]]  # a pooled job, its result, its failure


def _in_pool(jobs: list[tuple], one: Callable[..., dict], workers: int) -> list[Outcome]:
    """``one(*job)`` for every job, ``workers`` at a time: ``(job, result, exception)`` per job in order (a failed
    job's result is None; the others go on)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(one, *job) for job in jobs]
    return [(job, None if f.exception() else f.result(), f.exception()) for job, f in zip(jobs, futures)]


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
            run_unless_current(cmd, log_file(out, run, a.name), env, d["dir"], path)
        except CommandFailed as e:
            if e.returncode != EXIT_NOT_APPLICABLE:
                raise
            print(f"[{clock}] {run.label}: {a.name} skipped, it does not apply ({e.last_line})", flush=True)
            return {**record, "skipped": e.last_line}
        print(f"[{clock}] {run.label}: {a.name} done", flush=True)
        return {**record, "file": str(path)}

    jobs = [(d, a) for d in done for a in study.analyses if a.applies_to(d["run"])]
    records = []
    for (d, a), result, error in _in_pool(jobs, one, workers):
        if error is None:
            records.append(result)
        else:
            print(f"[{clock}] {d['run'].label}: {a.name} FAILED ({str(error).splitlines()[0]})", flush=True)
            records.append({"label": d["run"].label, "analysis": a.name, "error": str(error)})
        d.setdefault("analyses", {})[a.name] = records[-1]
    return records


def past_quick(overrides: tuple[str, ...], quick: bool) -> tuple[str, ...]:
    """A study key's eval overrides (an analysis', the checkpoint evaluations') as they follow an evaluation's
    command: under ``quick`` those of keys ``QUICK_EVAL`` sets are left out (a pipeline check keeps its own few
    prompts)."""
    quick_keys = {q.split("=", 1)[0] for q in QUICK_EVAL} if quick else set()
    return tuple(o for o in overrides if o.split("=", 1)[0] not in quick_keys)


def checkpoint_command(study: Study, run: Run, out: Path, quick: bool, step: object) -> tuple[str, list[str]]:
    """The study's ``checkpoints.eval`` evaluation of ``run`` at checkpoint ``step`` (a step, or a placeholder for
    the dry run): its task name and ``eval.py`` command, the key's ``overrides`` (``past_quick``) and
    ``model.step=<step>`` added."""
    assert study.checkpoints is not None
    name, cmd = eval_commands(run, out, quick, study.task, study.evals)[study.checkpoints.eval]
    return name, [*cmd, *past_quick(study.checkpoints.overrides, quick), f"model.step={step}"]


def checkpoint_commands(study: Study, run: Run, out: Path, quick: bool) -> list[tuple[int, Path, list[str]]]:
    """For each kept checkpoint of ``run`` (already trained), ``(step, results file, eval.py command)`` of
    ``checkpoint_command`` (results in the checkpoint's own ``eval/<task name>/``)."""
    found = []
    for step, path in list_checkpoints(run_dir(out, run)):
        name, cmd = checkpoint_command(study, run, out, quick, step)
        found.append((step, results_file(path, name), cmd))
    return found


def _evaluate_in_pool(
    jobs: list[tuple[dict, str, Path, list[str]]], out: Path, workers: int, env: dict, clock: Timer
) -> list[Optional[dict]]:
    """Each job ``(done record, stage, results file, eval.py command)`` run unless current (``run_unless_current``;
    its log ``eval_<stage>``), ``workers`` at a time: each job's report in order, ``None`` for a failed one (printed;
    the others go on)."""

    def one(d: dict, stage: str, path: Path, cmd: list[str]) -> dict:
        run_unless_current(cmd, log_file(out, d["run"], f"eval_{stage}"), env, d["dir"], path)
        return read_json(path)["results"]

    reports = []
    for (d, stage, _, _), result, error in _in_pool(jobs, one, workers):
        if error is not None:
            print(f"[{clock}] {d['run'].label} {stage}: FAILED ({str(error).splitlines()[0]})", flush=True)
        reports.append(result)
    return reports


def run_checkpoint_evals(
    study: Study, done: list[dict], out: Path, quick: bool, workers: int, env: dict, clock: Timer
) -> None:
    """The study's ``checkpoints`` evaluations on the finished runs (``done``) they apply to, ``workers`` at a time
    (one still current is not rerun: ``run_unless_current``); each run's reports go under its ``done`` record's
    ``checkpoints``, by step. A failed evaluation is printed and left out (the others go on)."""
    if study.checkpoints is None:
        return
    jobs = [
        (d, step, path, cmd)
        for d in done
        if study.checkpoints.applies_to(d["run"])
        for step, path, cmd in checkpoint_commands(study, d["run"], out, quick)
    ]
    reports = _evaluate_in_pool([(d, f"step{step}", p, c) for d, step, p, c in jobs], out, workers, env, clock)
    for (d, step, _, _), report in zip(jobs, reports):
        if report is not None:
            d.setdefault("checkpoints", {})[step] = report
    print(f"[{clock}] evaluated {len(jobs)} checkpoints", flush=True)


def probe_command(study: Study, run: Run, out: Path, quick: bool) -> tuple[Path, list[str]]:
    """The study's ``probes`` task on ``run``: its results file (the run's ``eval/<task>/``) and ``eval.py``'s
    command line (the run's eval overrides, e.g. a control's ``task.stride``, included)."""
    assert study.probes is not None
    task = study.probes.task
    _, cmd = eval_commands(dataclasses.replace(run, task=task), out, quick)[task]
    return results_file(run_dir(out, run), task), cmd


def run_probe_evals(
    study: Study, done: list[dict], out: Path, quick: bool, workers: int, env: dict, clock: Timer
) -> None:
    """The study's ``probes`` task on the finished runs (``done``) it applies to, ``workers`` at a time (one still
    current is not rerun); each report goes under its run's ``done`` record as ``probe``. A failed one is printed and
    left out (the others go on)."""
    if study.probes is None:
        return
    task, runs = study.probes.task, [d for d in done if study.probes.applies_to(d["run"])]
    jobs = [(d, task, *probe_command(study, d["run"], out, quick)) for d in runs]
    for d, report in zip(runs, _evaluate_in_pool(jobs, out, workers, env, clock)):
        if report is not None:
            d["probe"] = report
    print(f"[{clock}] {task} on {len(jobs)} runs", flush=True)


def start(study: Study, runs: tuple[Run, ...], out: Path, quick: bool, workers: int) -> tuple[Timer, dict]:
    """Print the study's first line and return its clock and the jobs' environment."""
    print(
        f"ckv {study.title} -> {out}: {len(runs)} models, {workers} at a time"
        f"{' (quick: pipeline check, not the science)' if quick else ''}",
        flush=True,
    )
    return Timer(), job_env()
