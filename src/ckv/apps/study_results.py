"""The studies' results: ``result_row`` is the one row of a run's results every table, criterion and record reads;
``write_table`` the one table writer (over ``Column``s; ``table`` prints the per-phase one); ``Check`` a claim and
its verdict (``every_seed``, ``check_lines``, ``exit_code``); ``CONTROL_LEARNED`` the bar every study's control is
judged against; ``write_study_record`` writes ``<out>/<record>.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ckv.apps.study_config import TASK
from ckv.apps.study_run import Timer
from ckv.eval.summary import flatness_fields, results_file
from ckv.io.results import write_json

# a full-attention control has learned a lookup task when its mean accuracy reaches this; below it, "as good as full
# attention" means nothing (the bar of make demo, make demo-v4 and make robust's goal and confirmation)
CONTROL_LEARNED = 0.40


@dataclass
class Check:
    """One claim of a study and whether the run's numbers support it."""

    claim: str
    passed: bool
    detail: str
    decided: bool = True  # False: the numbers neither support nor refute the claim (``passed`` is then False)


def check_lines(checks: list[Check], words: tuple[str, ...]) -> list[str]:
    """One printed line per check: ``  [<words[0]>] claim: detail`` when it passed, ``[<words[1]>]`` when not, and
    ``[<words[2]>]`` (default ``undecided``) when the numbers decide neither way."""
    undecided = words[2] if len(words) > 2 else "undecided"
    return [
        f"  [{words[0] if c.passed else words[1] if c.decided else undecided}] {c.claim}: {c.detail}" for c in checks
    ]


def result_row(d: dict) -> dict:
    """The one row of a finished run (``train_and_evaluate``'s record) every study's tables, criteria and records
    read: its role, seed, budget, and its lookup report's mean, per-phase accuracy with intervals, worst phase,
    phase gap (interval, permutation p, noise floor), residue gap, both gaps' flatness fields
    (``ckv.eval.summary.flatness_fields``: one-sided upper bound, margin, verdict, MDE), the dominant period, and
    the run folder (``results``)."""
    rep, run = d["results"], d["run"]
    h, phase, residue = rep["headline"], rep["phase"], rep["residue"]["gap"]
    return {
        "role": run.role,
        "seed": run.seed,
        "steps": d["steps"],
        "train_seconds": d["train_seconds"],
        "stride": rep["stride"],
        "mean": h["mean"],
        "per_phase": [g["accuracy"] for g in phase["groups"]],
        "per_phase_lower": [g["lower"] for g in phase["groups"]],
        "per_phase_upper": [g["upper"] for g in phase["groups"]],
        "mean_lower": phase["mean"]["lower"],
        "mean_upper": phase["mean"]["upper"],
        "worst_phase": h["worst_phase"],
        "worst_phase_accuracy": h["worst_phase_accuracy"],
        "phase_gap": h["phase_gap"],
        "phase_gap_lower": h["phase_gap_lower"],
        "phase_gap_upper": h["phase_gap_upper"],
        "phase_p_value": h["phase_p_value"],
        "phase_noise_floor": h["phase_noise_floor"],
        "residue_gap": residue["value"],
        "residue_gap_lower": residue["lower"],
        "residue_gap_upper": residue["upper"],
        "residue_noise_floor": residue["noise_floor"],
        **flatness_fields(rep, "phase"),
        **flatness_fields(rep, "residue"),
        "dominant_period": h["dominant_period"],
        "periodicity_score": h["periodicity_score"],
        "results": str(d["dir"]),
    }


def pp(x: Optional[float]) -> str:
    """A fraction as percentage points with one decimal, ``-`` when not computed."""
    return "-" if x is None else f"{100 * x:.1f}"


@dataclass(frozen=True)
class Column:
    """One column of a study's printed table: its ``header``, the ``cell`` text of a row, the ``width`` both are
    padded to (``align``: ``<`` left, ``>`` right) and the ``gap`` printed before it (none before the first)."""

    header: str
    cell: Callable[[dict], str]
    width: int = 0
    align: str = ">"
    gap: str = " "


def write_table(rows: list[dict], columns: Sequence[Column]) -> str:
    """The one table writer of the studies: a header line, then one line per row (a dict, e.g. ``result_row``'s)."""

    def line(texts: list[str]) -> str:
        return "".join((c.gap if i else "") + f"{t:{c.align}{c.width}}" for i, (c, t) in enumerate(zip(columns, texts)))

    return "\n".join([line([c.header for c in columns]), *(line([c.cell(r) for c in columns]) for r in rows)])


def interval_text(r: dict, key: str) -> str:
    """``r[key]`` with its interval (``<key>_lower``, ``<key>_upper``) in pp: ``40.0 [30.0, 50.0]``."""
    return f"{100 * r[key]:.1f} [{100 * r[key + '_lower']:.1f}, {100 * r[key + '_upper']:.1f}]"


def gap_text(r: dict, prefix: str = "phase") -> str:
    """A row's ``<prefix>`` gap in a check's words: ``gap 40.0 pp [30.0, 50.0]``."""
    g = f"{prefix}_gap"
    return f"gap {100 * r[g]:.1f} pp [{100 * r[g + '_lower']:.1f}, {100 * r[g + '_upper']:.1f}]"


