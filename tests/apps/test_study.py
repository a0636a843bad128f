"""The study runner: every conf/study YAML loads into the runs its command trains, a bad YAML is one line, and
the one results row every table reads."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from ckv.apps import study_config, study_run
from ckv.apps.cli import EXIT_NOT_APPLICABLE
from ckv.apps.study import main
from ckv.apps.study_config import Run, load_study
from ckv.apps.study_results import Check, check_lines, exit_code, result_row
from ckv.apps.study_run import (
    CommandFailed,
    Timer,
    command_file,
    job_env,
    run_analyses,
    run_command,
    same_command,
)
from ckv.checks import ConfigError
from ckv.eval.summary import results_file
from ckv.io.layout import CHECKPOINTS_DIR, CONFIG_FILE, STATE_FILE, latest_checkpoint, step_dir_name
from ckv.io.results import write_json
from tests.helpers import as_other_user, assert_documented

from .helpers import finished

STUDIES = sorted(p.stem for p in study_config.STUDY_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_loads_with_existing_experiments_and_distinct_run_folders(name):
    s = load_study(name)
    assert s.out and s.record and s.title and s.seeds
    for r in s.runs:
        assert (study_config.ROOT / "conf" / "experiment" / f"{r.experiment}.yaml").is_file(), r
    assert len({(r.name or r.experiment, r.seed) for r in s.runs}) == len(s.runs)
    assert all(isinstance(v, float) for v in s.criteria.values())


def test_a_base_study_is_merged_under_its_variant():
    robust, confirm = load_study("robust"), load_study("robust_confirm")
    assert confirm.params["tasks"] == robust.params["tasks"] and confirm.title == robust.title == "robust"
    assert confirm.criteria == {**robust.criteria, "noninferiority_margin": 0.05}
    assert confirm.seeds == (100, 101, 102) and confirm.out != robust.out
    assert load_study("robust_ablation").params["models"] == robust.params["ladder"]  # an interpolation


def test_runs_are_every_declared_run_once_per_seed_and_workers_follow_the_study(tmp_path, monkeypatch):
    (tmp_path / "two.yaml").write_text(
        "out: outputs/two\nseeds: [3, 4]\nworkers: all\nparams: {n_base: 8}\nruns:\n"
        "  - {experiment: demo_gate_s4, role: gate, train: attention.stride=2 attention.window=2}\n"
        "  - {name: ctrl, experiment: demo_full, role: control, entry: [-m, x],\n"
        "     eval: ['task.n_base=${params.n_base}'], phase_of: demo_gate_s4}\n"
    )
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    s = load_study("two")
    assert [(r.label, r.seed) for r in s.runs] == [
        ("gate_s4/seed=3", 3),
        ("gate_s4/seed=4", 4),
        ("ctrl/seed=3", 3),
        ("ctrl/seed=4", 4),
    ]
    assert s.runs[0].train_overrides == ("attention.stride=2", "attention.window=2") and s.runs[0].entry == (
        "train.py",
    )
    # the control's phases are read mod the compared run's stride (2, as its train overrides make it)
    ctrl = Run("demo_full", 3, "control", (), ("task.n_base=8", "task.stride=2"), name="ctrl", entry=("-m", "x"))
    assert s.runs[2] == ctrl
    assert (s.title, s.record, s.task, s.workers_for(4)) == ("two", "two", study_config.TASK, 4)


@pytest.mark.parametrize(
    "text, message",
    [
        ("out: o\nrun: []\n", "unknown keys ['run']"),
        ("seeds: [0]\n", "no out"),
        ("out: o\nseeds: [1, 1]\n", "distinct integers >= 0"),
        ("out: o\nruns:\n  - {experiment: demo_full}\n", "a run takes experiment, role"),
        ("out: o\nruns:\n  - {experiment: demo_full, role: c, train: [1]}\n", "overrides are a list of strings"),
        ("out: o\nworkers: 0\n", "workers 0"),
        ("out: o\nruns:\n  - {experiment: demo_full, role: c, phase_of: x}\n", "phase_of='x' is not a run"),
        ("out: o\nruns:\n  - {experiment: demo_full, role: c, phase_of: demo_full}\n", "has no stride"),
        ("out: o\nanalyses: {knockot: {}}\n", "no analysis 'knockot' in conf/eval/analysis"),
        ("out: o\nanalyses: {gates: {role: [x]}}\n", "an analysis takes roles"),
        (
            "out: o\nruns:\n  - {experiment: nothing, role: c}\n"
            "  - {experiment: demo_full, role: c, phase_of: nothing}\n",
            "phase_of='nothing': its config does not compose",
        ),
    ],
)
def test_a_bad_study_is_one_line(text, message, tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text(text)
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_study("bad")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no study 'nothing'"):
        load_study("nothing")


@pytest.mark.parametrize("name", STUDIES)
def test_no_study_restates_a_models_stride(name):
    """A control's phases are read mod the compared model's stride (``phase_of``), never a number the study
    repeats: no ``task.stride`` override and no ``control_stride`` in conf/study."""
    text = (study_config.STUDY_DIR / f"{name}.yaml").read_text()
    assert "task.stride" not in text and "control_stride" not in text


def test_result_row_reads_the_report_once_for_every_table():
    d = finished(Run("demo_full", 0, "control"), stride=8, mean=0.9, phase_gap=0.02, dominant_period=4)
    r = result_row(d)
    assert (r["role"], r["seed"], r["steps"], r["stride"], r["mean"], r["phase_gap"]) == (
        "control",
        0,
        12,
        8,
        0.9,
        0.02,
    )
    assert r["per_phase"] == [0.9] * 8 and r["dominant_period"] == 4 and r["residue_gap"] == 0.0
    assert {"phase_verdict", "phase_mde", "residue_upper_one_sided"} <= set(r)  # the flatness fields of both gaps


def test_check_lines_name_each_outcome_in_the_studys_words():
    checks = [Check("a", True, "x"), Check("b", False, "y"), Check("c", False, "z", decided=False)]
    assert check_lines(checks, ("MET", "not met")) == ["  [MET] a: x", "  [not met] b: y", "  [undecided] c: z"]
    assert check_lines(checks[2:], ("PASS", "FAIL", "open")) == ["  [open] c: z"]


def test_the_exit_code_is_1_only_for_a_decided_failure():
    """An undecided claim is an answer (make paper's unlearned variants), not an error: only a decided FAIL gives 1."""
    passed, failed, undecided = Check("a", True, "x"), Check("b", False, "y"), Check("c", False, "z", decided=False)
    assert [exit_code(c, quick=False) for c in ([], [passed], [passed, undecided], [undecided, failed])] == [0, 0, 0, 1]
    assert exit_code([failed], quick=True) == 0


def test_a_run_may_declare_its_own_seeds_and_a_scale_swaps_params_and_adds_overrides(tmp_path, monkeypatch):
    (tmp_path / "s.yaml").write_text(
        "out: o\nseeds: [1]\nparams: {experiment: demo_full, dims: 2}\n"
        "scales: {big: {launcher: slurm, params: {experiment: demo_gate_s4, dims: 16}, train: [x=1], eval: [y=2]}}\n"
        "runs:\n  - {experiment: '${params.experiment}', role: r, train: 'a=${params.dims}', seeds: [5, 6]}\n"
        "  - {experiment: '${params.experiment}', role: c}\n"
    )
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    own, big = load_study("s"), load_study("s", "big")
    assert [(r.experiment, r.seed, r.train_overrides) for r in own.runs] == [
        ("demo_full", 5, ("a=2",)),
        ("demo_full", 6, ("a=2",)),
        ("demo_full", 1, ()),
    ]
    assert [(r.experiment, r.train_overrides, r.eval_overrides) for r in big.runs][0] == (
        "demo_gate_s4",
        ("a=16", "x=1"),
        ("y=2",),
    )
    assert (own.launcher, big.launcher, big.scales) == ("", "slurm", ("big",))
    with pytest.raises(ConfigError, match="no scale 'huge'"):
        load_study("s", "huge")


def _instant_jobs(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """``study_run.run_command`` replaced by instant stand-ins of train.py and eval.py (the runner's real commands run
    in tests/apps/test_demo.py's quick demo); returns every command run, in order. train.py: a command with
    ``attention.stride=nonsense`` fails with its one-line error; a folder without a checkpoint gets what a finished
    run leaves (config.yaml and its last checkpoint, written a second earlier); a finished folder is resumed and left
    as it is, as train.py does (``test_a_finished_run_reruns_as_a_resume_that_rewrites_no_checkpoint`` in
    tests/train/test_train.py). eval.py: a lookup report (``finished``) in the results file of its task name."""
    ran = []

    def fake(cmd: list[str], log: Path, env: dict) -> None:
        ran.append(cmd)
        args = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        log.parent.mkdir(parents=True, exist_ok=True)
        if cmd[1] == "eval.py":
            rdir = Path(args["model.path"].strip("'"))
            report = finished(Run("demo_gate_s4", 0, "gate"))["results"]
            write_json(results_file(rdir, args.get("task.name", args["task"])), {"results": report})
            log.write_text("evaluated\n")
            return
        if args.get("attention.stride") == "nonsense":
            line = "ckv: error: attention.stride='nonsense' must be an integer"
            log.write_text(line + "\n")
            raise CommandFailed(f"command failed (1): {' '.join(cmd)}", 1, line)
        rdir = Path(args["hydra.run.dir"].strip("'"))
        if latest_checkpoint(rdir) is not None:
            log.write_text(f"resumed at step {args['trainer.max_steps']}\n")
            return
        state = rdir / CHECKPOINTS_DIR / step_dir_name(int(args["trainer.max_steps"])) / STATE_FILE
        state.parent.mkdir(parents=True)
        state.write_text("{}")
        os.utime(state, (time.time() - 1, time.time() - 1))
        (rdir / CONFIG_FILE).write_text(yaml.safe_dump({"trainer": {"max_steps": int(args["trainer.max_steps"])}}))
        log.write_text("fresh start\n")

    monkeypatch.setattr(study_run, "run_command", fake)
    monkeypatch.setattr(study_run, "code_version", lambda: "c0ffee")  # a clean checkout at one commit
    return ran


def test_the_generic_command_isolates_a_failed_run_and_reuses_finished_work(tmp_path, monkeypatch, capsys):
    """A tiny study: one run that trains, one whose config is wrong (train.py and eval.py stand-ins:
    ``_instant_jobs``). The wrong one is reported, the other finishes with both its evaluations; a rerun trains both
    again (a finished folder resumes) and reuses the evaluations written after the last checkpoint."""
    (tmp_path / "tiny.yaml").write_text(
        "out: o\ntask: demo_lookup\nevals: {a: [task.padding=prefix], b: [task.padding=in_sequence]}\nruns:\n"
        "  - {name: good, experiment: demo_gate_s4, role: gate}\n"
        "  - {name: bad, experiment: demo_gate_s4, role: gate, train: attention.stride=nonsense}\n"
    )
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    ran = _instant_jobs(monkeypatch)
    out = tmp_path / "out"
    assert main(["tiny", "--quick", "--out", str(out), "--workers", "2"]) == 1
    text = capsys.readouterr().out
    assert "FAILED bad/seed=0" in text and "good/seed=0: trained" in text
    assert sorted((c[1], c[2]) for c in ran) == [
        ("eval.py", f"model.path='{out}/runs/good/seed=0'"),
        ("eval.py", f"model.path='{out}/runs/good/seed=0'"),
        ("train.py", f"hydra.run.dir='{out}/runs/bad/seed=0'"),
        ("train.py", f"hydra.run.dir='{out}/runs/good/seed=0'"),
    ]
    record = json.loads((out / "tiny.json").read_text())
    assert [r["label"] for r in record["runs"]] == ["good/seed=0"] and record["failed"][0]["label"] == "bad/seed=0"
    good = out / "runs" / "good" / "seed=0"
    results = [good / "eval" / f"demo_lookup_{k}" / "results.json" for k in "ab"]
    assert all(r.is_file() for r in results)
    stamps = [r.stat().st_mtime_ns for r in results]
    first = len(ran)
    assert main(["tiny", "--quick", "--out", str(out), "--workers", "2"]) == 1
    assert sorted(c[1] for c in ran[first:]) == ["train.py", "train.py"]  # no evaluation again
    assert [r.stat().st_mtime_ns for r in results] == stamps

    def rerun_with(old: str, new: str) -> list[list[str]]:
        """Edit the study's YAML, run it again, return the commands of that run."""
        study = tmp_path / "tiny.yaml"
        study.write_text(study.read_text().replace(old, new))
        first = len(ran)
        assert main(["tiny", "--quick", "--out", str(out), "--workers", "2"]) == 1
        return ran[first:]

    # results written by another command line are not reused: evaluation b's overrides change, a's do not
    again = rerun_with("task.padding=in_sequence]", "task.padding=in_sequence, task.n_demos=4]")
    evals = [c for c in again if c[1] == "eval.py"]
    assert len(evals) == 1 and "task.name=demo_lookup_b" in evals[0] and "task.n_demos=4" in evals[0]
    assert results[0].stat().st_mtime_ns == stamps[0]
    assert json.loads(command_file(results[1]).read_text()) == {"command": evals[0], "code": "c0ffee"}
    # the same overrides in another order (another study's spelling of one evaluation) are the same command
    again = rerun_with("task.padding=in_sequence, task.n_demos=4]", "task.n_demos=4, task.padding=in_sequence]")
    assert sorted(c[1] for c in again) == ["train.py", "train.py"]
    # nor results of other code: another commit, or uncommitted changes (no commit names the code)
    for code in ("beef", None):
        monkeypatch.setattr(study_run, "code_version", lambda code=code: code)
        first = len(ran)
        assert main(["tiny", "--quick", "--out", str(out), "--workers", "2"]) == 1
        assert sorted(c[1] for c in ran[first:]) == ["eval.py", "eval.py", "train.py", "train.py"]


def test_same_command_ignores_the_order_of_distinct_overrides_only():
    run = [sys.executable, "eval.py", "model.path='r'", "task=lookup"]
    assert same_command([*run, "a=1", "b=2"], [*run, "b=2", "a=1"])
    assert not same_command([*run, "a=1", "a=2"], [*run, "a=2", "a=1"])  # the last of one key wins: order matters
    assert same_command([*run, "a=1", "a=2"], [*run, "a=1", "a=2"])
    assert not same_command([*run, "a=1"], [*run, "a=1", "b=2"])
    assert not same_command([sys.executable, "train.py", "a=1"], [sys.executable, "eval.py", "a=1"])


def test_a_failed_command_raises_with_its_exit_code_and_last_line(tmp_path):
    """``run_command`` on real processes: the output goes to the log; a non-zero exit raises ``CommandFailed`` with
    the code and the log's last line (a ckv one-line error), which a study prints."""
    log = tmp_path / "logs" / "job.log"
    with pytest.raises(CommandFailed) as e:
        run_command(
            [sys.executable, "-c", "print('working', flush=True); raise SystemExit('ckv: error: bad')"], log, job_env()
        )
    assert (e.value.returncode, e.value.last_line) == (1, "ckv: error: bad")
    assert log.read_text().splitlines() == ["working", "ckv: error: bad"]
    run_command([sys.executable, "-c", "print('done')"], log, job_env())
    assert log.read_text() == "done\n"


def test_analyses_run_on_their_roles_and_one_that_does_not_apply_is_skipped_with_one_line(
    tmp_path, monkeypatch, capsys
):
    """The study's ``analyses`` on finished runs (eval.py faked): each on the runs of its roles only; eval.py's
    ``EXIT_NOT_APPLICABLE`` is a skip with its one-line reason, any other failure an error that stops nothing."""
    (tmp_path / "a.yaml").write_text(
        "out: o\ntask: demo_lookup\nevals: {a: [task.padding=prefix], b: [task.padding=in_sequence]}\n"
        "analyses: {knockout: {}, gates: {roles: [gate, mean], eval: [analysis.checkpoints=none]}}\nruns:\n"
        "  - {name: g, experiment: demo_gate_s4, role: gate}\n  - {name: m, experiment: demo_gate_s4, role: mean}\n"
        "  - {name: f, experiment: demo_full, role: control}\n"
    )
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    s = load_study("a")
    ran = []

    def fake(cmd, log, env):
        ran.append(cmd)
        if "analysis=gates" in cmd and "m/seed=0" in cmd[2]:
            raise CommandFailed("failed", EXIT_NOT_APPLICABLE, "ckv: error: analysis=gates needs learned gates")
        if "analysis=knockout" in cmd and "f/seed=0" in cmd[2]:
            raise CommandFailed("command failed (1): boom", 1, "Traceback")

    monkeypatch.setattr(study_run, "run_command", fake)
    done = [{"run": r, "dir": study_run.run_dir(tmp_path, r)} for r in s.runs]
    records = run_analyses(s, done, tmp_path, False, 2, {}, Timer())
    assert [(r["label"], r["analysis"], sorted(set(r) & {"file", "skipped", "error"})) for r in records] == [
        ("g/seed=0", "knockout", ["file"]),
        ("g/seed=0", "gates", ["file"]),
        ("m/seed=0", "knockout", ["file"]),
        ("m/seed=0", "gates", ["skipped"]),
        ("f/seed=0", "knockout", ["error"]),
    ]
    assert done[1]["analyses"]["gates"]["skipped"] == "ckv: error: analysis=gates needs learned gates"
    assert records[1]["file"] == str(tmp_path / "runs/g/seed=0/eval/demo_lookup_a/gates/gates.json")
    assert all("task.padding=prefix" in c and "task.name=demo_lookup_a" in c for c in ran)  # the first evaluation
    assert ["analysis.checkpoints=none" in c for c in ran if "analysis=gates" in c] == [True, True]
    out = capsys.readouterr().out
    assert [x.split("] ", 1)[1] for x in out.splitlines() if "m/seed=0: gates" in x] == [
        "m/seed=0: gates skipped, it does not apply (ckv: error: analysis=gates needs learned gates)"
    ]
    assert "f/seed=0: knockout FAILED (command failed (1): boom)" in out


def _study_line(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """The one ``ckv: error:`` line (exit code 2) of ``python -m ckv.apps.study <argv>``."""
    try:
        code = main(argv)
    except SystemExit as e:  # the parser's refusals
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def test_bad_arguments_and_yaml_are_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    """--workers below 1 (0 was taken as the default, -1 and a study without runs ended in a ValueError), a YAML
    syntax error (was a 59-line traceback), a path for NAME (was read, and printed as conf/study//<path>), an --out
    that is a file (was a traceback): one line each, exit code 2, nothing run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    ran = _instant_jobs(monkeypatch)
    (tmp_path / "tiny.yaml").write_text("out: o\nruns:\n  - {experiment: demo_gate_s4, role: gate}\n")
    (tmp_path / "broken.yaml").write_text("out: o\nruns: [\n  - {experiment: demo_full\n")
    (tmp_path / "empty.yaml").write_text("out: o\nruns: []\n")
    (tmp_path / "results.txt").write_text("mine")
    workers = (
        "ckv: error: argument --workers: '{}' is not a number of models trained at once: give a whole number >= 1 "
        "(see --help)"
    )
    cases = {
        ("tiny", "--workers", "0"): workers.format("0"),
        ("tiny", "--workers", "-1"): workers.format("-1"),
        (
            "broken",
        ): "ckv: error: conf/study/broken.yaml is not valid YAML (expected the node content, but found '-' at line "
        "3 column 3); fix the file",
        (
            "empty",
        ): "ckv: error: conf/study/empty.yaml declares no runs: nothing to train; add runs: [{experiment: ..., "
        "role: ...}] (a study whose module makes its runs has its own command, e.g. python -m ckv.apps.robust)",
        (
            str(tmp_path / "tiny"),
        ): f"ckv: error: study {str(tmp_path / 'tiny')!r} is not a study name: give the name of a "
        "YAML in conf/study/ without .yaml, not a path (copy your file to conf/study/<name>.yaml); known: ['broken', "
        "'empty', 'tiny']",
        ("tiny", "--out", "results.txt"): "ckv: error: --out 'results.txt' is a file, not a folder; give a folder you "
        "can write to: --out DIR",
        ("tiny", "--out", "results.txt/o"): "ckv: error: --out 'results.txt/o' is below 'results.txt', a file, not a "
        "folder; give a folder you can write to: --out DIR",
    }
    for argv, line in cases.items():
        assert _study_line([*argv, "--quick"], capsys) == line, argv
        if str(tmp_path) not in line:
            assert_documented(line)
    assert ran == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "broken.yaml",
        "empty.yaml",
        "results.txt",
        "tiny.yaml",
    ]
    assert "the name of a YAML in conf/study/ without .yaml, not a path" in " ".join(_help(["--help"], capsys).split())


def _help(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_an_out_another_user_can_not_write_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    ran = _instant_jobs(monkeypatch)
    (tmp_path / "tiny.yaml").write_text("out: o\nruns:\n  - {experiment: demo_gate_s4, role: gate}\n")
    locked = tmp_path / "shared"
    locked.mkdir()
    locked.chmod(0o555)
    code, _, err = as_other_user(lambda: sys.exit(main(["tiny", "--quick", "--out", str(locked / "study")])))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"ckv: error: --out {str(locked / 'study')!r} is not writable by user ")
    assert lines[0].endswith(f"(Permission denied: {str(locked)!r}); give a folder you can write to: --out DIR")
    assert ran == [] and list(locked.iterdir()) == []
    if "by user nobody " in lines[0]:
        assert_documented(lines[0].replace(str(tmp_path), "/data"))
