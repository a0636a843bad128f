"""make mitigate's study (conf/study/mitigate.yaml, ``ckv.apps.mitigate``): its runs are make paper's compressed runs
with make paper's own train commands (so their folders are reused), its DeepSeek-V4 runs make demo-v4's recipe; the
paired differences, the tuning rule and the verdicts on constructed evaluations; and CI's quick run of the real
study on one baseline seed and the DeepSeek-V4 needle run."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from ckv.apps import mitigate
from ckv.apps.study import n_jobs
from ckv.apps.study_config import load_study, select_runs
from ckv.apps.study_run import eval_commands, run_dir, train_command
from ckv.eval.stats import StatsOptions
from ckv.io.results import read_json, write_json

from .helpers import run_quick

PNG = b"\x89PNG\r\n\x1a\n"
STUDY = load_study("mitigate")
PAPER = load_study("paper")
V4 = load_study("demo_v4")


def test_every_compressed_run_of_make_paper_is_here_with_make_papers_train_command():
    """The same run folders and train.py command lines: a finished make paper run is resumed, i.e. reused."""
    out = Path("outputs/paper")
    ours = {r.label: r for r in STUDY.runs}
    compressed = [r for r in PAPER.runs if r.role != "control"]
    assert compressed and all(r.label in ours for r in compressed)
    for r in compressed:
        assert train_command(ours[r.label], out, False) == train_command(r, out, False), r.label
    assert {r.seed for r in STUDY.runs if r.role == "tune"} == set(PAPER.seeds)  # the choices' seed
    confirm = {r.seed for r in STUDY.runs if r.role in mitigate.CONFIRM}
    assert confirm & set(PAPER.seeds) == set() and len(confirm) >= 6
    assert set(mitigate.CLAIM_ROLES) == {r.role for r in STUDY.runs}


def test_the_deepseek_v4_runs_are_make_demo_v4s_model_on_its_lookup_and_the_needle():
    (hf,) = [r for r in V4.runs if r.role == "v4_hf"]
    for r in (r for r in STUDY.runs if r.role in mitigate.V4):
        assert (r.experiment, r.entry, r.seed) == (hf.experiment, hf.entry, hf.seed)
        assert f"model.stride={V4.params['stride']}" in r.eval_overrides and "model=hf" in r.eval_overrides
    assert {r.task for r in STUDY.runs if r.role in mitigate.V4} == {"demo_lookup", "needle"}


def test_every_evaluation_is_a_padding_unmitigated_or_mitigated_and_the_dry_run_counts_them():
    evals = mitigate.evaluations(STUDY)
    paddings = STUDY.params["paddings"]
    assert [e.key for e in evals if e.mitigation == mitigate.NONE] == paddings
    labels = {e.mitigation for e in evals} - {mitigate.NONE}
    for label in labels:  # each mitigation in every padding, with its eval.py option
        assert {e.padding for e in evals if e.mitigation == label} == set(paddings)
    tuned = [name for cands in STUDY.params["tuning"].values() for name in cands]
    assert set(tuned) <= labels
    for run in STUDY.runs:
        for key, (name, cmd) in eval_commands(run, Path("out"), False, STUDY.task, STUDY.evals).items():
            assert name == f"{run.task or STUDY.task}_{key}"
            assert any(x.startswith("mitigation=") for x in cmd) == (key not in paddings)
    assert n_jobs(STUDY) == len(STUDY.runs) * (1 + len(STUDY.evals))


def test_a_label_scored_from_another_evaluations_runs_reads_its_rule():
    """params.also: shift_max is the shift_mean evaluation's runs combined by max_confidence (mitigation.also), its
    statistics that run's ``also`` and its paired column ``correct_max_confidence``; a run without them is an error."""
    evals = {(e.padding, e.mitigation): e for e in mitigate.evaluations(STUDY)}
    for padding in STUDY.params["paddings"]:
        e = evals[(padding, "shift_max")]
        assert (e.key, e.rule, e.column) == (f"{padding}_shift_mean", "max_confidence", "correct_max_confidence")
        assert "mitigation.also=[max_confidence]" in STUDY.evals[e.key]
        assert e.report({"also": {"max_confidence": {"headline": 1}}}) == {"headline": 1}
        with pytest.raises(ValueError, match="has no results of combine rule max_confidence"):
            e.report({"headline": 0})
        assert evals[(padding, "shift_mean")].report({"headline": 0}) == {"headline": 0}
    order = [e.mitigation for e in mitigate.evaluations(STUDY) if e.padding == "prefix"]
    assert order.index("shift_max") == order.index("shift_mean") + 1  # beside the evaluation it reads
    broken = STUDY.__class__(
        **{**STUDY.__dict__, "params": {**STUDY.params, "also": {"x": ["nope", "max_confidence"]}}}
    )
    with pytest.raises(ValueError, match=r"params.also.x reads evaluation\(s\) \['prefix_nope', 'in_sequence_nope'\]"):
        mitigate.evaluations(broken)


