"""make pretrain's study (conf/study/pretrain.yaml): its runs, evaluations and checkpoint evaluations (the dry run),
the ``checkpoints`` key of a study, every claim of its report at the boundaries of its rule on constructed rows (the
criteria read from the study), the paired differences against the task-trained rows, and the emergence figure."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ckv.analysis import plots as analysis_plots
from ckv.apps import pretrain, study_config, study_run
from ckv.apps.study import main
from ckv.apps.study_config import Run, load_study
from ckv.apps.study_run import checkpoint_commands
from ckv.checks import ConfigError
from ckv.io.layout import STATE_FILE
from tests.helpers import kept_figures

from .helpers import claim_row, run_quick

STUDY = load_study("pretrain")
CRITERIA = STUDY.criteria
BAR, MARGIN, CAP = CRITERIA["learned_best"], CRITERIA["flat_margin"], CRITERIA["control_saturated"]
SPREAD = STUDY.params["paper_spread"]


def test_the_dry_run_lists_the_runs_their_twins_and_the_checkpoint_evaluations(capsys):
    assert main(["pretrain", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    labels = {r.label for r in STUDY.runs}
    # every pretrained run named in the claims' params exists, and so does its task-trained row
    assert set(STUDY.params["task_trained"]) <= labels and set(STUDY.params["task_trained"].values()) <= labels
    assert set(pretrain.CLAIM_ROLES) <= {r.role for r in STUDY.runs}
    roles = {r.label: r.role for r in STUDY.runs}
    assert all(roles[t] == pretrain.TASK_TRAINED for t in STUDY.params["task_trained"].values())
    checkpoint = [x for x in lines if "of every kept checkpoint" in x]
    assert checkpoint and all("model.step=<step>" in x and "task.padding=prefix" in x for x in checkpoint)
    assert all(x.endswith("limit=144 model.step=<step>") for x in checkpoint)  # the key's overrides, last
    picked = {x.split()[1] for x in checkpoint}
    assert picked == {r.label for r in STUDY.runs if STUDY.checkpoints.applies_to(r)}
    assert {"full_kv1/seed=42", "deepseek_w8s4/seed=42", "w4s4/seed=44"} <= picked
    assert not any(x.startswith("paper_") for x in picked)
    # the filler-length probe on every pretrained run (a control's phases mod W4/S4's stride), no task-trained twin
    probed = {x.split()[1].rstrip(":"): x for x in lines if x.startswith("probe ")}
    assert set(probed) == {r.label for r in STUDY.runs if r.role != pretrain.TASK_TRAINED}
    assert all("task=probe_bible" in x for x in probed.values()) and "task.stride=4" in probed["full_kv1/seed=42"]
    assert lines[-1].endswith(f"{len(STUDY.runs)} runs, {3 * len(STUDY.runs) + 4 + len(probed)} jobs")


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            "checkpoints: {runs: [], eval: prefix}",
            "checkpoints takes runs (a list of label patterns), eval and optionally",
        ),
        (
            "checkpoints: {runs: ['a/*'], eval: nothing}",
            "checkpoints.eval='nothing' is not one of the study's evaluations",
        ),
        (
            "checkpoints: {runs: ['a/*'], every: 2}",
            "checkpoints takes runs (a list of label patterns), eval and optionally",
        ),
        ("checkpoints: {runs: ['a/*'], overrides: {limit: 2}}", "checkpoints: overrides are a list of strings"),
        ("probes: {runs: ['a/*']}", "probes.task=None is not a task of conf/eval/task; known: ["),
        ("probes: {runs: ['a/*'], task: nothing}", "probes.task='nothing' is not a task of conf/eval/task"),
        ("probes: {runs: [], task: probe_bible}", "probes takes runs (a list of label patterns) and task"),
        (
            "probes: {runs: ['a/*'], task: probe_bible, eval: x}",
            "probes takes runs (a list of label patterns) and task",
        ),
    ],
)
def test_a_bad_checkpoints_or_probes_key_is_one_line(tmp_path, monkeypatch, key: str, message: str) -> None:
    monkeypatch.setattr(study_config, "STUDY_DIR", tmp_path)
    (tmp_path / "s.yaml").write_text(
        f"out: o\nevals: {{prefix: [task.padding=prefix]}}\nruns: [{{experiment: cpu_smoke, role: x}}]\n{key}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_study("s")
    assert message in str(err.value) and "\n" not in str(err.value)


def probe_report(top1: list[bool], best: list[bool], stride: int = 4) -> dict:
    """A constructed probe report (``ckv.eval.probe``'s keys the study's table reads) over ``len(top1)`` lengths."""
    phases = [
        {"phase": ph, "expected_top1_share": float(np.mean(top1[ph::stride]))} for ph in range(min(stride, len(top1)))
    ]
    headline = {
        "expected_top1_share": float(np.mean(top1)),
        "expected_best_share": float(np.mean(best)),
        "dominant_period": stride,
    }
    return {
        "stride": stride,
        "flips": int(np.sum(np.diff(top1) != 0)),
        "labels": [" Bethel", " Luz"],
        "lengths": [{} for _ in top1],
        "phases": phases,
        "headline": headline,
        "periodicity": {"score": 0.9, "chance": 0.13, "dominant_p_value": 0.004},
    }


def test_the_probe_table_reads_each_pretrained_runs_probe() -> None:
    top1 = [True, True, True, False] * 6
    done = [
        {"run": Run("pretrain_cpu", 42, "baseline", name="w4s4"), "probe": probe_report(top1, [True] * 24)},
        {"run": Run("paper_cpu", 42, pretrain.TASK_TRAINED, name="paper_w4s4")},  # no probe: no row
    ]
    lines, record = pretrain.probe_lines(STUDY, done)
    assert "task=probe_bible: 24 filler lengths; ' Bethel' expected, ' Luz' the other candidates" in lines[0]
    rows = [x for x in lines if x.startswith("  w4s4/seed=42")]
    assert len(rows) == 1 and not any("paper_w4s4" in x for x in lines)
    assert rows[0].split()[1:4] == ["4", "11", "75.0%"] and "100 100 100   0" in rows[0]
    assert "100.0%" in rows[0] and "0.90 (0.13)" in rows[0] and "4 (p=0.004)" in rows[0]
    assert record == {
        "w4s4/seed=42": {
            "stride": 4,
            "flips": 11,
            "expected_top1_share": 0.75,
            "expected_best_share": 1.0,
            "per_phase": {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0},
            "periodicity": {"score": 0.9, "chance": 0.13, "dominant_p_value": 0.004},
        }
    }
    assert pretrain.probe_lines(STUDY, done[1:]) == ([], {})


def test_a_quick_study_keeps_its_own_limit_on_the_checkpoint_evaluations_and_analyses(tmp_path) -> None:
    run = next(r for r in STUDY.runs if r.label == "w4s4/seed=42")
    study = dataclasses.replace(
        STUDY, checkpoints=study_config.CheckpointEvals(("w4s4/*",), "prefix", ("limit=144", "stats.ci=0.9"))
    )
    assert study_run.past_quick(("limit=144", "stats.ci=0.9"), quick=False) == ("limit=144", "stats.ci=0.9")
    assert study_run.past_quick(("limit=144", "stats.ci=0.9"), quick=True) == ("stats.ci=0.9",)  # limit=64 stays
    gates = next(a for a in STUDY.analyses if a.name == "gates")
    assert "limit=144" in gates.overrides  # make pretrain's gates read the checkpoint evaluations' prompts
    for quick, limit in ((False, "limit=144"), (True, "limit=64")):
        cmd = study_run.analysis_command(STUDY, run, gates, tmp_path, quick)[1]
        assert [o for o in cmd if o.startswith("limit=")][-1] == limit
    step_dir = tmp_path / "runs" / "w4s4" / "seed=42" / "checkpoints" / "step_00000250"
    (step_dir / "weights").mkdir(parents=True)
    (step_dir / STATE_FILE).write_text("{}")  # a complete checkpoint, as list_checkpoints reads one
    found = study_run.checkpoint_commands(study, run, tmp_path, quick=False)
    assert [c[-3:] for _, _, c in found] == [["limit=144", "stats.ci=0.9", "model.step=250"]]


def test_checkpoint_evaluations_apply_to_the_runs_their_patterns_match() -> None:
    pick = study_config.CheckpointEvals(("w8s8/*", "full_kv1/seed=42"), "prefix")
    runs = [Run("e", s, "r", name=n) for n, s in (("w8s8", 43), ("w8s8_kv8", 42), ("full_kv1", 42), ("full_kv1", 7))]
    assert [pick.applies_to(r) for r in runs] == [True, False, True, False]


def row(gap: float = 0.01, p: float = 0.5, floor: float = 0.02, worst: float = 0.6, stride: int = 8, **kw) -> dict:
    """A constructed claim row of this study (``helpers.claim_row`` at its flat margin)."""
    return claim_row(MARGIN, gap, p, floor, worst, stride, **kw)


def gap_row(weak: int = 7, gap: float = 0.4, **kw) -> dict:
    """A significant gap at period 8 whose weakest phase is ``weak``."""
    phases = [0.7] * 8
    phases[weak] = 0.3
    return row(gap=gap, p=0.001, floor=0.03, worst=0.3, period=8, phases=phases, one_sided=gap + 0.02, **kw)


def both(r: dict) -> dict:
    return {"prefix": r, "in_sequence": r}


def checks_of(rows: dict, roles: dict, compared: dict | None = None) -> list:
    learned = pretrain.learned_runs({k: v for k, v in rows.items()}, BAR)
    return pretrain.claims(STUDY, rows, roles, learned, compared or {}, [])


def verdicts(checks, start: str) -> list[str]:
    return [("PASS" if c.passed else "FAIL" if c.decided else "undecided") for c in checks if c.claim.startswith(start)]


ROLES = {"ctrl": "control", "ds": "deepseek", "kv8a": "kv8", "kv8b": "kv8", "b1": "baseline", "b2": "baseline"}


def test_each_claim_passes_fails_or_stays_undecided_on_constructed_rows() -> None:
    rows = {
        "ctrl": both(row(mean=0.7)),
        "ds": both(gap_row()),
        "kv8a": both(gap_row()),
        "kv8b": both(row()),  # flat: Q2 FAILs
        "b1": both(gap_row(weak=7, gap=SPREAD["prefix"][0] / 100 + 0.01)),  # inside the spread, weakest at S - 1
        "b2": both(gap_row(weak=3, gap=SPREAD["prefix"][1] / 100 - 0.01)),  # inside, weakest elsewhere: FAIL
    }
    checks = checks_of(rows, ROLES)
    assert verdicts(checks, "precondition") == ["PASS"]
    assert "not saturated" in checks[0].detail
    assert verdicts(checks, "ctrl") == ["PASS", "PASS"]
    assert verdicts(checks, "Q1") == ["PASS", "PASS"]
    assert verdicts(checks, "Q2") == ["FAIL", "FAIL"]
    assert verdicts(checks, "prefix: the baseline's gap") == ["PASS"]
    assert verdicts(checks, "b1 prefix: the weakest") == ["PASS"] and verdicts(checks, "b2 prefix: the weakest") == [
        "FAIL"
    ]
    assert verdicts(checks, "kv8b prefix: the weakest") == ["undecided"]  # no significant gap
    assert verdicts(checks, "prefix: the dominant period") == ["PASS"]


def test_the_precondition_is_learning_and_a_failed_control_means_no_verdict() -> None:
    at_bar = row(worst=BAR - 0.01, gap=0.01)  # best group exactly at the bar: learned
    assert verdicts(checks_of({"ctrl": both(at_bar)}, {"ctrl": "control"}), "precondition") == ["PASS"]
    below = row(worst=BAR - 0.02, gap=0.01)
    checks = checks_of({"ctrl": both(below), "ds": both(gap_row())}, {"ctrl": "control", "ds": "deepseek"})
    assert verdicts(checks, "precondition") == ["FAIL"]
    assert verdicts(checks, "Q1") == ["undecided", "undecided"] and "no verdict" in checks[-1].detail
    missing = checks_of({"ds": both(gap_row())}, {"ctrl": "control", "ds": "deepseek"})
    assert verdicts(missing, "precondition") == ["FAIL"]
    saturated = checks_of({"ctrl": both(row(mean=CAP + 0.01, worst=0.9))}, {"ctrl": "control"})
    assert "saturated" in saturated[0].detail and "not saturated" not in saturated[0].detail


def test_the_spread_question_at_its_edges() -> None:
    lo, hi = (x / 100 for x in SPREAD["prefix"])
    roles = {"ctrl": "control", "b1": "baseline", "b2": "baseline"}

    def q3(*seeds: tuple[float, float, float]) -> str:
        """Q3's verdict for baseline seeds of (gap, lower, upper)."""
        rows = {"ctrl": both(row())}
        for k, (g, lower, upper) in zip(("b1", "b2"), seeds):
            rows[k] = both(gap_row(gap=g, lower=lower, upper=upper))
        return verdicts(checks_of(rows, roles), "prefix: the baseline's gap")[0]

    below = (lo - 0.1, lo - 0.15, lo - 0.05)  # its interval entirely under the spread
    assert q3((lo, lo - 0.02, lo + 0.02), (hi, hi - 0.02, hi + 0.02)) == "PASS"  # both ends are inside
    assert q3(below, below) == "FAIL"
    assert q3(below, (lo + 0.1, lo + 0.05, lo + 0.15)) == "undecided"  # one inside, one outside
    assert q3((lo - 0.01, lo - 0.03, lo + 0.01), below) == "undecided"  # outside, but its interval reaches in