def per_phase_column(width: int, decimals: int, gap: str = "  ", sep: str = "  ") -> Column:
    """The per-phase accuracy column: each phase's accuracy in % with ``decimals``, then ``(S=<stride>)``."""

    def cell(r: dict) -> str:
        return " / ".join(f"{100 * a:.{decimals}f}" for a in r["per_phase"]) + f"{sep}(S={r['stride']})"

    return Column("per-phase accuracy % (phase = pos mod S)", cell, width, "<", gap)


# the cell of each statistic of a grouping's gap (``<grouping>_gap`` ... in ``result_row``), by name
GAP_CELLS: dict[str, Callable[[str], Callable[[dict], str]]] = {
    "gap": lambda g: lambda r: interval_text(r, f"{g}_gap"),
    "p": lambda g: lambda r: f"{r[f'{g}_p_value']:.4f}",
    "floor": lambda g: lambda r: f"{100 * r[f'{g}_noise_floor']:.1f}",
    "upper": lambda g: lambda r: pp(r[f"{g}_upper_one_sided"]),
    "mde": lambda g: lambda r: pp(r[f"{g}_mde"]),
    "verdict": lambda g: lambda r: str(r[f"{g}_verdict"]),
}


def gap_columns(grouping: str, stats: str, headers: Sequence[str], widths: Sequence[int]) -> tuple[Column, ...]:
    """Columns of the gap statistics of ``grouping`` (``phase`` or ``residue``): ``stats`` names them in order
    (space-separated keys of ``GAP_CELLS``), with their ``headers`` and ``widths``."""
    return tuple(Column(h, GAP_CELLS[s](grouping), w) for s, h, w in zip(stats.split(), headers, widths, strict=True))


# the phase gap's statistics in the compact tables (make robust's, make selection's)
COMPACT_PHASE_COLUMNS = gap_columns(
    "phase",
    "gap floor p upper mde verdict",
    ("phase gap pp [95%]", "floor", "p", "<= pp", "MDE", "verdict"),
    (19, 5, 6, 5, 5, 9),
)
STUDY_COLUMNS = (
    Column("model", lambda r: r["label"], 22, "<", ""),
    Column("steps", lambda r: f"{r['steps']:d}", 6),
    Column("train s", lambda r: f"{r['train_seconds']:.0f}", 8),
    Column("mean %", lambda r: f"{100 * r['mean']:.1f}", 7),
    per_phase_column(44, 1),
    *gap_columns(
        "phase",
        "gap p floor upper mde verdict",
        ("gap pp [95%]", "perm p", "floor pp", "<= pp", "MDE pp", "verdict"),
        (20, 7, 8, 5, 6, 9),
    ),
    Column("period", lambda r: str(r["dominant_period"]), 6),
)


def table(done: list[dict], learned: Optional[list[bool]] = None) -> str:
    """The per-phase table (make demo, make demo-grid, make demo-v4), one line per run: mean, per-phase accuracy,
    phase gap (mod S) with interval, permutation p and noise floor, the gap's one-sided 95% upper bound, the minimum
    detectable gap (80% power), the verdict (gap / flat / undecided, ``ckv.eval.flatness.gap_verdict``), the dominant
    period, and with ``learned`` (one flag per run) a last column ``learned``: ``yes`` or ``NO``."""
    rows = [{**result_row(d), "label": d["run"].label} for d in done]
    columns = STUDY_COLUMNS
    if learned is not None:
        rows = [{**r, "learned": flag} for r, flag in zip(rows, learned)]
        columns += (Column("learned", lambda r: "yes" if r["learned"] else "NO", 0, "<", "  "),)
    return write_table(rows, columns)


def every_seed(claim: str, seeds: Sequence[int], passed: Sequence[bool], details: Sequence[str]) -> Check:
    """A criterion that must hold in every seed: passed when it holds in each, its detail ``seed <s>: ...``."""
    return Check(claim, all(passed), "; ".join(f"seed {s}: {d}" for s, d in zip(seeds, details)))


def control_learned(r: dict) -> bool:
    """Whether a control (its ``result_row``) has learned the task: its mean reaches ``CONTROL_LEARNED``."""
    return r["mean"] >= CONTROL_LEARNED


def run_records(done: list[dict], task: str = TASK) -> list[dict]:
    """The runs as a study's JSON record lists them: label, role, folder, budget, results file."""
    return [
        {
            "label": d["run"].label,
            "role": d["run"].role,
            "dir": str(d["dir"]),
            "steps": d["steps"],
            "train_seconds": d["train_seconds"],
            "results": str(results_file(d["dir"], task)),
        }
        for d in done
    ]


def exit_code(checks: list[Check], quick: bool) -> int:
    """1 when a science check failed (decided and not passed), else 0: an undecided claim is an answer, not an error
    (no checks: 0). Quick mode (a pipeline check whose thresholds are not expected to hold) always gives 0."""
    return 0 if quick or all(c.passed or not c.decided for c in checks) else 1


def write_study_record(out: Path, name: str, quick: bool, clock: Timer, png: Optional[Path], record: dict) -> None:
    """A study's last step (``make robust``, ``make selection``, the generic command): ``<out>/<name>.json`` holds
    ``quick``, the seconds so far, ``record`` and the plot's path (``None``: no plot); then the quick-mode warning
    and where everything is."""
    path = out / f"{name}.json"
    plot = None if png is None else str(png)
    write_json(path, {"quick": quick, "seconds": time.monotonic() - clock.start, **record, "plot": plot})
    if quick:
        print("quick mode: a few steps per model; the numbers above check the pipeline, not the science")
    print(f"[{clock}] {'' if png is None else f'plot: {png}; '}record: {path}")
