"""`make demo-v4`: CI's quick pipeline run (a few steps per model: the outputs, not the science) and the plain
statements it makes about each model's mechanisms."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckv.apps.demo_v4 import hf_eval_overrides, mechanisms, v4_plan
from ckv.apps.study_config import ROOT, TASK, Run
from ckv.apps.train_hf_v4 import compose_train_config, has_deepseek_v4
from ckv.data import lookup_format_for
from tests.helpers import run_script

from .helpers import finished, run_quick


@pytest.mark.slow  # make demo-v4 shares make demo's pipeline (ckv.apps.study.run_plan), whose quick run CI keeps
def test_quick_demo_v4_writes_one_table_one_plot_and_the_findings(tmp_path):
    out = tmp_path / "demo-v4"
    run_quick("ckv.apps.demo_v4", out)

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
    assert {k: (None if v == "null" else v if k == "record" else int(v)) for k, v in fields.items()} == {
        k: getattr(expected, k) for k in fields
    }


def test_every_model_trains_with_the_ckv_demo_budget():
    plan = v4_plan(with_hf=True)
    assert [r.role for r in plan] == ["v4_hf", "v4_ckv", "gate", "control"]
    assert plan[0].experiment == "demo_gate_s4" and plan[0].entry == ("-m", "ckv.apps.train_hf_v4")
    assert [r.role for r in v4_plan(with_hf=False)] == ["v4_ckv", "gate", "control"]
    budgets = {
        (c.trainer.max_steps, c.trainer.global_batch_size, c.optim.lr, c.optim.schedule)
        for c in (compose_train_config([f"experiment={r.experiment}"], "unused") for r in plan)
    }
    assert len(budgets) == 1


def _done(worst: int, p: float, lower: float, floor: float) -> dict:
    return finished(
        Run("demo_gate_s4", 0, "gate"),
        phase_gap=lower + 0.05,
        phase_gap_lower=lower,
        phase_gap_upper=lower + 0.1,
        phase_p_value=p,
        phase_noise_floor=floor,
        worst_phase=worst,
    )


@pytest.mark.parametrize(
    "worst, p, lower, floor, effect, straddling",
    [
        (3, 0.0005, 0.30, 0.05, "yes", "yes"),  # a real gap, weakest at the boundary phase S - 1
        (1, 0.0005, 0.30, 0.05, "yes", "no"),  # a real gap elsewhere: a phase effect, not straddling
        (3, 0.20, 0.30, 0.05, "no", "no"),  # not significant
        (3, 0.0005, 0.01, 0.05, "no", "no"),  # significant, but the interval does not clear the noise floor
    ],
)
def test_mechanism_lines_claim_straddling_only_for_a_real_gap_at_the_boundary(
    worst, p, lower, floor, effect, straddling
):
    (line,) = mechanisms([_done(worst, p, lower, floor)])
    assert f"phase effect {effect} " in line and f"straddling {straddling} " in line
    assert f"weakest phase {worst}, boundary phase 3" in line


@pytest.mark.smoke
def test_a_tiny_v4_trained_on_ckv_lookup_runs_the_lookup_needle_and_probe_through_eval_py(
    tmp_path, monkeypatch, capsys
):
    """transformers' own DeepseekV4ForCausalLM, trained by ckv.apps.train_hf_v4 on the demo's lookup data (12
    steps: its loss falls), then scored by ``eval.py model=hf`` on the three tasks with the layout it trained on
    (eval.py run in this process, ``run_script``: its Hydra main as from a shell, without three interpreter
    starts)."""
    if not has_deepseek_v4():
        pytest.skip("the installed transformers has no DeepseekV4ForCausalLM")
    run = tmp_path / "v4"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "WANDB_MODE": "disabled"}
    train = [
        sys.executable,
        "-m",
        "ckv.apps.train_hf_v4",
        "experiment=demo_gate_s4",
        "seed=0",
        f"hydra.run.dir={run}",
        "trainer.max_steps=12",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.log_every=4",
        "optim.warmup_steps=2",
        "trainer.progress=false",
        "wandb.enabled=false",
    ]
    proc = subprocess.run(train, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [
        json.loads(line)["loss"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.2  # it has trained on ckv's batches
    lookup_args = [a for a in hf_eval_overrides() if a.startswith("task.")]  # the layout and record counts
    layout = [a for a in lookup_args if a.startswith("task.vocab.format=")]
    head = [
        "model=hf",
        f"model.path={run}",
        "model.stride=4",
        "progress=false",
        "stats.n_bootstrap=50",
        "stats.n_permutations=50",
        "device=cpu",
    ]
    tasks = {
        "lookup": [*head, "task=demo_lookup", "task.n_base=16", *lookup_args],
        "needle": [
            *head,
            "task=needle",
            "task.context_tokens=128",
            "task.n_records=16",
            "task.record_len=2",
            "task.prompts_per_residue=64",
            "task.prefill_chunk=64",
            "limit=1",
            *layout,
        ],
        "probe": [*head, "task=probe_synthetic", "task.n_records=16", *layout],
    }
    for name, args in tasks.items():
        out = tmp_path / name
        code, _, err = run_script("eval.py", [*args, f"out_dir={out}"], monkeypatch, capsys)
        assert code == 0, name + ": " + err[-2000:]
        res = json.loads((out / "results.json").read_text())
        assert res["model"]["architecture"] == "DeepseekV4ForCausalLM" and res["results"]["stride"] == 4
    needle = json.loads((tmp_path / "needle" / "results.json").read_text())["results"]
    assert needle["task"] == "needle" and needle["n_prompts"] == 8 and needle["modulus"] == 8
    probe = json.loads((tmp_path / "probe" / "results.json").read_text())["results"]
    assert [row["phase"] for row in probe["lengths"]][:4] == [0, 1, 2, 3]
    lookup = json.loads((tmp_path / "lookup" / "results.json").read_text())["results"]
    assert lookup["n_prompts"] == 16 * 8 and len(lookup["phase"]["groups"]) == 4
