"""PNG plots of evaluation reports (matplotlib's object API: no pyplot state, no display needed).

Every accuracy plot shows percentages on a fixed 0-100 axis, 95% intervals as error bars, the mean as a dashed
line, and says in its title what the best-minus-worst gap, its interval and the noise floor are.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

PathLike = Union[str, Path]
PCT = 100.0
DPI = 120


def _pct(x: Optional[float]) -> float:
    return np.nan if x is None else PCT * x


def _fmt_pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{PCT * x:.1f}"


def _fmt_p(p: Optional[float]) -> str:
    return "n/a" if p is None else (f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}")


def _colors(n: int) -> list:
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _save(fig: Figure, path: PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=DPI, bbox_inches="tight")
    return p


def gap_text(grouping: dict, unit: str = "pp") -> str:
    """``gap 40.2 pp [36.1, 44.0], noise floor 2.8, p=0.0005`` for a ``summarize_groups`` report."""
    g = grouping["gap"]
    return (f"gap {_fmt_pct(g['value'])} {unit} [{_fmt_pct(g['lower'])}, {_fmt_pct(g['upper'])}], "
            f"noise floor {_fmt_pct(g['noise_floor'])}, p={_fmt_p(g['p_value'])}")


def _yerr(y: np.ndarray, groups: list[dict]) -> np.ndarray:
    """(2, G) error-bar lengths (percent) from each group's interval around ``y``."""
    lo = np.array([PCT * g["lower"] for g in groups])
    hi = np.array([PCT * g["upper"] for g in groups])
    return np.maximum(np.stack([y - lo, hi - y]), 0.0)


def _group_curve(ax: Axes, grouping: dict, *, stride: Optional[int], label: Optional[str] = None,
                 color=None, bars: bool = False) -> None:
    """Accuracy per group with Wilson intervals and the mean line (points coloured by phase if ``stride``)."""
    groups = grouping["groups"]
    x = np.array([g["group"] for g in groups])
    y = np.array([_pct(g["accuracy"]) for g in groups])
    err = _yerr(y, groups)
    mean = grouping["mean"]
    if bars:
        ax.bar(x, y, color=color or "tab:blue", alpha=0.35, label=label)
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor="black", capsize=3, lw=1)
    else:
        ax.plot(x, y, "-", color=color or "0.6", lw=1, zorder=1, label=label if color is not None else None)
        colors = [_colors(stride)[xi % stride] for xi in x] if stride and color is None else [color or "tab:blue"] * len(x)
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor="0.4", capsize=2, lw=0.8, zorder=2)
        ax.scatter(x, y, c=colors, s=22, zorder=3, edgecolors="black", linewidths=0.4)
    ax.axhline(_pct(mean["value"]), ls="--", color=color or "black", lw=1,
               label=f"mean {_fmt_pct(mean['value'])}% [{_fmt_pct(mean['lower'])}, {_fmt_pct(mean['upper'])}]"
               if color is None else None)
    if mean["lower"] is not None and color is None:
        ax.axhspan(_pct(mean["lower"]), _pct(mean["upper"]), color="0.85", zorder=0)
    ax.set_ylim(-3, 103)
    ax.set_ylabel("top-1 accuracy (%)")
    ax.grid(axis="y", alpha=0.3)


def _phase_legend(ax: Axes, stride: int) -> None:
    handles = [Line2D([], [], marker="o", ls="", color=c, markeredgecolor="black", label=f"phase {p}")
               for p, c in enumerate(_colors(stride))]
    ax.legend(handles=ax.get_legend_handles_labels()[0] + handles, fontsize=7, loc="lower right",
              ncol=2 if stride > 4 else 1, framealpha=0.9)