def write_outcomes(folder: Path, task_name: str, correct: list[int], residue: list[int]) -> None:
    d = folder / "eval" / task_name
    d.mkdir(parents=True)
    with open(d / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["base", "shift", "residue", "correct"])
        for i, (c, r) in enumerate(zip(correct, residue)):
            w.writerow([i // 4, i % 4, r, c])


def test_the_paired_difference_is_the_difference_of_the_two_evaluations(tmp_path: Path) -> None:
    # 20 mappings x 4 shifts, residues 0-3: a is right everywhere but residue 3 (half), b everywhere
    residue = [i % 4 for i in range(80)]
    a = [0 if r == 3 and i % 8 < 4 else 1 for i, r in enumerate(residue)]
    b = [1] * 80
    write_outcomes(tmp_path / "a", "lookup_prefix", a, residue)
    write_outcomes(tmp_path / "b", "lookup_prefix", b, residue)
    oa = pretrain.outcomes({"dir": tmp_path / "a"}, "lookup_prefix")
    ob = pretrain.outcomes({"dir": tmp_path / "b"}, "lookup_prefix")
    diff = pretrain.paired(oa, ob, 4)
    worst_a = np.mean([c for c, r in zip(a, residue) if r == 3])
    assert diff["worst"]["value"] == pytest.approx(worst_a - 1)
    assert diff["gap"]["value"] == pytest.approx(1 - worst_a)
    assert diff["mean"]["value"] == pytest.approx(np.mean(a) - 1)
    for k in ("mean", "worst", "gap"):
        assert diff[k]["lower"] <= diff[k]["value"] <= diff[k]["upper"]
    assert diff["gap"]["lower"] > 0  # every mapping loses at residue 3 in half its prompts: a real paired gap
    write_outcomes(tmp_path / "c", "lookup_prefix", b, [(r + 1) % 4 for r in residue])  # another design
    assert pretrain.paired(oa, pretrain.outcomes({"dir": tmp_path / "c"}, "lookup_prefix"), 4) is None
    assert pretrain.outcomes({"dir": tmp_path / "none"}, "lookup_prefix") is None


def test_the_emergence_figure_has_a_row_per_run_and_says_when_there_are_no_gates(monkeypatch, tmp_path) -> None:
    drawn = kept_figures(monkeypatch, analysis_plots)
    series = [
        {
            "label": "w8s8/seed=42",
            "tokens": [1e6, 2e6],
            "mean": [0.1, 0.5],
            "worst": [0.0, 0.2],
            "gap": [0.2, 0.5],
            "concentration": [7.5, 3.0],
        },
        {
            "label": "full_kv1/seed=42",
            "tokens": [1e6, 2e6],
            "mean": [0.2, 0.6],
            "worst": [0.1, 0.5],
            "gap": [0.1, 0.1],
            "concentration": [None, None],
        },
    ]
    analysis_plots.plot_emergence(series, tmp_path / "e.png")
    fig = drawn["e.png"]
    axes = fig.axes
    assert len(axes) == 4  # a row per run: accuracy and gap, gate concentration
    assert [line.get_label() for line in axes[0].lines] == ["mean", "worst", "gap"]
    assert list(axes[0].lines[0].get_xdata()) == [1.0, 2.0] and list(axes[0].lines[1].get_ydata()) == [0.0, 20.0]
    assert list(axes[1].lines[0].get_ydata()) == [7.5, 3.0]
    assert not axes[3].lines and any("no gates" in t.get_text() for t in axes[3].texts)


@pytest.mark.slow
def test_quick_pretrain_pairs_a_pretrained_run_with_its_task_trained_row_and_evaluates_its_checkpoints(tmp_path):
    """The real study on a control, a baseline seed and its task-trained row (a few steps each): both paddings
    evaluated, the baseline's gap paired with its task-trained row's (the designs match: the pretrained prompt opens
    with the end-of-document token where the synthetic layout has its bos), each kept checkpoint of the runs the
    study's ``checkpoints`` names evaluated, the claims and both figures written."""
    proc = run_quick("ckv.apps.study", tmp_path, "pretrain", "--runs", "full_kv1/*,w4s4/seed=42,paper_w4s4/seed=42")
    table = next(line for line in proc.stdout.splitlines() if line.startswith("w4s4/seed=42") and "prefix" in line)
    assert "paper_w4s4" in table and table.count("n/a") == 0  # the task-trained gap and the paired difference
    for label in ("full_kv1/seed=42", "w4s4/seed=42"):
        run = next(r for r in STUDY.runs if r.label == label)
        for step, results, _ in checkpoint_commands(STUDY, run, tmp_path, True):
            assert results.is_file(), (label, step)
    assert (tmp_path / "pretrain_curves.png").is_file() and (tmp_path / "pretrain_emergence.png").is_file()
    claims = [line for line in proc.stdout.splitlines() if line.startswith("  [")]
    assert any("precondition: every full-attention control learned" in line for line in claims)
    assert sum("the weakest phase group is the boundary phase" in line for line in claims) == 2  # w4s4, both paddings
    # the filler-length probe ran on the pretrained runs, not on the task-trained twin
    probe = proc.stdout[proc.stdout.index("filler-length probe (task=probe_bible") :].splitlines()
    assert all(any(x.startswith(f"  {lab} ") for x in probe) for lab in ("full_kv1/seed=42", "w4s4/seed=42"))
    assert not any(x.startswith("  paper_w4s4") for x in probe)
