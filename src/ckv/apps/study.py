"""The one runner of ckv's studies: a study is a YAML in ``conf/study/`` (its runs, seeds and criteria numbers) and at
most a small module (its science checks, extra tables and plots).

``make demo``, ``make demo-grid``, ``make demo-v4``, ``make robust`` (``-confirm``, ``-ablation``) and ``make
selection`` all go through here, in three modules beside this command: ``ckv.apps.study_config`` (``load_study`` reads
``conf/study/<name>.yaml``), ``ckv.apps.study_run`` (``run_plan`` trains every run with ``train.py``, a finished
folder resumed, i.e. reused, and evaluates it with ``eval.py`` on the study's lookup task, ``workers`` at a time) and
``ckv.apps.study_results`` (``result_row``, the one row of a run's results every table, criterion and record reads;
``table``, the per-phase table; ``write_study_record`` writes ``<out>/<record>.json``).

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
                                  # experiment: this run's phases are read mod that run's model's stride), task
                                  # (this run's eval.py task instead of the study's)
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
    checkpoints:            # one of the evaluations repeated on every kept checkpoint of the runs whose label
      {runs: ["w8s8/*"], eval: prefix, overrides: [limit=144]}   # matches (model.step=<step>), overrides added:
                                                                  # the numbers over training
    probes:                 # a second eval.py task run once on every finished run whose label matches (its
      {runs: ["w8s8/*"], task: probe_bible}   # results in the run's eval/<task>/), e.g. the filler-length probe

The generic command runs any of them: ``python -m ckv.apps.study NAME [--quick] [--out DIR] [--workers N]
[--scale S] [--runs PATTERN,...] [--dry-run]`` (``main``; ``NAME``: a YAML of ``conf/study/`` by its name, never a
path; ``--runs``: only the runs whose label, e.g. ``w8s8/seed=42``, matches one of the fnmatch patterns,
``select_runs``). Its arguments, the YAML (syntax, keys, at least one run) and ``--out`` (a folder this user can
write) are checked before anything runs, each refusal one ``ckv: error:`` line with exit code 2. A failed run is
reported and the others go on; a rerun reuses finished training (train.py resumes a finished folder) and evaluations
and analyses written by the same command line at the same commit (a clean checkout) after the run's last checkpoint
(``study_run.is_current``). An analysis that does not apply to a run (eval.py's ``EXIT_NOT_APPLICABLE``: no gates,
W != S) is skipped with one line.

A model without a stride (full attention) has no phase of its own: ``phase_of`` names the run it is compared with,
and its evaluation groups positions mod that run's stride (``task.stride=S`` added after its own eval overrides),
as that run's attention declares it (``ckv.attention.model_phase_stride``) for the config ``train.py`` composes; a
study never restates a model's stride. Values are OmegaConf: ``${params.n_base}`` interpolates. The "control
learned" bar every study's control is judged against is not one study's number: ``CONTROL_LEARNED``
(``ckv.apps.study_results``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

from ckv.apps.study_config import Study, default_workers, known_studies, load_study, select_runs
from ckv.apps.study_results import exit_code, run_records, table, write_study_record
from ckv.apps.study_run import (
    analysis_command,
    checkpoint_command,
    eval_commands,
    eval_names,
    probe_command,
    run_analyses,
    run_checkpoint_evals,
    run_plan,
    run_probe_evals,
    start,
    train_command,
)
from ckv.checks import ConfigError, error_message
from ckv.io.access import check_output_dir

EXIT_USER_ERROR = 2


def check_out(out: Path) -> Path:
    """A study's output folder, checked before anything runs (``ckv.io.access.check_output_dir``): ``ConfigError``,
    one line, for a file, a folder this user can not write, a path that can not be made."""
    return check_output_dir(out, f"--out {str(out)!r}", "give a folder you can write to: --out DIR")


def workers_count(text: str) -> int:
    """``--workers``: a whole number >= 1 (models trained at once)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of models trained at once: give a whole number >= 1"
        )
    return n