def plot_lookup(report: dict, path: PathLike, title: str) -> Path:
    """Accuracy vs residue (coloured by phase) and vs phase, with intervals, mean line and the gap statistics."""
    M, S = report["modulus"], report["stride"]
    fig = Figure(figsize=(13, 4.4))
    ax_r, ax_p = fig.subplots(1, 2, gridspec_kw={"width_ratios": [max(M, 8), max(S, 4) + 2]})
    _group_curve(ax_r, report["residue"], stride=S)
    ax_r.set_xlabel(f"residue of the target position (mod {M})")
    ax_r.set_xticks(range(M))
    ax_r.set_title(f"per residue: {gap_text(report['residue'])}", fontsize=9)
    _phase_legend(ax_r, S)
    _group_curve(ax_p, report["phase"], stride=None, bars=True)
    ax_p.set_xlabel(f"phase of the target position (mod {S})")
    ax_p.set_xticks(range(S))
    ax_p.set_title(f"per phase: {gap_text(report['phase'])}", fontsize=9)
    ax_p.legend(fontsize=7, loc="lower right")
    per = report["residue"].get("periodicity") or {}
    extra = ""
    if per:
        score = "n/a" if per["score"] is None else f"{per['score']:.2f}"
        dom = "none" if per["dominant_period"] is None else f"{per['dominant_period']:g}"
        extra = f" | periodicity at {S}: {score} (chance {per['chance']:.2f}), dominant period {dom}"
    fig.suptitle(f"{title}: lookup, n={report['n_prompts']} targets{extra}", fontsize=10)
    return _save(fig, path)


