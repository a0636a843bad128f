"""CI's end-to-end smoke run of `make demo`: a few steps per model, so only the pipeline is checked (the science
thresholds need the full budget: see README and docs/demo.md); the same quick run of `make demo-grid`, and the
grid's line per model on constructed results."""

import csv
import json
from pathlib import Path

import pytest

from ckv.apps.demo import DEMO, GRID, grid_findings
from ckv.apps.study_config import TASK, Run
from ckv.apps.study_results import Check, exit_code, table

from .helpers import finished, run_quick

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.smoke
def test_quick_demo_writes_well_formed_outputs(tmp_path):
    out = tmp_path / "demo"
    run_quick("ckv.apps.demo", out)

    demo = json.loads((out / "demo.json").read_text())
    assert demo["quick"] is True
    assert [r["label"] for r in demo["runs"]] == [r.label for r in DEMO.runs]
    roles = [c["claim"] for c in demo["checks"]]
    assert len(roles) == 4 and all(isinstance(c["passed"], bool) and c["detail"] for c in demo["checks"])
    for run in demo["runs"]:
        res = json.loads(Path(run["results"]).read_text())["results"]
        assert res["name"] == TASK and res["modulus"] == 8
        groups = res["phase"]["groups"]
        assert len(groups) == res["stride"] and sum(g["n"] for g in groups) == res["n_prompts"]
        h = res["headline"]
        assert 0.0 <= h["phase_gap_lower"] <= h["phase_gap"] <= h["phase_gap_upper"] <= 1.0
        assert 0.0 <= h["phase_p_value"] <= 1.0
        assert (Path(run["dir"]) / "model" / "model.safetensors").is_file()
    with open(out / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == len(DEMO.runs)
    for png in demo["plots"].values():  # phases, residues and the grid summary
        data = Path(png).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000


@pytest.mark.parametrize(
    "passed, quick, code",
    [
        ((True, True), False, 0),  # the full demo, every claim holds
        ((True, False), False, 1),  # the full demo, one claim fails: make demo fails
        ((False, False), True, 0),  # quick mode: a pipeline check, its thresholds are not expected to hold
        ((), False, 0),  # the grid makes no claims
    ],
)
def test_exit_code_follows_the_science_checks(passed, quick, code):
    checks = [Check(f"claim {i}", ok, "detail") for i, ok in enumerate(passed)]
    assert exit_code(checks, quick) == code


@pytest.mark.slow  # twelve models: make demo's quick run (above) keeps the shared pipeline in CI
def test_quick_grid_ends_with_its_table_plots_and_a_line_per_model(tmp_path):
    out = tmp_path / "grid"
    proc = run_quick("ckv.apps.demo", out, "--grid")

    record = json.loads((out / "demo.json").read_text())
    assert record["grid"] is True and record["checks"] == [] and record["all_passed"] is False
    assert [r["label"] for r in record["runs"]] == [r.label for r in GRID.runs]
    assert all(r["steps"] == 12 for r in record["runs"])
    learned = record["learned"]
    assert [c["claim"].split(" ")[0] for c in learned] == [r.label for r in GRID.runs]
    assert all(isinstance(c["passed"], bool) and c["detail"].startswith("best phase") for c in learned)
    header = next(line for line in proc.stdout.splitlines() if line.startswith("model "))
    assert header.endswith("learned") and "not learned, so no phase conclusion" in proc.stdout
    with open(out / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == len(GRID.runs)
    for png in [*record["plots"].values(), *(Path(r["results"]).parent / f"{TASK}.png" for r in record["runs"])]:
        data = Path(png).read_bytes()  # heatmaps, comparisons and each model's own per-phase curve
        assert data[:8] == PNG and len(data) > 10_000


def test_grid_names_each_model_that_did_not_learn_and_draws_no_phase_conclusion_from_it():
    bar = GRID.criteria["learned_best_phase"]
    run = Run("demo_gate_s4", 0, "grid", name="grid_gate_w8s8")
    real = {"phase_gap": 0.5, "phase_gap_lower": 0.45, "phase_gap_upper": 0.55, "phase_p_value": 0.0005}
    done = [
        finished(run, stride=8, mean=bar + 0.1, worst_phase=7, **real),  # learned, weak at the boundary phase
        finished(run, stride=8, mean=bar - 0.01, worst_phase=7, **real),  # the same gap, but never at the bar
        finished(run, stride=8, mean=bar + 0.1, worst_phase=2, **real),  # learned, weak elsewhere
    ]
    boundary, missed, elsewhere = grid_findings(done, bar)
    assert (boundary.passed, missed.passed, elsewhere.passed) == (True, False, True)
    assert "phase effect" in boundary.detail and "(the boundary phase S - 1)" in boundary.detail
    assert missed.detail.endswith("no phase conclusion") and "gap" not in missed.detail
    assert "(not the boundary phase)" in elsewhere.detail
    rows = table(done, [f.passed for f in (boundary, missed, elsewhere)]).splitlines()
    assert rows[0].endswith("learned") and [r.split()[-1] for r in rows[1:]] == ["yes", "NO", "yes"]