def write_csv(path: Path, correct: np.ndarray, modulus: int) -> Path:
    """A results.csv of ``correct`` (n_base, modulus): base, shift, target_position, residue, correct."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["base", "shift", "target_position", "residue", "correct"])
        for b, row in enumerate(correct):
            for k, c in enumerate(row):
                w.writerow([b, k, 100 + k, k, int(c)])
    return path


def test_paired_differences_decide_works_by_the_committed_criteria(tmp_path):
    """A mitigation that lifts the weakest residue from 20% to 60% and costs nothing elsewhere works; one that lifts
    it but loses 3 pp of the mean elsewhere does not (the mean may fall by 1 pp); one that changes nothing does not."""
    rng = np.random.default_rng(0)
    n, m = 96, 8
    c = STUDY.criteria
    base = rng.random((n, m)) < 0.8
    base[:, 7] = rng.random(n) < 0.2
    lifted = base.copy()
    lifted[:, 7] = rng.random(n) < 0.6
    costly = lifted.copy()
    costly[:, :7] &= rng.random((n, 7)) < 0.93  # about 5 pp of the other groups lost
    options = StatsOptions(n_bootstrap=400)
    files = {
        k: write_csv(tmp_path / f"{k}.csv", v, m) for k, v in (("base", base), ("lifted", lifted), ("costly", costly))
    }
    args = (m, options, c["level"], c["mean_drop"])
    good = mitigate.paired(files["base"], files["lifted"], *args)
    assert good["works"] and good["worst_diff"]["lower"] > 0
    assert good["worst_diff"]["value"] == pytest.approx(lifted.mean(0).min() - base.mean(0).min())
    bad = mitigate.paired(files["base"], files["costly"], *args)
    assert bad["worst_diff"]["lower"] > 0 and bad["mean_diff_lower"] < -c["mean_drop"] and not bad["works"]
    same = mitigate.paired(files["base"], files["base"], *args)
    assert same["worst_diff"]["value"] == 0 and not same["works"]
    shuffled = write_csv(tmp_path / "other.csv", base[::-1], m)
    other_prompts = tmp_path / "moved.csv"
    other_prompts.write_text(shuffled.read_text().replace(",100,", ",101,", 1))
    with pytest.raises(ValueError, match="does not score the prompts"):
        mitigate.paired(files["base"], other_prompts, *args)


def row(label: str, role: str, mitigation: str, works: bool = False, ratio: float = 2.0, learned: bool = True) -> dict:
    w = {"value": 0.1, "lower": 0.05 if works else -0.01, "upper": 0.2}
    return {"label": label, "role": role, "task": "lookup", "padding": "prefix", "mitigation": mitigation,
            "learned": learned, "flops_ratio": ratio, "works": works, "worst_diff": w, "mean_diff": 0.0,
            "mean_diff_lower": -0.005}  # fmt: skip


def test_the_tuning_rule_and_the_verdicts_count_learned_models_only():
    rows = []
    for i, (mean_works, max_works) in enumerate([(True, True), (True, False), (False, True), (True, False)]):
        label = f"v{i}/seed=42"
        rows += [row(label, "tune", "none"), row(label, "tune", "shift_mean", mean_works)]
        rows += [row(label, "tune", "shift_max", max_works), row(label, "tune", "dual", i == 0, ratio=1.05)]
    rows += [row("x/seed=42", "tune", "none", learned=False), row("x/seed=42", "tune", "dual", True, 1.05)]
    for s, ok in ((43, True), (46, True), (47, False)):
        role = "confirm" if s < 46 else "fresh"
        rows += [row(f"w8s8/seed={s}", role, "none"), row(f"w8s8/seed={s}", role, "shift_mean", ok)]
    name, why, decided = mitigate.choose(rows, ["shift_mean", "shift_max"], mitigate.TUNE)
    assert name == "shift_mean" and "shift_mean: works on 3 of 4" in why and decided
    assert mitigate.choose(rows, ["shift_max", "shift_mean"], ("nobody",))[2] is False  # no learned tuning model
    assert mitigate.choose(rows, ["shift_max", "shift_mean"], mitigate.TUNE)[0] == "shift_mean"
    study = STUDY.__class__(**{**STUDY.__dict__, "params": {**STUDY.params, "paddings": ["prefix"]}})
    found, chosen = mitigate.checks(study, rows)
    assert chosen == {"shift_ensemble": "shift_mean"}
    verdict = {ch.claim.split(":")[0]: ch for ch in found}
    assert verdict["shift_mean prefix"].passed  # useful: 3 of 4 learned tuning models at 2x
    dual = [ch for ch in found if ch.claim.startswith("dual prefix: useful")][0]
    assert not dual.passed and "1 of 4" in dual.detail  # the unlearned model's success does not count
    confirmed = [ch for ch in found if ch.claim.startswith("shift_mean prefix: confirmed")][0]
    assert confirmed.passed and "2 of 3" in confirmed.detail
    too_dear = [dict(r, flops_ratio=2.5) if r["mitigation"] == "shift_mean" else r for r in rows]
    found, _ = mitigate.checks(study, too_dear)
    assert not next(ch for ch in found if ch.claim.startswith("shift_mean prefix: useful")).passed


def test_the_summary_is_one_line_per_model_and_padding_from_the_record(tmp_path):
    rows = [row("v/seed=42", "tune", "none"), row("v/seed=42", "tune", "dual", True, 1.05)]
    rows += [row("x/seed=42", "tune", "none", learned=False), row("x/seed=42", "tune", "dual", False, 1.05)]
    rows = [dict(r, worst=[0.25, 0.2, 0.3], kv_ratio=1.5) for r in rows]
    text = mitigate.summary(rows, ("dual",)).splitlines()
    assert len(text) == 4 and text[0].startswith("| model | padding |")
    assert text[2] == "| v/seed=42 | prefix | 25.0 | 25.0, 10.0 [5.0, 20.0], 0.0 (-0.5) | 1.05 / 1.50 |"
    assert text[3].startswith("| x/seed=42 | prefix | 25.0 (not learned) |") and text[3].endswith(" no | 1.05 / 1.50 |")
    record = write_json(tmp_path / "mitigate.json", {"mitigation_rows": rows})
    with pytest.raises(SystemExit) as e:
        mitigate.main(["--summary", str(record), "--mitigations", "shift_mean"])
    assert e.value.code == 2  # a mitigation the record does not hold: one usage line


@pytest.mark.parametrize(
    "pattern",
    [
        pytest.param("w8s8/seed=42", marks=pytest.mark.slow, id="baseline"),
        pytest.param("w8s8/seed=42,v4_hf_needle/*", marks=pytest.mark.slow, id="baseline_and_v4_needle"),
    ],
)
def test_quick_mitigate_on_a_baseline_seed_and_the_deepseek_v4_needle(tmp_path, pattern):
    """``python -m ckv.apps.study mitigate --quick --runs <pattern>``: the real study, 12 steps per model: every
    evaluation of the runs (unmitigated and mitigated, both paddings) is written, the table has one row per run,
    padding and mitigation with its cost, every verdict is printed, the figure is written (the slow set: CI's smoke
    run is make paper's, on the same runner; the mitigations themselves run in the fast set, tests/eval)."""
    out = tmp_path / "mitigate"
    proc = run_quick("ckv.apps.study", out, "mitigate", "--runs", pattern, "--workers", "2")
    study = select_runs(STUDY, pattern)
    record = read_json(out / "mitigate.json")
    assert record["quick"] is True and record["failed"] == []
    assert [r["label"] for r in record["runs"]] == [r.label for r in study.runs]
    text = proc.stdout.splitlines()
    rows = record["mitigation_rows"]
    assert len(rows) == len(study.runs) * len(mitigate.evaluations(study)) > len(study.runs) * len(study.evals)
    for r in rows:
        line = next(x for x in text if x.split()[:3] == [r["label"], r["padding"], r["mitigation"]])
        assert mitigate._cell(r["worst"]) in line
        if r["mitigation"] != mitigate.NONE:
            assert f"{r['flops_ratio']:.2f}" in line and r["flops_ratio"] > 1.0
    for run in study.runs:
        task = run.task or study.task
        for key in study.evals:
            assert (run_dir(out, run) / "eval" / f"{task}_{key}" / "results.csv").is_file()
    for check in record["checks"]:
        word = "PASS" if check["passed"] else "FAIL" if check["decided"] else "undecided"
        assert f"  [{word}] {check['claim']}: {check['detail']}" in text
    figure = Path(record["figures"]["gain_cost"])
    assert figure.parent == out and figure.read_bytes()[:8] == PNG
