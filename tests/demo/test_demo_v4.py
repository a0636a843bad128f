"""`make demo-v4`: CI's quick pipeline run (a few steps per model: the outputs, not the science) and the plain
statements it makes about each model's mechanisms."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckv.apps.demo import ROOT, TASK, DemoRun
from ckv.apps.demo_v4 import hf_eval_overrides, mechanisms, v4_plan
from ckv.apps.train_hf_v4 import compose_train_config, has_deepseek_v4
from ckv.data import lookup_format_for


@pytest.mark.smoke
def test_quick_demo_v4_writes_one_table_one_plot_and_the_findings(tmp_path):
    out = tmp_path / "demo-v4"
    proc = subprocess.run([sys.executable, "-m", "ckv.apps.demo_v4", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "per-phase accuracy" in proc.stdout and "quick mode" in proc.stdout

    record = json.loads((out / "demo_v4.json").read_text())
    plan = v4_plan(has_deepseek_v4())
    assert record["transformers_v4"] is has_deepseek_v4()
    assert [r["label"] for r in record["runs"]] == [r.label for r in plan]
    assert len(record["findings"]) == len(plan) and all("straddling" in f for f in record["findings"])
    for run in record["runs"]:
        res = json.loads(Path(run["results"]).read_text())
        rep = res["results"]
        assert rep["name"] == TASK and rep["stride"] == 4 and len(rep["phase"]["groups"]) == 4
        assert sum(g["n"] for g in rep["phase"]["groups"]) == rep["n_prompts"]
        if run["role"] == "v4_hf":  # transformers' own model, saved as a transformers folder and loaded as one
            assert res["model"]["architecture"] == "DeepseekV4ForCausalLM"
            assert (Path(run["dir"]) / "config.json").is_file() and (Path(run["dir"]) / "model.safetensors").is_file()
        else:
            assert (Path(run["dir"]) / "model" / "model.safetensors").is_file()
    with open(out / "summary.csv") as f:
        assert [row["run"] for row in csv.DictReader(f)] == [r.label for r in plan]
    data = (out / "comparison_phases.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_transformers_model_is_scored_on_the_layout_the_ckv_models_train_on():
    overrides = dict(o.split("=", 1) for o in hf_eval_overrides())
    data = compose_train_config(["experiment=demo_gate_s4"], "unused").data
    assert overrides["model"] == "hf" and overrides["model.stride"] == "4"
    assert int(overrides["task.n_records"]) == data.lookup.n_records
    assert int(overrides["task.n_demos"]) == data.lookup.n_queries - 1
    fields = dict(kv.split(":") for kv in overrides["task.vocab.format"].strip("{}").split(","))
    expected = lookup_format_for(data)
    assert {k: (None if v == "null" else v if k == "record" else int(v)) for k, v in fields.items()} == \
        {k: getattr(expected, k) for k in fields}


def test_every_model_trains_with_the_ckv_demo_budget():
    plan = v4_plan(with_hf=True)
    assert [r.role for r in plan] == ["v4_hf", "v4_ckv", "gate", "control"]
    assert plan[0].experiment == "demo_gate_s4" and plan[0].entry == ("-m", "ckv.apps.train_hf_v4")
    assert [r.role for r in v4_plan(with_hf=False)] == ["v4_ckv", "gate", "control"]
    budgets = {(c.trainer.max_steps, c.trainer.global_batch_size, c.optim.lr, c.optim.schedule)
               for c in (compose_train_config([f"experiment={r.experiment}"], "unused") for r in plan)}
    assert len(budgets) == 1


def _done(worst: int, p: float, lower: float, floor: float, mean: float = 0.6) -> dict:
    headline = {"mean": mean, "phase_gap": lower + 0.05, "phase_gap_lower": lower, "phase_gap_upper": lower + 0.1,
                "phase_p_value": p, "phase_noise_floor": floor, "worst_phase": worst}
    return {"run": DemoRun("demo_gate_s4", 0, "gate"), "results": {"headline": headline, "stride": 4}}


@pytest.mark.parametrize("worst, p, lower, floor, effect, straddling", [
    (3, 0.0005, 0.30, 0.05, "yes", "yes"),   # a real gap, weakest at the boundary phase S - 1
    (1, 0.0005, 0.30, 0.05, "yes", "no"),    # a real gap elsewhere: a phase effect, not straddling
    (3, 0.20, 0.30, 0.05, "no", "no"),       # not significant
    (3, 0.0005, 0.01, 0.05, "no", "no"),     # significant, but the interval does not clear the noise floor
])
def test_mechanism_lines_claim_straddling_only_for_a_real_gap_at_the_boundary(worst, p, lower, floor, effect,
                                                                              straddling):
    (line,) = mechanisms([_done(worst, p, lower, floor)])
    assert f"phase effect {effect} " in line and f"straddling {straddling} " in line
    assert f"weakest phase {worst}, boundary phase 3" in line
