"""The filler-length probe, plots and sweep summaries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ckv.config import ConfigError
from ckv.eval import (
    LookupSpec,
    ModelSource,
    ProbeSpec,
    RunOptions,
    StatsOptions,
    evaluate,
    find_runs,
    load_ckv_model,
    summarize,
    summarize_runs,
)
from ckv.eval.codec import TokenCodec
from ckv.eval.plots import _grid_cell_text, plot_grid_summary, stride_window_grids
from ckv.eval.probe import ProbeTask, lookup_prompt

from .helpers import make_run, png_ok

FAST = StatsOptions(n_bootstrap=50, n_permutations=50)
CODEC = TokenCodec(key_ids=tuple(range(10, 40)), value_ids=tuple(range(50, 90)), pad_id=1, prefix=[3], separator=[2])


def test_probe_finds_period_of_a_phase_sensitive_model() -> None:
    spec = ProbeSpec(source="lookup", lengths=(0, 15), stride=4)
    prompt = lookup_prompt(spec, CODEC, n_records=9)
    assert prompt.labels[0] == "target" and len(prompt.labels) == 3 and "record +1" in prompt.labels
    task = ProbeTask(spec, prompt, max_len=256)
    target_pos = len(CODEC.prefix) + 2 * 4  # the middle record (index 4) without filler

    def confused(input_ids: torch.Tensor) -> torch.Tensor:
        """Answers the next record's value whenever the target record's key lands on phase 3."""
        logits = torch.zeros(input_ids.shape[0], 100)
        for b, row in enumerate(input_ids.tolist()):
            pos = row.index(row[-1])
            logits[b, row[pos + 3] if pos % 4 == 3 else row[pos + 1]] = 10.0
        return logits

    rep = task.evaluate(confused, progress=False)
    expected = [(target_pos + n) % 4 != 3 for n in range(16)]
    assert [r["expected_is_top1"] for r in rep["lengths"]] == expected
    assert [r["phase"] for r in rep["lengths"]] == [n % 4 for n in range(16)]
    assert rep["periodicity"]["dominant_period"] == 4 and rep["periodicity"]["score"] == pytest.approx(1.0)
    assert rep["flips"] == 8
    shares = {p["phase"]: p["expected_top1_share"] for p in rep["phases"]}
    assert sorted(shares.values()) == [0.0, 1.0, 1.0, 1.0]
    # off the boundary phase the target's value is also the more probable candidate; on it, the next record's
    assert rep["headline"]["expected_best_share"] == pytest.approx(12 / 16)


def test_probe_limit_and_context_errors() -> None:
    spec = ProbeSpec(source="lookup", lengths=(0, 15))
    prompt = lookup_prompt(spec, CODEC, n_records=9)
    assert len(ProbeTask(spec, prompt, max_len=256, limit=5).prompts) == 5
    with pytest.raises(ConfigError, match="model's context is 20"):
        ProbeTask(spec, prompt, max_len=20)
    with pytest.raises(ConfigError, match=r"\{filler\} exactly once"):
        ProbeSpec(template="no slot", unit="x", candidates=("a",))


def test_synthetic_probe_on_a_ckv_run(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=dict(kind="compressed", window=4, stride=4, local_window=4))
    results, out = evaluate(
        load_ckv_model(run, device="cpu"),
        ProbeSpec(name="probe_synthetic", source="lookup", lengths=(0, 11)),
        RunOptions(progress=False),
    )
    assert out == run / "eval" / "probe_synthetic"
    r = results["results"]
    assert r["stride"] == 4 and r["labels"][0] == "target" and len(r["lengths"]) == 12
    assert png_ok(out / "probe_synthetic.png") and (out / "results.csv").is_file()


def test_sweep_summary_evaluates_runs_and_writes_plots(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    make_run(sweep, attention=dict(kind="compressed", window=4, stride=4, local_window=4), name="w4s4,seed=0")
    make_run(
        sweep,
        attention=dict(kind="compressed", window=8, stride=4, local_window=4, pooling="mean"),
        name="w8s4_mean,seed=0",
    )
    full = make_run(sweep, attention=dict(kind="full"), name="full,seed=0")
    ckpt = full / "checkpoints" / "step_00000005"  # a run still training: no model/, one checkpoint
    ckpt.mkdir(parents=True)
    (full / "model").rename(ckpt / "weights")
    (ckpt / "trainer_state.json").write_text("{}")
    assert [r.name for r in find_runs(sweep)] == ["full,seed=0", "w4s4,seed=0", "w8s4_mean,seed=0"]
    options = RunOptions(limit=4, progress=False, stats=FAST, device="cpu")
    summary, out = summarize_runs([sweep], LookupSpec(modulus=8, stride=4), ModelSource(), options)
    assert out == sweep / "summary" / "lookup" and (full / "eval" / "lookup" / "results.json").is_file()
    rows = {r["run"]: r for r in summary["runs"]}
    assert rows["w8s4_mean,seed=0"]["pooling"] == "mean" and rows["w8s4_mean,seed=0"]["window"] == 8
    assert rows["full,seed=0"]["stride"] is None and rows["full,seed=0"]["eval_stride"] == 4
    assert all(r["n_prompts"] == 32 for r in rows.values())
    for name in ("summary_grid.png", "comparison_residues.png", "comparison_phases.png"):
        assert png_ok(out / name)
    assert json.loads((out / "summary.json").read_text())["missing"] == []
    assert len((out / "summary.csv").read_text().splitlines()) == 4
    # summarising again reads the results instead of re-evaluating
    mtime = (full / "eval" / "lookup" / "results.json").stat().st_mtime_ns
    summarize(find_runs(sweep), "lookup", tmp_path / "again")
    assert (full / "eval" / "lookup" / "results.json").stat().st_mtime_ns == mtime
    # a summary of full attention alone has no stride x window to map, and leaves no stale grid behind
    before = (out / "comparison_phases.png").stat().st_mtime_ns
    assert [r["run"] for r in summarize([full], "lookup", out)["runs"]] == ["full,seed=0"]
    assert not (out / "summary_grid.png").exists() and png_ok(out / "comparison_phases.png")
    assert (out / "comparison_phases.png").stat().st_mtime_ns > before  # redrawn for the full run alone


def test_grid_summary_plot_with_several_seeds(tmp_path: Path) -> None:
    rows = []
    for seed in range(2):
        for pooling, gaps in (("gate", {4: 0.5, 6: 0.3, 8: 0.6}), ("mean", {4: 0.2, 8: 0.25})):
            for s, gap in gaps.items():
                rows.append(
                    dict(
                        pooling=pooling,
                        stride=s,
                        window=s,
                        seed=seed,
                        phase_gap=gap + 0.02 * seed,
                        phase_gap_lower=gap - 0.03,
                        phase_gap_upper=gap + 0.05,
                        worst_phase_accuracy=0.4 - gap / 2,
                        worst_phase_accuracy_lower=0.3 - gap / 2,
                        worst_phase_accuracy_upper=0.5 - gap / 2,
                    )
                )
        rows.append(dict(pooling="full", stride=None, window=None, phase_gap=0.03, worst_phase_accuracy=0.7))
    rows.append(dict(pooling="gate", stride=4, window=8, seed=0, phase_gap=0.9, worst_phase_accuracy=0.05))
    grids = stride_window_grids(rows, ["phase_gap", "worst_phase_accuracy"])
    assert list(grids) == ["gate", "mean"]  # full attention has no place on the grid
    gate, mean = grids["gate"], grids["mean"]
    assert gate.windows == mean.windows == [4, 6, 8] and gate.strides == mean.strides == [4, 6, 8]
    gap = gate.values["phase_gap"]  # (window, stride), percent, mean over the seeds of a cell
    assert gap[1, 1] == pytest.approx(31.0) and gap[2, 2] == pytest.approx(61.0)
    assert gap[2, 0] == pytest.approx(90.0) and np.isnan(gap[0, 2])  # W8/S4 is not W4/S8
    assert len(gate.cells[(6, 6)]) == 2 and np.isnan(mean.values["phase_gap"][1, 1])
    assert mean.values["worst_phase_accuracy"][0, 0] == pytest.approx(30.0)
    assert png_ok(plot_grid_summary(rows, tmp_path / "grid.png"))
    with pytest.raises(ValueError, match="no compressed runs"):
        plot_grid_summary([r for r in rows if r["stride"] is None], tmp_path / "full_only.png")


def test_grid_cells_show_intervals_and_mark_gaps_below_the_noise_floor() -> None:
    real = dict(
        seed=0, phase_gap=0.3, phase_gap_lower=0.2, phase_gap_upper=0.4, phase_p_value=0.001, phase_noise_floor=0.05
    )
    below_floor = dict(real, phase_gap_lower=0.04)
    not_significant = dict(real, phase_p_value=0.2)
    assert _grid_cell_text([real], "phase_gap", 30.0) == "30.0\n[20, 40]"
    assert _grid_cell_text([below_floor], "phase_gap", 30.0) == "30.0\n[4, 40]\nn.s."
    assert _grid_cell_text([not_significant], "phase_gap", 30.0).endswith("\nn.s.")
    assert _grid_cell_text([real, dict(below_floor, seed=1)], "phase_gap", 25.0) == "25.0\n(mean of 2 seeds)\nn.s."
    assert _grid_cell_text([real, real], "phase_gap", 30.0) == "30.0\n(mean of 2 runs: not only seeds)"
    assert (
        _grid_cell_text([dict(below_floor, mean=0.5)], "mean", 50.0) == "50.0"
    )  # no mean interval given; n.s. is for gaps
