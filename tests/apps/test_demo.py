"""CI's end-to-end smoke run of `make demo`: a few steps per model, so only the pipeline is checked (the science
thresholds need the full budget: see README and docs/demo.md)."""

import csv
import json
from pathlib import Path

import pytest

from ckv.apps.demo import DEMO
from ckv.apps.study import TASK, Check, exit_code

from .helpers import run_quick


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
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


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
