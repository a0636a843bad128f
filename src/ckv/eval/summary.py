"""Summaries over many runs (a multirun sweep folder or a list of run folders): a table, a grid plot of phase gap
and worst-phase accuracy against stride and window, and comparison plots of the per-residue/per-phase curves."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from ckv.eval.plots import plot_grid_summary, plot_lookup_comparison, plot_phase_overlay
from ckv.io.layout import CHECKPOINTS_DIR, EVAL_DIR, MODEL_DIR, is_run_dir
from ckv.io.results import RESULTS_JSON, read_json, write_csv, write_json

PathLike = Union[str, Path]
SKIP = {CHECKPOINTS_DIR, EVAL_DIR, MODEL_DIR, ".hydra", "summary", "wandb"}


def find_runs(root: PathLike, max_depth: int = 3) -> list[Path]:
    """Run folders at or below ``root`` (a sweep folder holds one per job), sorted by path."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"summary={str(root)!r} is not a folder")
    found, frontier = [], [(root, 0)]
    while frontier:
        p, depth = frontier.pop()
        if is_run_dir(p):
            found.append(p)
            continue
        if depth < max_depth:
            frontier += [(c, depth + 1) for c in p.iterdir() if c.is_dir() and c.name not in SKIP]
    return sorted(found)


def results_file(run_dir: Path, task_name: str) -> Path:
    """Where ``eval.py`` writes a run's final-model results for ``task_name``."""
    return run_dir / EVAL_DIR / task_name / RESULTS_JSON


def run_label(results: dict, run_dir: Optional[Path] = None) -> str:
    """A short label: the run folder's name (Hydra names sweep jobs by overrides and seed), else the model name."""
    return run_dir.name if run_dir is not None else str(results["model"].get("name"))


def summary_row(label: str, results: dict) -> dict:
    """One table row of a lookup results.json: model geometry and headline statistics (fractions)."""
    att = results["model"].get("attention") or {}
    rep = results["results"]
    h, ph = rep["headline"], rep["phase"]
    worst = ph["groups"][ph["gap"]["worst_group"]]
    kind = att.get("kind")
    return {
        "run": label, "kind": kind, "pooling": att.get("pooling") if kind == "compressed" else kind,
        "window": att.get("window"), "stride": att.get("stride"), "seed": results["model"].get("seed"),
        "eval_stride": rep["stride"], "modulus": rep["modulus"], "n_prompts": rep["n_prompts"],
        "mean": h["mean"], "mean_lower": h["mean_lower"], "mean_upper": h["mean_upper"],
        "phase_gap": h["phase_gap"], "phase_gap_lower": h["phase_gap_lower"], "phase_gap_upper": h["phase_gap_upper"],
        "phase_p_value": h["phase_p_value"], "phase_noise_floor": h["phase_noise_floor"],
        "worst_phase": h["worst_phase"], "worst_phase_accuracy": h["worst_phase_accuracy"],
        "worst_phase_accuracy_lower": worst["lower"], "worst_phase_accuracy_upper": worst["upper"],
        "residue_gap": h["residue_gap"], "residue_noise_floor": h["residue_noise_floor"],
        "periodicity_score": h["periodicity_score"], "dominant_period": h["dominant_period"],
    }


def summarize(
    runs: Sequence[Path],
    task_name: str,
    out_dir: PathLike,
    evaluate_missing: Optional[Callable[[Path], None]] = None,
    rerun: bool = False,
) -> dict:
    """Collect each run's lookup results (evaluating runs without results through ``evaluate_missing``), then
    write ``summary.json``, ``summary.csv``, ``summary_grid.png`` (only when some runs are compressed: it maps stride
    x window), ``comparison_residues.png`` and ``comparison_phases.png`` into ``out_dir``. Returns the summary."""
    if not runs:
        raise FileNotFoundError("no runs to summarize (a run folder holds config.yaml and model/ or checkpoints/)")
    items: list[tuple[str, dict]] = []
    found: list[Path] = []
    missing: list[str] = []
    for run in runs:
        path = results_file(run, task_name)
        if (rerun or not path.is_file()) and evaluate_missing is not None:
            evaluate_missing(run)
        if not path.is_file():
            missing.append(str(run))
            continue
        results = read_json(path)
        if results["results"].get("task") != "lookup":
            raise ValueError(f"{path} holds a {results['results'].get('task')!r} task; summaries need a lookup task")
        items.append((run_label(results, run), results))
        found.append(run)
    if len({label for label, _ in items}) < len(items):  # jobs of different sweeps share names like "seed=0"
        items = [(f"{run.parent.name}/{label}", results) for run, (label, results) in zip(found, items)]
    if not items:
        raise FileNotFoundError(f"none of the {len(runs)} runs has {task_name} results: {missing[:5]}")
    rows = [summary_row(label, r) for label, r in items]
    out = Path(out_dir)
    summary = {"task": task_name, "runs": rows, "missing": missing}
    write_json(out / "summary.json", summary)
    write_csv(out / "summary.csv", rows)
    reports = [(label, r["results"]) for label, r in items]
    if any(r.get("stride") is not None for r in rows):
        plot_grid_summary(rows, out / "summary_grid.png")
    else:  # no stride x window to map; a grid from an earlier summary here would describe other runs
        (out / "summary_grid.png").unlink(missing_ok=True)
    plot_lookup_comparison(reports, out / "comparison_residues.png")
    plot_phase_overlay(reports, out / "comparison_phases.png")
    return summary
