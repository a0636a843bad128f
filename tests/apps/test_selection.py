"""make selection: the plan's runs, the table and checks on constructed rows, and the quick pipeline run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckv.apps.demo import QUICK_TRAIN
from ckv.apps.selection import MODELS, N_BASE, SEEDS, STRIDE, TOPK, checks, plan, table
from tests.apps.helpers import run_quick
from tests.eval.helpers import png_ok
from tests.train.test_entry import _train_config


def test_plan_trains_every_model_for_every_seed_with_one_attention_option():
    runs = plan(SEEDS)
    assert len(runs) == len(MODELS) * len(SEEDS) == 8
    assert {r.experiment for r in runs} == {"select_lookup"}
    by = {(r.name, r.seed): r for r in runs}
    assert by[("dense", 0)].train_overrides == ("attention=deepseek_v4_csa",)
    for name in ("sparse", "oracle"):
        assert by[(name, 1)].train_overrides[1] == f"attention.selection.topk={TOPK}"
    # full attention's phases: mod the stride
    assert by[("full", 0)].eval_overrides == (f"task.n_base={N_BASE}", f"task.stride={STRIDE}")
    assert all(r.eval_overrides == (f"task.n_base={N_BASE}",) for r in runs if r.role != "control")
    assert plan(SEEDS[:1], quick=True)[-1].eval_overrides == (f"task.stride={STRIDE}",)  # QUICK_EVAL sets n_base


@pytest.mark.parametrize("quick", [False, True])
def test_every_run_composes_and_the_sparse_model_trains_dense_then_sparse(quick):
    for run in plan(SEEDS[:1], quick):
        cfg = _train_config([f"experiment={run.experiment}", *run.train_overrides, *(QUICK_TRAIN if quick else ())])
        dense = cfg.trainer.indexer.dense_steps
        assert (dense > 0) == (run.role == "indexer"), run.name
        assert dense < cfg.trainer.max_steps
        if run.role == "indexer" and not quick:
            assert (dense, cfg.trainer.max_steps) == (900, 1200)  # V4's order: mostly dense, then sparse


def _row(model: str, role: str, seed: int, mean: float, verdict: str, covered=None) -> dict:
    return dict(
        model=model,
        role=role,
        seed=seed,
        steps=1000,
        train_seconds=100.0,
        stride=4,
        mean=mean,
        per_phase=[mean] * 4,
        worst_phase=0,
        worst_phase_accuracy=mean,
        phase_gap=0.01,
        phase_gap_lower=0.0,
        phase_gap_upper=0.03,
        phase_p_value=0.5,
        phase_noise_floor=0.02,
        phase_upper_one_sided=0.03,
        phase_mde=0.04,
        phase_margin=0.05,
        phase_verdict=verdict,
        recall=0.9 if role == "indexer" else None,
        covered=covered,
    )


def test_the_table_and_the_checks_read_every_seed():
    cov = [[1.0, 0.5]] * 4  # per phase, layers L0 / L1
    rows = [
        _row("dense", "dense", 0, 0.9, "flat"),
        _row("sparse", "indexer", 0, 0.8, "gap", cov),
        _row("full", "control", 0, 0.95, "flat"),
        _row("full", "control", 1, 0.79, "flat"),
    ]
    text = table(rows)
    assert "100/50 | 100/50 | 100/50 | 100/50" in text and "0.90" in text and "every visible entry" in text
    found = checks(rows)
    assert [c.passed for c in found] == [False, False]  # a control seed under 80%; the sparse model has a gap
    assert "seed 1: 79.0%" in found[0].detail and "dense: flat" in found[1].detail


@pytest.mark.slow
def test_quick_selection_writes_a_table_a_plot_and_a_record(tmp_path):
    out = tmp_path / "selection"
    proc = run_quick("ckv.apps.selection", out)
    record = json.loads((out / "selection.json").read_text())
    assert [r["model"] for r in record["rows"]] == [m.name for m in MODELS] + ["dense+oracle"]
    for r in record["rows"]:
        assert r["steps"] == 12 and len(r["per_phase"]) == STRIDE
        assert (r["covered"] is None) == (r["role"] in ("dense", "control"))
    imposed = record["rows"][-1]  # the dense run's weights, oracle top-k imposed: its steps, its own statistics
    assert imposed["role"] == "imposed" and imposed["results"] == record["rows"][0]["results"]
    assert "target covered" in proc.stdout and png_ok(Path(record["plot"]))
