"""``conf/study/paper.yaml``'s report (docs/paper.md): ckv's numbers beside the paper's controlled table, the rank
agreement across the compressed variants, and the study's claims.

Not an app: the generic command (``python -m ckv.apps.study paper``) calls ``report`` after the runs. Every number
read here is the mod-24 grouping of ckv's lookup report (``residue``: target position mod 24, the paper's groups):
mean, worst group and best-minus-worst gap, each with its cluster-bootstrap interval, for each padding.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import numpy as np

from ckv.apps.study import ROOT, Check, Study, pp

PADDINGS = ("prefix", "in_sequence")  # the study's evaluations; the CSV spells the second "in-sequence"
METRICS = ("mean", "worst", "gap")


def measured(report: dict) -> dict[str, tuple[Optional[float], Optional[float], Optional[float]]]:
    """One evaluation's mean, worst group and gap over the groups mod 24, each ``(value, lower, upper)``."""
    h = report["headline"]
    return {
        "mean": (h["mean"], h["mean_lower"], h["mean_upper"]),
        "worst": (h["worst_residue_accuracy"], h["worst_residue_lower"], h["worst_residue_upper"]),
        "gap": (h["residue_gap"], h["residue_gap_lower"], h["residue_gap_upper"]),
    }


def _number(text: str) -> Optional[float]:
    """A CSV cell in percent as a fraction; ``None`` for an empty cell."""
    return float(text) / 100 if text.strip() else None


def read_paper(path: Path) -> tuple[dict[tuple[str, str], dict], str]:
    """The paper's rows by ``(variant_id, padding)`` (padding as the study names it) with ``mean``, ``worst`` and
    ``gap`` as ``(value, lower, upper)`` fractions, and why there are none (``""`` when read)."""
    if not path.is_file():
        return {}, f"the paper's column is n/a: {path} is absent (the shared folder beside the checkout)"
    rows = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows[(r["variant_id"], r["padding"].replace("-", "_"))] = {
                "mean": (_number(r["mean_acc"]), _number(r["mean_acc_ci_lo"]), _number(r["mean_acc_ci_hi"])),
                "worst": (_number(r["worst_acc"]), None, None),
                "gap": (_number(r["gap_pp"]), _number(r["gap_ci_lo"]), _number(r["gap_ci_hi"])),
            }
    return rows, ""


def paper_path(study: Study) -> Path:
    """The paper's CSV: ``params.paper_csv`` relative to the checkout (``../shared/paper/...``)."""
    return (ROOT / study.params["paper_csv"]).resolve()


def _cell(v: tuple[Optional[float], Optional[float], Optional[float]]) -> str:
    value, lo, hi = v
    if value is None:
        return "n/a"
    return pp(value) if lo is None or hi is None else f"{pp(value)} [{pp(lo)}, {pp(hi)}]"


def side_by_side(rows: dict[str, dict[str, dict]], ids: dict[str, str], paper: dict[tuple[str, str], dict]) -> str:
    """The table, one line per run and padding in the paper's order (``ids``: run label -> paper variant_id, the
    paper's order): ckv's mean / worst / gap (pp, 95% interval) beside the paper's. ``rows``: run label -> padding
    -> ``measured``; a run that did not finish, or a row the paper lacks, reads ``n/a``."""
    head = f"{'run':26s} {'padding':11s}" + "".join(f" {'ckv ' + m:>20s} {'paper ' + m:>20s}" for m in METRICS)
    lines = [head]
    empty = dict.fromkeys(METRICS, (None, None, None))
    for label, vid in ids.items():
        for pad in PADDINGS:
            ours, theirs = rows.get(label, {}).get(pad, empty), paper.get((vid, pad), empty)
            lines.append(
                f"{label:26s} {pad:11s}" + "".join(f" {_cell(ours[m]):>20s} {_cell(theirs[m]):>20s}" for m in METRICS)
            )
    return "\n".join(lines)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks (1..n) of ``x`` along the last axis, ties sharing their mean rank."""
    order = np.argsort(x, axis=-1, kind="stable")
    ranks = np.empty_like(x, dtype=np.float64)
    np.put_along_axis(ranks, order, np.arange(1, x.shape[-1] + 1, dtype=np.float64) * np.ones_like(x), axis=-1)
    for idx in np.ndindex(x.shape[:-1]):
        row, r = x[idx], ranks[idx]
        for v in np.unique(row):
            tie = row == v
            r[tie] = r[tie].mean()
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation of ``a`` and ``b`` along the last axis (NaN where either is constant)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdims=True), rb - rb.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(-1) / np.sqrt((ra**2).sum(-1) * (rb**2).sum(-1))


def rank_agreement(
    ours: list[float], theirs: list[float], n_bootstrap: int = 2000, seed: int = 0
) -> tuple[float, Optional[float], Optional[float]]:
    """Spearman's rho of two paired lists (variants) with a 95% percentile bootstrap interval over variants
    (resamples with a constant side are dropped); the interval is ``None`` with fewer than 3 pairs."""
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    rho = float(spearman(a, b))
    if len(a) < 3:
        return rho, None, None
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_bootstrap, len(a)))
    boot = spearman(a[idx], b[idx])
    boot = boot[np.isfinite(boot)]
    lo, hi = np.percentile(boot, [2.5, 97.5]) if len(boot) else (None, None)
    return rho, None if lo is None else float(lo), None if hi is None else float(hi)


def rank_lines(
    rows: dict[str, dict[str, dict]], ids: dict[str, str], paper: dict[tuple[str, str], dict], compressed: list[str]
) -> list[tuple[str, tuple[float, Optional[float], Optional[float]], int]]:
    """Spearman agreement with the paper across the ``compressed`` runs, per padding, of the gap and of the worst
    group: ``(what, (rho, lower, upper), n variants)``; a run or paper row missing is left out."""
    out = []
    for pad in PADDINGS:
        for metric in ("gap", "worst"):
            pairs = [
                (rows[lab][pad][metric][0], paper[(ids[lab], pad)][metric][0])
                for lab in compressed
                if pad in rows.get(lab, {}) and (ids[lab], pad) in paper
            ]
            if len(pairs) >= 2:
                a, b = zip(*pairs)
                out.append((f"Spearman of {metric} ({pad})", rank_agreement(list(a), list(b)), len(pairs)))
    return out


def run_rows(done: list[dict]) -> dict[str, dict[str, dict]]:
    """Finished runs' numbers: label -> padding -> ``measured``."""
    return {d["run"].label: {k: measured(v) for k, v in d["evaluations"].items()} for d in done}


def report(study: Study, done: list[dict], out: Path, quick: bool) -> list[Check]:
    """Print and write (``<out>/paper_table.txt``) the side-by-side table and the rank agreement; return the
    study's claims as checks."""
    paper, why = read_paper(paper_path(study))
    ids: dict[str, str] = study.params["paper_ids"]
    rows = run_rows(done)
    compressed = [lab for lab in ids if not ids[lab].startswith("full_attn")]
    text = [side_by_side(rows, ids, paper)] + ([why] if why else [])
    for what, (rho, lo, hi), n in rank_lines(rows, ids, paper, compressed):
        text.append(
            f"{what}: {rho:.2f} [{'-' if lo is None else f'{lo:.2f}'}, {'-' if hi is None else f'{hi:.2f}'}]"
            f" over {n} compressed variants"
        )
    print("\n" + "\n".join(text) + "\n")
    (out / "paper_table.txt").write_text("\n".join(text) + "\n")
    return []
