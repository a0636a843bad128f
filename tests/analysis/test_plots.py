"""The analysis plots of ``analysis=selection`` and ``make selection`` (``ckv.analysis.plots``): phases on x, one
series per selector (and per run), percentages on a fixed axis."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.figure import Figure

from ckv.analysis import plots

STRIDE = 4


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures the plot functions draw, kept instead of written."""
    drawn: list[Figure] = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or Path(path))
    return drawn


def _phases(rate: float) -> list[dict]:
    covered = {"rate": rate, "lower": rate / 2, "upper": (1 + rate) / 2}
    return [{"phase": p, "accuracy": rate, "layers": [{"covered": covered}]} for p in range(STRIDE)]


def _result(selectors: dict[str, float]) -> dict:
    geometric = {"phases": [{"phase": p, "covered": [0.25]} for p in range(STRIDE)]}
    phases = {name: {"phases": _phases(rate)} for name, rate in selectors.items()}
    return {"selectors": phases, "geometric": geometric, "stride": STRIDE, "topk": 2}


def test_the_selection_analysis_plots_accuracy_and_coverage_per_phase(figures: list[Figure], tmp_path: Path):
    plots.plot_selection(_result({"model": 0.5, "random": 0.25}), tmp_path / "selection.png", "a run")
    acc, cov = figures[-1].axes
    assert [t.get_text() for t in acc.get_legend().get_texts()] == ["model", "random"]
    assert [t.get_text() for t in cov.get_legend().get_texts()] == ["random (geometry)", "model", "random"]
    assert list(acc.get_xticks()) == list(range(STRIDE)) and acc.get_ylim() == (-2.0, 102.0)
    assert figures[-1]._suptitle.get_text() == "a run: top-2"


def test_the_selection_study_plots_each_run_and_each_models_selectors(figures: list[Figure], tmp_path: Path):
    rows = [{"model": m, "seed": s, "per_phase": [0.5] * STRIDE} for m in ("dense", "sparse") for s in (0, 1)]
    sel_rows = [{"model": m, "selector": s} for m in ("dense", "sparse") for s in ("oracle", "random")]
    analyses = {f"{m}/seed={s}": _result({"oracle": 0.75, "random": 0.25}) for m in ("dense", "sparse") for s in (0, 1)}
    settings = dict(models=("dense", "sparse", "full"), seeds=(0, 1), layer=0, stride=STRIDE, topk=2, solid="sparse")
    plots.plot_selection_study(rows, sel_rows, analyses, tmp_path / "study.png", **settings)
    acc, cov = figures[-1].axes
    assert len(acc.get_lines()) == len(rows)
    styles = {line.get_label(): line.get_linestyle() for line in cov.get_lines()}
    assert styles == {
        "dense: oracle": "--",
        "dense: random": "--",
        "sparse: oracle": "-",
        "sparse: random": "-",
        "random top-2 (geometry)": "--",
    }
    assert [y for y in cov.get_lines()[0].get_ydata()] == [75.0] * STRIDE  # the mean over the seeds, in percent
