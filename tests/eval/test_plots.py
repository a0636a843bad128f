"""Plots say whom and what they show and stay readable: a run's plot is titled by its run folder, attention and
seed (the runs of a sweep share their name), the task's plot by the task's name, probability axes span 0-100% at
most, and the comparison's panels keep their tick and axis labels apart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from matplotlib.figure import Figure

from ckv.eval import plots
from ckv.eval.codec import TokenCodec
from ckv.eval.lookup import LookupSpec, LookupTask
from ckv.eval.models import inspect_ckv_model
from ckv.eval.runner import plot_title
from ckv.eval.stats import StatsOptions

from .helpers import ReadingOracle, make_run

CODEC = TokenCodec(key_ids=tuple(range(10, 40)), value_ids=tuple(range(50, 90)), pad_id=1, prefix=[3], separator=[2])


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures the plot functions draw, kept instead of written."""
    drawn: list[Figure] = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or Path(path))
    return drawn


def _report(model_stride: int | None, modulus: int = 24, name: str = "lookup", wrong=None) -> dict:
    spec = LookupSpec(name=name, n_records=12, n_demos=3, n_base=modulus, modulus=modulus)
    task = LookupTask(spec, CODEC, max_len=512, model_stride=model_stride)
    return task.report(task.evaluate(ReadingOracle(100, wrong), progress=False), StatsOptions(50, 50))


def test_a_runs_plot_is_titled_by_the_run(tmp_path: Path) -> None:
    sweep = tmp_path / "cpu_grid"
    gate = make_run(sweep, attention=dict(kind="compressed", window=4, stride=4), name="attention=w4s4,seed=1", seed=1)
    full = make_run(sweep, attention=dict(kind="full"), name="custom")
    assert plot_title(inspect_ckv_model(gate)[0]) == "attention=w4s4,seed=1/attention=w4s4,seed=1 (W4/S4 gate)"
    assert plot_title(inspect_ckv_model(full)[0]) == "custom/custom (full attention, seed 0)"


def test_the_task_names_its_plot_and_the_axis_stays_within_0_and_100(figures: list[Figure], tmp_path: Path) -> None:
    plots.plot_lookup(_report(4, modulus=8, name="needle"), tmp_path / "needle.png", "a run")
    fig = figures[-1]
    assert fig._suptitle.get_text().startswith("a run: needle, n=")
    for ax in fig.axes:  # every prompt answered: points at 100% on the axis' edge, drawn whole
        assert ax.get_ylim() == (0.0, 100.0)
        assert not any(artist.get_clip_on() for artist in ax.collections)


def test_probe_probability_axis_starts_at_0(figures: list[Figure], tmp_path: Path) -> None:
    rows = [{"filler_tokens": n, "logp[a]": -4.0 - n % 2, "logp[b]": -5.0, "top1_is": "x"} for n in range(8)]
    report = {"lengths": rows, "labels": ["a", "b"], "stride": 4, "flips": 0, "name": "probe", "periodicity": {}}
    plots.plot_probe(report, tmp_path / "probe.png", "a run")
    bottom, top = figures[-1].axes[0].get_ylim()
    assert bottom == 0.0 and 0.0 < top <= 100.0


def test_comparison_panels_keep_their_labels_apart(figures: list[Figure], tmp_path: Path) -> None:
    full, gate = _report(None), _report(4)
    items = [(f"run{i}", full if i % 2 else gate) for i in range(6)]
    plots.plot_lookup_comparison(items, tmp_path / "comparison_residues.png")
    axes = [ax for ax in figures[-1].axes if ax.get_visible()]
    assert len(axes) == 6
    assert all(len(ax.get_xticks()) <= plots.MAX_TICKS for ax in axes)  # mod 24 without a stride: every 3rd
    assert [bool(ax.get_ylabel()) for ax in axes] == [True, False, False, False, True, False]  # once per row
    assert all(ax.get_ylim() == (0.0, 100.0) for ax in axes)


def test_worst_phase_vs_kv_bytes_draws_a_panel_per_task_and_a_series_per_model(figures: list[Figure], tmp_path: Path):
    """The robustness studies' plot (``make robust``): tasks in the models' order, models in their task's order,
    memory on a log axis, each model's role in its label."""
    models = {
        "split": [SimpleNamespace(name="w4s4", role="baseline"), SimpleNamespace(name="conv", role="fix")],
        "dense": [SimpleNamespace(name="full", role="control")],
    }
    rows = [
        {"task": task, "model": m.name, "kv_bytes_per_token": 2.0**i, "worst_phase_accuracy": 0.5}
        for task, ms in models.items()
        for i, m in enumerate(ms, start=4)
    ]
    plots.plot_worst_phase_vs_kv_bytes(rows[::-1], models, tmp_path / "robust.png")
    axes = figures[-1].axes
    assert [ax.get_title() for ax in axes] == ["split: one point per seed", "dense: one point per seed"]
    assert all(ax.get_xscale() == "log" for ax in axes)
    labels = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in axes]
    assert labels == [["w4s4 (baseline)", "conv (fix)"], ["full (control)"]]


def test_the_phase_grid_has_a_row_per_evaluation_a_column_per_model_and_a_line_per_report(figures, tmp_path):
    """make csa2's figure: one panel per (evaluation, model), each report a line over its stride's phases; a model
    without a report under an evaluation is a panel that says so."""
    two, four = _report(2), _report(4)
    columns = [
        ("v41_r2", {"prefix": [("seed 42", two), ("seed 43", two)], "in_sequence": [("seed 42", two)]}),
        ("deepseek_w8s4", {"prefix": [("seed 42", four)]}),
    ]
    plots.plot_phase_grid(columns, tmp_path / "phases.png")
    axes = figures[-1].axes
    assert [ax.get_title() for ax in axes] == [
        "v41_r2: prefix",
        "deepseek_w8s4: prefix",
        "v41_r2: in_sequence",
        "deepseek_w8s4: in_sequence",
    ]
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["seed 42", "seed 43"]
    assert list(axes[0].get_xticks()) == [0, 1] and list(axes[1].get_xticks()) == [0, 1, 2, 3]
    assert any(t.get_text() == "no results" for t in axes[3].texts) and not axes[3].lines
    assert all(ax.get_ylim() == (0.0, 100.0) for ax in axes)
    with pytest.raises(ValueError, match="no model has a lookup report"):
        plots.plot_phase_grid([("x", {})], tmp_path / "none.png")
