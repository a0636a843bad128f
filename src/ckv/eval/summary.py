"""Summaries over many runs (a multirun sweep folder or a list of run folders): a table (residue gap and phase gap
of every run), a grid plot of the phase gap (mod each run's stride) and worst-phase accuracy against stride and
window, and comparison plots of the per-residue/per-phase curves."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional, Union

from ckv.config import ConfigError
from ckv.eval.plots import plot_grid_summary, plot_lookup_comparison, plot_phase_overlay
from ckv.io.layout import CHECKPOINTS_DIR, EVAL_DIR, MODEL_DIR, eval_dir, is_run_dir
from ckv.io.results import RESULTS_JSON, read_json, write_csv, write_json

PathLike = Union[str, Path]
log = logging.getLogger(__name__)
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
    return eval_dir(run_dir, task_name) / RESULTS_JSON


def run_label(results: dict, run_dir: Optional[Path] = None) -> str:
    """A short label: the run folder's name (Hydra names sweep jobs by overrides and seed), else the model name."""
    return run_dir.name if run_dir is not None else str(results["model"].get("name"))


SUMMARY_GAP_FIELDS = ("gap", "gap_lower", "gap_upper", "gap_interval", "p_value", "noise_floor")
# the flatness fields of a grouping's gap report (``ckv.eval.grouping.summarize_groups``): the one-sided upper bound,
# the equivalence margin, the verdict (gap / flat / undecided) and the minimum detectable gap with its power
FLATNESS_FIELDS = ("upper_one_sided", "margin", "verdict", "mde", "mde_power")


def flatness_fields(report: dict, prefix: str) -> dict:
    """``<prefix>_<field>`` for each of ``FLATNESS_FIELDS`` of one grouping (``residue`` or ``phase``) of a lookup
    report; ``None`` where the grouping was not made or the report predates them."""
    gap = (report.get(prefix) or {}).get("gap", {})
    return {f"{prefix}_{k}": gap.get(k) for k in FLATNESS_FIELDS}


def summary_row(label: str, results: dict) -> dict:
    """One table row of a lookup results.json: model geometry and headline statistics (fractions): the residue
    gap (mod ``modulus``) and the phase gap (mod ``eval_stride``; ``None`` for a model evaluated without a
    stride), each with interval, interval kind, permutation p, noise floor and the flatness fields
    (``flatness_fields``: one-sided upper bound, margin, verdict, minimum detectable gap), and the worst phase."""
    att = results["model"].get("attention") or {}
    rep = results["results"]
    h = rep["headline"]
    kind = att.get("kind")
    return {
        "run": label,
        "kind": kind,
        "pooling": att.get("pooling") or kind,  # a compressor's pooling, else the kind (full attention's: "full")
        "window": att.get("window"),
        "stride": att.get("stride"),
        "seed": results["model"].get("seed"),
        "eval_stride": rep["stride"],
        "modulus": rep["modulus"],
        "n_prompts": rep["n_prompts"],
        "mean": h["mean"],
        "mean_lower": h["mean_lower"],
        "mean_upper": h["mean_upper"],
        **{f"residue_{k}": h.get(f"residue_{k}") for k in SUMMARY_GAP_FIELDS},
        **flatness_fields(rep, "residue"),
        **{f"phase_{k}": h.get(f"phase_{k}") for k in SUMMARY_GAP_FIELDS},
        **flatness_fields(rep, "phase"),
        "worst_phase": h.get("worst_phase"),
        "worst_phase_accuracy": h.get("worst_phase_accuracy"),
        "worst_phase_accuracy_lower": h.get("worst_phase_lower"),
        "worst_phase_accuracy_upper": h.get("worst_phase_upper"),
        "group_interval": h.get("phase_group_interval") or h.get("residue_group_interval"),
        "periodicity_score": h["periodicity_score"],
        "dominant_period": h["dominant_period"],
    }


def check_comparable(rows: Sequence[dict]) -> None:
    """Runs of one summary are compared on one yardstick: the residue gap needs the same modulus for all runs, and
    every run the same number of prompts (``ConfigError`` otherwise: one line from eval.py); a full-attention
    control's phase gap is comparable only at a stride some compressed run has (a warning otherwise)."""
    moduli = sorted({r["modulus"] for r in rows})
    if len(moduli) > 1:
        raise ConfigError(
            f"the runs were evaluated with different task.modulus {moduli}: their residue gaps are not "
            "comparable; re-evaluate them with one modulus (summary_rerun=true)"
        )
    counts: dict[int, list[str]] = {}
    for r in rows:
        counts.setdefault(r["n_prompts"], []).append(r["run"])
    if len(counts) > 1:
        shown = "; ".join(f"{n:,}: {runs[:3]}{' ...' if len(runs) > 3 else ''}" for n, runs in sorted(counts.items()))
        raise ConfigError(
            f"the runs were evaluated on different numbers of prompts ({shown}; a different limit=?): a grid cell "
            "would average unequal evaluations; re-evaluate them alike (summary_rerun=true, one limit)"
        )
    strides = {r["stride"] for r in rows if r["stride"] is not None}
    for r in rows:
        if r["stride"] is None and strides and r["eval_stride"] not in strides:
            log.warning(
                "%s: full attention evaluated at stride %s, compressed runs at %s: its phase gap is not "
                "comparable (evaluate it with task.stride=<one of them>)",
                r["run"],
                r["eval_stride"],
                sorted(strides),
            )


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
    check_comparable(rows)
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
    if any(rep["phase"] for _, rep in reports):
        plot_phase_overlay(reports, out / "comparison_phases.png")
    else:  # no run was evaluated with a stride
        (out / "comparison_phases.png").unlink(missing_ok=True)
    return summary