def plot_lookup_comparison(items: Sequence[tuple[str, dict]], path: PathLike, ncols: int = 4) -> Path:
    """One panel per run (accuracy vs residue, shared axes), each titled with its mean and phase gap."""
    if not items:
        raise ValueError("nothing to compare: no lookup reports")
    n = len(items)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.4 * nrows))
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharey=True, squeeze=False)).ravel()
    for ax, (label, rep) in zip(axes, items):
        _group_curve(ax, rep["residue"], stride=rep["stride"])
        ph = rep["phase"]
        ax.set_title(f"{label}\nmean {_fmt_pct(ph['mean']['value'])}%, phase {gap_text(ph)}", fontsize=8)
        ax.set_xlabel(f"residue (mod {rep['modulus']}); colour = phase (mod {rep['stride']})", fontsize=8)
        ax.set_xticks(range(0, rep["modulus"], rep["stride"]))
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle("lookup accuracy per residue, one panel per run (error bars: Wilson 95%; dashed: mean)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_phase_overlay(items: Sequence[tuple[str, dict]], path: PathLike) -> Path:
    """All runs' accuracy vs phase in one plot, with Wilson intervals and each run's mean as a dashed line."""
    if not items:
        raise ValueError("nothing to compare: no lookup reports")
    fig = Figure(figsize=(7.5, 4.6))
    ax = fig.subplots()
    offsets = np.linspace(-0.15, 0.15, len(items)) if len(items) > 1 else [0.0]
    for (label, rep), color, dx in zip(items, _colors(len(items)), offsets):
        ph = rep["phase"]
        x = np.array([g["group"] for g in ph["groups"]]) + dx
        y = np.array([_pct(g["accuracy"]) for g in ph["groups"]])
        err = _yerr(y, ph["groups"])
        ax.errorbar(x, y, yerr=err, fmt="o-", color=color, capsize=3, ms=5,
                    label=f"{label}: gap {_fmt_pct(ph['gap']['value'])} pp (floor {_fmt_pct(ph['gap']['noise_floor'])})")
        ax.axhline(_pct(ph["mean"]["value"]), ls="--", color=color, lw=0.8)
    S = max(rep["stride"] for _, rep in items)
    ax.set_xticks(range(S))
    ax.set_xlabel("phase of the target position (position mod stride)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("lookup accuracy per phase (Wilson 95% intervals; dashed: each run's mean)", fontsize=10)
    return _save(fig, path)


def plot_probe(report: dict, path: PathLike, title: str) -> Path:
    """Each candidate's probability vs filler length; filled markers where that candidate ranks first."""
    rows, labels, S = report["lengths"], report["labels"], report["stride"]
    x = np.array([r["filler_tokens"] for r in rows])
    fig = Figure(figsize=(9, 4.4))
    ax = fig.subplots()
    for lab, color in zip(labels, _colors(len(labels))):
        y = np.array([PCT * r[f"p[{lab}]"] for r in rows])
        top = np.array([r["top_candidate"] == lab for r in rows])
        ax.plot(x, y, "-", color=color, lw=1.2, label=f"p({lab})")
        ax.scatter(x[top], y[top], color=color, s=36, edgecolors="black", zorder=3)
        ax.scatter(x[~top], y[~top], facecolors="white", edgecolors=color, s=20, zorder=3)
    if S > 1:
        for b in x[x % S == 0]:
            ax.axvline(b, color="0.85", lw=0.8, zorder=0)
        ax.set_xticks(x[x % S == 0])
    ax.set_xlabel(f"filler length (tokens); grey lines: length = 0 mod {S}")
    ax.set_ylabel("probability of the candidate's first token (%)")
    top_p = max(PCT * r[f"p[{lab}]"] for r in rows for lab in labels)
    ax.set_ylim(-2, min(103.0, 1.15 * top_p + 3))  # small probabilities stay visible
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, title="filled: ranked first", title_fontsize=8)
    per = report.get("periodicity") or {}
    dom = per.get("dominant_period")
    ax.set_title(f"{title}: {report['name']}, {report['flips']} flips of the top candidate, dominant period of "
                 f"p({labels[0]}): {'none' if dom is None else f'{dom:g}'}", fontsize=9)
    return _save(fig, path)


def plot_grid_summary(rows: Sequence[dict], path: PathLike) -> Path:
    """Phase gap and worst-phase accuracy against stride and window, one line per pooling (mean over runs,
    faint points: single runs with their intervals); full attention as a dashed reference line."""
    metrics = [("phase_gap", "phase gap (pp)"), ("worst_phase_accuracy", "worst-phase accuracy (%)")]
    fig = Figure(figsize=(11, 7.5))
    axes = fig.subplots(2, 2, sharey="row")
    compressed = [r for r in rows if r.get("stride") is not None]
    full = [r for r in rows if r.get("stride") is None]
    poolings = sorted({r["pooling"] for r in compressed})
    colors = dict(zip(poolings, _colors(max(len(poolings), 1))))
    for i, (key, ylabel) in enumerate(metrics):
        for j, xkey in enumerate(("stride", "window")):
            ax = axes[i, j]
            for pooling in poolings:
                by_x: dict[int, list[dict]] = defaultdict(list)
                for r in compressed:
                    if r["pooling"] == pooling and r.get(key) is not None:
                        by_x[r[xkey]].append(r)
                xs = sorted(by_x)
                means = [PCT * np.mean([r[key] for r in by_x[x_]]) for x_ in xs]
                ax.plot(xs, means, "o-", color=colors[pooling], label=f"{pooling} (mean of runs)")
                for x_ in xs:
                    for r in by_x[x_]:
                        lo, hi = r.get(f"{key}_lower"), r.get(f"{key}_upper")
                        y = PCT * r[key]
                        yerr = None if lo is None else [[max(y - PCT * lo, 0.0)], [max(PCT * hi - y, 0.0)]]
                        ax.errorbar([x_], [y], yerr=yerr, fmt="o", color=colors[pooling], alpha=0.35, ms=4, capsize=2)
            vals = [r[key] for r in full if r.get(key) is not None]
            if vals:
                ax.axhline(PCT * np.mean(vals), ls="--", color="black", lw=1, label=f"full attention ({len(vals)} runs)")
            ax.set_xticks(sorted({r[xkey] for r in compressed}))
            ax.set_xlabel(xkey)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.set_ylim(-3, 103)
            ax.legend(fontsize=7)
    fig.suptitle("sweep summary: phase gap and worst-phase accuracy vs stride and window (bars: 95% intervals)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