class StudyArgumentParser(argparse.ArgumentParser):
    """The study commands' parser: a bad argument is one ``ckv: error:`` line (exit code 2), and a given ``--out``
    is checked (``check_out``) as it is parsed, before any study work (not for ``--dry-run``, which writes
    nothing)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, error_message(f"{message} (see --help)") + "\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "out", None) is not None and not getattr(parsed, "dry_run", False):
            try:
                check_out(Path(parsed.out))
            except ConfigError as e:
                self.exit(EXIT_USER_ERROR, error_message(str(e)) + "\n")
        return parsed


def study_arguments(
    doc: str, out: str, quick_help: str = "a few steps per model: pipeline check only"
) -> argparse.ArgumentParser:
    """The options every study's command shares: ``--out``, ``--workers`` (models trained at once, >= 1),
    ``--quick``; errors are one line (``StudyArgumentParser``)."""
    ap = StudyArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out, help=f"output folder (default: {out})")
    ap.add_argument(
        "--workers", type=workers_count, default=default_workers(), help="models trained at once (a number >= 1)"
    )
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
        if study.checkpoints is not None and study.checkpoints.applies_to(run):
            cmd = checkpoint_command(study, run, out, quick, "<step>")[1]
            lines.append(f"eval  {run.label} [{study.checkpoints.eval}] of every kept checkpoint: {' '.join(cmd)}")
        if study.probes is not None and study.probes.applies_to(run):
            lines.append(f"probe {run.label}: {' '.join(probe_command(study, run, out, quick)[1])}")
    return lines


def n_jobs(study: Study) -> int:
    """How many jobs the study runs: per run, its training, its evaluations, the analyses of its role and its probe
    (checkpoint evaluations not counted: how many depends on the checkpoints kept)."""
    per_run = 1 + len(eval_names(study.task, study.evals))
    probes = study.probes
    return sum(
        per_run + sum(a.applies_to(r) for a in study.analyses) + (probes is not None and probes.applies_to(r))
        for r in study.runs
    )


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
    ap.add_argument(
        "name",
        metavar="NAME",
        help="a study: the name of a YAML in conf/study/ without .yaml, not a path (one of "
        f"{', '.join(known_studies())})",
    )
    ap.add_argument("--scale", default="", help="one of the study's scales (default: its own)")
    ap.add_argument("--dry-run", action="store_true", help="print the jobs (train and eval commands); run nothing")
    ap.add_argument(
        "--runs",
        default="",
        metavar="PATTERN[,PATTERN...]",
        help="only the runs whose label matches one of these fnmatch patterns (e.g. 'full_kv1/*,w8s8/seed=42')",
    )
    ap.set_defaults(out=None, workers=None)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve() if args.out is not None else None
    try:
        study = load_study(args.name, args.scale)
        study = select_runs(study, args.runs) if args.runs else study
        report = study_report(study)
        if not study.runs:
            raise ConfigError(
                f"conf/study/{study.name}.yaml declares no runs: nothing to train; add runs: [{{experiment: ..., "
                "role: ...}] (a study whose module makes its runs has its own command, e.g. python -m ckv.apps.robust)"
            )
        if out is None:
            out = Path(study.out).resolve()
            if not args.dry_run:
                check_out(out)
    except ConfigError as e:
        print(error_message(str(e)), file=sys.stderr)
        return EXIT_USER_ERROR
    if study.launcher and not args.dry_run:
        print(
            error_message(
                f"scale {args.scale!r} submits through the {study.launcher} launcher: use --dry-run here and "
                "submit its train jobs on the cluster"
            ),
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
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
    run_checkpoint_evals(study, ok, out, args.quick, workers, env, clock)
    run_probe_evals(study, ok, out, args.quick, workers, env, clock)
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
