"""Every PNG plot of evaluation reports, one file on purpose: ckv.eval's one matplotlib home, sharing its axes and
colours (matplotlib's object API: no pyplot state, no display needed).

Every accuracy plot shows percentages on a fixed 0-100 axis, 95% intervals as error bars, the mean as a dashed
line, and says in its title what the best-minus-worst gap, its interval and the noise floor are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol, Union

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ckv.eval.stats import gap_is_real
from ckv.geometry import phase

PathLike = Union[str, Path]
PCT = 100.0
DPI = 120
MAX_TICKS = 8  # tick labels on a small panel's x-axis


def _pct(x: Optional[float]) -> float:
    return np.nan if x is None else PCT * x


def _fmt_pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{PCT * x:.1f}"


def _fmt_p(p: Optional[float]) -> str:
    return "n/a" if p is None else (f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}")


def palette(n: int) -> list:
    """``n`` distinct colours (tab10, or tab20 beyond 10), the one palette of ckv's plots."""
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def save_figure(fig: Figure, path: PathLike) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder made), at ckv's plots' resolution; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=DPI, bbox_inches="tight")
    return p


def percent_axis(ax: Axes, top: float = 100.0) -> None:
    """A probability (percent) y-axis from 0 to ``top`` (at most 100): never below 0 or above 100%. Call it after
    drawing: the lines and markers are drawn unclipped, so points at exactly 0% or 100% stay whole."""
    ax.set_ylim(0.0, min(100.0, top))
    for artist in (*ax.lines, *ax.collections):
        artist.set_clip_on(False)


def gap_text(grouping: dict, unit: str = "pp") -> str:
    """``gap 40.2 pp [36.1, 44.0], noise floor 2.8, p=0.0005`` for a ``summarize_groups`` report."""
    g = grouping["gap"]
    return (
        f"gap {_fmt_pct(g['value'])} {unit} [{_fmt_pct(g['lower'])}, {_fmt_pct(g['upper'])}], "
        f"noise floor {_fmt_pct(g['noise_floor'])}, p={_fmt_p(g['p_value'])}"
    )


def _yerr(y: np.ndarray, groups: list[dict]) -> np.ndarray:
    """(2, G) error-bar lengths (percent) from each group's interval around ``y``."""
    lo = np.array([PCT * g["lower"] for g in groups])
    hi = np.array([PCT * g["upper"] for g in groups])
    return np.maximum(np.stack([y - lo, hi - y]), 0.0)


def _group_curve(
    ax: Axes, grouping: dict, *, stride: Optional[int], label: Optional[str] = None, color=None, bars: bool = False
) -> None:
    """Accuracy per group with its intervals (the grouping's ``interval`` kind) and the mean line (points coloured
    by phase if ``stride``)."""
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
        colors = (
            [palette(stride)[phase(xi, stride)] for xi in x]
            if stride and color is None
            else [color or "tab:blue"] * len(x)
        )
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor="0.4", capsize=2, lw=0.8, zorder=2)
        ax.scatter(x, y, c=colors, s=22, zorder=3, edgecolors="black", linewidths=0.4)
    ax.axhline(
        _pct(mean["value"]),
        ls="--",
        color=color or "black",
        lw=1,
        label=f"mean {_fmt_pct(mean['value'])}% [{_fmt_pct(mean['lower'])}, {_fmt_pct(mean['upper'])}]"
        if color is None
        else None,
    )
    if mean["lower"] is not None and color is None:
        ax.axhspan(_pct(mean["lower"]), _pct(mean["upper"]), color="0.85", zorder=0)
    percent_axis(ax)
    ax.set_ylabel("top-1 accuracy (%)")
    ax.grid(axis="y", alpha=0.3)


def _phase_legend(ax: Axes, stride: int) -> None:
    handles = [
        Line2D([], [], marker="o", ls="", color=c, markeredgecolor="black", label=f"phase {p}")
        for p, c in enumerate(palette(stride))
    ]
    ax.legend(
        handles=ax.get_legend_handles_labels()[0] + handles,
        fontsize=7,
        loc="best",
        ncol=2 if stride > 4 else 1,
        framealpha=0.9,
    )


def plot_lookup(report: dict, path: PathLike, title: str) -> Path:
    """Accuracy vs residue (coloured by phase) and vs phase, with intervals, mean line and both gaps' statistics
    (the residue gap mod M, the phase gap mod S); one panel only for a model evaluated without a stride."""
    M, S, phases = report["modulus"], report["stride"], report["phase"]
    fig = Figure(figsize=(13, 4.4) if phases else (8, 4.4))
    if phases:
        ax_r, ax_p = fig.subplots(1, 2, gridspec_kw={"width_ratios": [max(M, 8), max(S, 4) + 2]})
    else:
        ax_r, ax_p = fig.subplots(), None
    _group_curve(ax_r, report["residue"], stride=S)
    ax_r.set_xlabel(f"residue of the target position (mod {M})")
    ax_r.set_xticks(range(M))
    ax_r.set_title(f"residue {gap_text(report['residue'])} ({_interval_label(report['residue'])})", fontsize=9)
    if S:
        _phase_legend(ax_r, S)
    if ax_p is not None:
        _group_curve(ax_p, phases, stride=None, bars=True)
        ax_p.set_xlabel(f"phase of the target position (mod {S})")
        ax_p.set_xticks(range(S))
        ax_p.set_title(f"phase {gap_text(phases)}", fontsize=9)
        ax_p.legend(fontsize=7, loc="best")
    per = report["residue"].get("periodicity") or {}
    extra = "" if S else " | no stride: no phase gap (set task.stride)"
    if per:
        score = "n/a" if per["score"] is None else f"{per['score']:.2f}"
        dom = "none" if per["dominant_period"] is None else f"{per['dominant_period']:g}"
        extra = f" | periodicity at {S}: {score} (chance {per['chance']:.2f}), dominant period {dom}"
    fig.suptitle(f"{title}: {report['name']}, n={report['n_prompts']} targets{extra}", fontsize=10)
    return save_figure(fig, path)


def _interval_label(grouping: dict) -> str:
    """``error bars: cluster bootstrap 95%`` from a grouping's interval kind."""
    kind = grouping.get("interval", "wilson").replace("_", " ")
    return f"error bars: {kind} {round(PCT * grouping['gap']['level'])}%"


def plot_lookup_comparison(items: Sequence[tuple[str, dict]], path: PathLike, ncols: int = 4) -> Path:
    """One panel per run (accuracy vs residue, shared axes), each titled with its mean and residue gap."""
    if not items:
        raise ValueError("nothing to compare: no lookup reports")
    n = len(items)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.4 * nrows))
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharey=True, squeeze=False)).ravel()
    for i, (ax, (label, rep)) in enumerate(zip(axes, items)):
        res = rep["residue"]
        _group_curve(ax, res, stride=rep["stride"])
        ax.set_title(f"{label}\nmean {_fmt_pct(res['mean']['value'])}%, residue {gap_text(res)}", fontsize=8)
        colour = f"; colour = phase (mod {rep['stride']})" if rep["stride"] else ""
        ax.set_xlabel(f"residue (mod {rep['modulus']}){colour}", fontsize=8)
        # every stride-th residue; without a stride at most MAX_TICKS, so that the labels never run together
        ax.set_xticks(range(0, rep["modulus"], rep["stride"] or -(-rep["modulus"] // MAX_TICKS)))
        if i % ncols:
            ax.set_ylabel("")  # the shared axis is labelled once per row
        ax.legend(fontsize=7, loc="best")
    for ax in axes[n:]:
        ax.set_visible(False)
    kinds = sorted({rep["residue"].get("interval", "wilson").replace("_", " ") for _, rep in items})
    fig.suptitle(
        f"lookup accuracy per residue, one panel per run (error bars: {' / '.join(kinds)} 95%; dashed: mean)",
        fontsize=10,
    )
    fig.tight_layout()
    return save_figure(fig, path)


def plot_phase_overlay(items: Sequence[tuple[str, dict]], path: PathLike) -> Path:
    """All runs' accuracy vs phase in one plot, with their per-group intervals and each run's mean as a dashed
    line; runs evaluated without a stride (no phase groups) are left out."""
    items = [(label, rep) for label, rep in items if rep["phase"]]
    if not items:
        raise ValueError("nothing to compare: no lookup report has phase groups")
    fig = Figure(figsize=(7.5, 4.6))
    ax = fig.subplots()
    offsets = np.linspace(-0.15, 0.15, len(items)) if len(items) > 1 else [0.0]
    for (label, rep), color, dx in zip(items, palette(len(items)), offsets):
        ph = rep["phase"]
        x = np.array([g["group"] for g in ph["groups"]]) + dx
        y = np.array([_pct(g["accuracy"]) for g in ph["groups"]])
        err = _yerr(y, ph["groups"])
        ax.errorbar(
            x,
            y,
            yerr=err,
            fmt="o-",
            color=color,
            capsize=3,
            ms=5,
            label=f"{label}: gap {_fmt_pct(ph['gap']['value'])} pp (floor {_fmt_pct(ph['gap']['noise_floor'])})",
        )
        ax.axhline(_pct(ph["mean"]["value"]), ls="--", color=color, lw=0.8)
    S = max(rep["stride"] for _, rep in items)
    ax.set_xticks(range(S))
    ax.set_xlabel("phase of the target position (position mod stride)")
    ax.set_ylabel("top-1 accuracy (%)")
    percent_axis(ax)
    ax.grid(axis="y", alpha=0.3)
    # below the axes: inside, it would hide the worst phases, which sit at the bottom
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2 if len(items) > 4 else 1)
    kinds = sorted({rep["phase"].get("interval", "wilson").replace("_", " ") for _, rep in items})
    ax.set_title(f"lookup accuracy per phase ({' / '.join(kinds)} 95% intervals; dashed: each run's mean)", fontsize=10)
    return save_figure(fig, path)


def plot_phase_grid(columns: Sequence[tuple[str, Mapping[str, Sequence[tuple[str, dict]]]]], path: PathLike) -> Path:
    """Accuracy per phase, one panel per (evaluation, model): ``columns`` holds one ``(title, {evaluation name:
    [(line label, lookup report), ...]})`` per model (e.g. a variant, its seeds as lines, by padding); one row per
    evaluation name in the order they first appear. Each report is a line over the phases of its stride with its
    95% intervals and its mean dashed in its colour; a panel without reports says so (make csa2's figure)."""
    names = _evaluation_names([reports for _, reports in columns])
    if not names:
        raise ValueError("nothing to plot: no model has a lookup report")
    fig = Figure(figsize=(3.0 * len(columns) + 0.6, 2.6 * len(names) + 0.6))
    axes = fig.subplots(len(names), len(columns), sharey=True, squeeze=False)
    for j, (title, reports) in enumerate(columns):
        for i, name in enumerate(names):
            ax, lines = axes[i, j], [(lab, rep) for lab, rep in reports.get(name, ()) if rep["phase"]]
            for (label, rep), color in zip(lines, palette(len(lines))):
                _group_curve(ax, rep["phase"], stride=None, label=label, color=color)
            if lines:
                stride = max(rep["stride"] for _, rep in lines)
                ax.set_xticks(range(stride))
                ax.set_xlim(-0.4, stride - 0.6)
                ax.legend(fontsize=6, loc="best")
            else:
                ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes, fontsize=8)
                percent_axis(ax)
            ax.set_title(f"{title}: {name}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.set_ylabel("top-1 accuracy (%)" if j == 0 else "", fontsize=8)
            ax.set_xlabel("phase (target position mod S)" if i == len(names) - 1 else "", fontsize=8)
    fig.suptitle("accuracy per phase (bars: 95% intervals; dashed: each line's mean)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_probe(report: dict, path: PathLike, title: str) -> Path:
    """Each candidate's (whole-sequence) probability vs filler length; filled markers where that candidate's first
    token is the full-vocabulary top-1; the title counts flips of the top-1."""
    rows, labels, S = report["lengths"], report["labels"], report["stride"]
    x = np.array([r["filler_tokens"] for r in rows])
    fig = Figure(figsize=(9, 4.4))
    ax = fig.subplots()
    for lab, color in zip(labels, palette(len(labels))):
        y = np.array([0.0 if r[f"logp[{lab}]"] is None else PCT * np.exp(r[f"logp[{lab}]"]) for r in rows])
        top = np.array([r["top1_is"] == lab for r in rows])
        ax.plot(x, y, "-", color=color, lw=1.2, label=f"p({lab})")
        ax.scatter(x[top], y[top], color=color, s=36, edgecolors="black", zorder=3)
        ax.scatter(x[~top], y[~top], facecolors="white", edgecolors=color, s=20, zorder=3)
    if S > 1:
        for b in x[phase(x, S) == 0]:
            ax.axvline(b, color="0.85", lw=0.8, zorder=0)
        ax.set_xticks(x[phase(x, S) == 0])
    ax.set_xlabel(f"filler length (tokens); grey lines: length = 0 mod {S}")
    ax.set_ylabel("probability of the candidate (whole sequence, %)")
    top_p = max(
        (PCT * np.exp(r[f"logp[{lab}]"]) for r in rows for lab in labels if r[f"logp[{lab}]"] is not None), default=1.0
    )
    percent_axis(ax, 1.15 * top_p + 3)  # small probabilities stay visible
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, title="filled: the full-vocabulary top-1", title_fontsize=8)
    per = report.get("periodicity") or {}
    dom = per.get("dominant_period")
    ax.set_title(
        f"{title}: {report['name']}, {report['flips']} flips of the full-vocabulary top-1, dominant period "
        f"of p({labels[0]}): {'none' if dom is None else f'{dom:g}'}",
        fontsize=9,
    )
    return save_figure(fig, path)


class RoledModel(Protocol):
    """A study's model as its plots name it: ``name`` and ``role`` (``baseline``, ``fix`` or ``control``)."""

    name: str
    role: str


ROLE_MARKERS = {"control": "s", "baseline": "X"}  # any other role ("fix"): a circle


def plot_worst_phase_vs_kv_bytes(
    rows: Sequence[dict], models: Mapping[str, Sequence[RoledModel]], path: PathLike
) -> Path:
    """Worst-phase accuracy against KV bytes per token (``rows``: a study's run rows with ``task``, ``model``,
    ``kv_bytes_per_token`` and ``worst_phase_accuracy``): one panel per task in ``models``' order, one point per
    run, one colour per model of ``models[task]`` (marker by role); models of equal memory are spread a little
    along x (the axis is logarithmic: full attention stores 4-8x more per token)."""
    tasks = sorted({r["task"] for r in rows}, key=list(models).index)
    fig = Figure(figsize=(6.5 * len(tasks), 4.5))
    axes = fig.subplots(1, len(tasks), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        shown = [m for m in models[task] if any(r["task"] == task and r["model"] == m.name for r in rows)]
        for i, m in enumerate(shown):
            pts = [r for r in rows if r["task"] == task and r["model"] == m.name]
            dodge = 2 ** (0.06 * (i - (len(shown) - 1) / 2))
            ax.scatter(
                [r["kv_bytes_per_token"] * dodge for r in pts],
                [PCT * r["worst_phase_accuracy"] for r in pts],
                color=colormaps["tab10"](i),
                marker=ROLE_MARKERS.get(m.role, "o"),
                label=f"{m.name} ({m.role})",
                s=45,
                alpha=0.85,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV-cache bytes per token (bf16, all layers; equal-memory models spread a little)")
        ax.set_ylabel("worst-phase accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{task}: one point per seed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_gain_vs_cost(points: Sequence[dict], path: PathLike) -> Path:
    """Worst-group gain against cost (``make mitigate``, docs/mitigation.md): one point per model x mitigation x
    padding (``points``: ``mitigation``, ``padding``, ``flops_ratio``, ``gain`` with ``gain_lower`` and
    ``gain_upper``, the paired worst-group difference and its 95% interval, fractions, and ``works``); x the prefill
    FLOPs against the unmitigated model (the dotted line at 2x: the usefulness bar), y the gain in pp with its
    interval; one colour per mitigation, one marker per padding, filled where the mitigation works."""
    fig = Figure(figsize=(8.5, 5.5))
    ax = fig.subplots()
    names = sorted({p["mitigation"] for p in points})
    paddings = sorted({p["padding"] for p in points})
    markers = dict(zip(paddings, "os^vD"))
    for i, name in enumerate(names):
        for padding in paddings:
            pts = [p for p in points if p["mitigation"] == name and p["padding"] == padding]
            if not pts:
                continue
            x = np.array([p["flops_ratio"] for p in pts])
            y = np.array([PCT * p["gain"] for p in pts])
            err = np.array([[PCT * (p["gain"] - p["gain_lower"]), PCT * (p["gain_upper"] - p["gain"])] for p in pts])
            color = colormaps["tab10"](i)
            ax.errorbar(x, y, yerr=err.T, fmt="none", ecolor=color, alpha=0.35, lw=0.8)
            works = np.array([bool(p["works"]) for p in pts])
            for filled in (True, False):
                sel = works == filled
                if sel.any():
                    ax.scatter(
                        x[sel],
                        y[sel],
                        marker=markers[padding],
                        s=40,
                        facecolors=color if filled else "none",
                        edgecolors=color,
                        label=f"{name}, {padding}" + ("" if filled else " (does not work)"),
                    )
    ax.axhline(0, color="0.3", lw=0.8)
    ax.axvline(2.0, color="0.5", lw=0.8, ls=":")
    ax.set_xlabel("prefill FLOPs / unmitigated (ckv's accounting; transformers models: torch's count; dotted: 2x)")
    ax.set_ylabel("worst-group gain, paired (pp, 95% interval)")
    ax.set_title("worst-group gain against cost: one point per model x mitigation x padding")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)


GRID_METRICS = (
    ("phase_gap", "phase gap mod S (pp)", "Reds"),
    ("worst_phase_accuracy", "worst-phase accuracy (%)", "Blues"),
    ("mean", "mean accuracy (%)", "Greens"),
)


def _grid_cell_text(runs: Sequence[dict], key: str, value: float) -> str:
    """A cell's label: its value, then the 95% interval of a single run, or how many runs were averaged ("seeds"
    when they differ only in seed); "n.s." when the gap of any run there is not real (``gap_is_real``)."""
    runs = [r for r in runs if r.get(key) is not None]
    text = f"{value:.1f}"
    lo, hi = runs[0].get(f"{key}_lower"), runs[0].get(f"{key}_upper")
    if len(runs) > 1:
        seeds = [r.get("seed") for r in runs]
        text += f"\n(mean of {len(runs)} {'seeds' if len(set(seeds)) == len(seeds) else 'runs: not only seeds'})"
    elif lo is not None and hi is not None:
        text += f"\n[{PCT * lo:.0f}, {PCT * hi:.0f}]"
    if key == "phase_gap" and not all(
        gap_is_real(r.get("phase_p_value"), r.get("phase_gap_lower"), r.get("phase_noise_floor")) for r in runs
    ):
        text += "\nn.s."
    return text


@dataclass
class StrideWindowGrid:
    """One pooling's runs on the stride x window grid: ``values[key]`` is (window, stride) in percent, the mean over
    the runs of a cell (NaN where no run has that metric); ``cells`` maps (window, stride) to its runs."""

    windows: list[int]
    strides: list[int]
    cells: dict[tuple[int, int], list[dict]]
    values: dict[str, np.ndarray]


def stride_window_grids(rows: Sequence[dict], keys: Sequence[str]) -> dict[str, StrideWindowGrid]:
    """Compressed runs (rows with a stride) per pooling on one shared stride x window grid; see ``StrideWindowGrid``."""
    compressed = [r for r in rows if r.get("stride") is not None]
    strides = sorted({r["stride"] for r in compressed})
    windows = sorted({r["window"] for r in compressed})
    grids = {}
    for pooling in sorted({r["pooling"] for r in compressed}):
        cells: dict[tuple[int, int], list[dict]] = defaultdict(list)
        for r in compressed:
            if r["pooling"] == pooling:
                cells[(r["window"], r["stride"])].append(r)
        values = {}
        for key in keys:
            grid = np.full((len(windows), len(strides)), np.nan)  # (window, stride)
            for (w, s), runs in cells.items():
                vals = [r[key] for r in runs if r.get(key) is not None]
                if vals:
                    grid[windows.index(w), strides.index(s)] = PCT * float(np.mean(vals))
            values[key] = grid
        grids[pooling] = StrideWindowGrid(windows, strides, dict(cells), values)
    return grids


def plot_grid_summary(rows: Sequence[dict], path: PathLike) -> Path:
    """Heatmaps over stride (x) and window (y), one row per pooling: phase gap, worst-phase accuracy and mean
    accuracy, averaged over the runs of a cell (its seeds; a cell that mixes other settings says so). A cell of one
    run shows its 95% interval; "n.s." marks a gap with permutation p >= 0.05 or an interval that does not clear
    the noise floor, in any run of the cell. The mean panel tells a model that has not learned (its small gap means
    nothing) from one without weak spots. Full-attention runs are summarised in the title."""
    if not any(r.get("stride") is not None for r in rows):
        raise ValueError("no compressed runs to place on a stride x window grid")
    full = [r for r in rows if r.get("stride") is None]
    metrics = [m for m in GRID_METRICS if any(r.get(m[0]) is not None for r in rows if r.get("stride") is not None)]
    grids = stride_window_grids(rows, [key for key, _, _ in metrics])
    first = next(iter(grids.values()))
    fig = Figure(
        figsize=(len(metrics) * (1.3 + 1.05 * len(first.strides)), len(grids) * (1.4 + 0.7 * len(first.windows)))
    )
    axes = fig.subplots(len(grids), len(metrics), squeeze=False)
    for i, (pooling, g) in enumerate(grids.items()):
        for j, (key, label, cmap_name) in enumerate(metrics):
            ax = axes[i, j]
            cmap = colormaps[cmap_name].copy()
            cmap.set_bad("0.93")
            ax.imshow(g.values[key], cmap=cmap, vmin=0, vmax=100, origin="lower", aspect="auto")
            for (w, s), runs in g.cells.items():
                v = g.values[key][g.windows.index(w), g.strides.index(s)]
                if not np.isnan(v):
                    ax.text(
                        g.strides.index(s),
                        g.windows.index(w),
                        _grid_cell_text(runs, key, v),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if v > 60 else "black",
                    )
            ax.set_xticks(range(len(g.strides)), [str(s) for s in g.strides])
            ax.set_yticks(range(len(g.windows)), [str(w) for w in g.windows])
            ax.set_xlabel("stride")
            ax.set_ylabel("window")
            ax.set_title(f"{pooling}: {label}", fontsize=9)
    title = "sweep summary over stride x window (cells: value, [95% interval] for one run; grey: not run)"
    if full:
        gaps = [r["phase_gap"] for r in full if r.get("phase_gap") is not None]
        residue = [r["residue_gap"] for r in full if r.get("residue_gap") is not None]
        means = [r["mean"] for r in full if r.get("mean") is not None]
        title += (
            f"\nfull attention ({len(full)} runs): mean {PCT * np.mean(means):.1f}%"
            if means
            else f"\nfull attention ({len(full)} runs)"
        )
        title += f", residue gap mod {full[0]['modulus']} {PCT * np.mean(residue):.1f} pp" if residue else ""
        title += f", phase gap {PCT * np.mean(gaps):.1f} pp" if gaps else ""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


@dataclass
class CurvePanel:
    """One panel of ``plot_residue_curves``: a run's lookup reports by evaluation name (e.g. the padding; none: the
    run did not finish), the stride marked on it (``None``: no lines, e.g. full attention) and reference means by
    evaluation name (fractions, e.g. the paper's)."""

    label: str
    reports: dict[str, dict]
    stride: Optional[int]
    reference: dict[str, float] = field(default_factory=dict)


def _evaluation_names(reports: Sequence[dict[str, dict]]) -> list[str]:
    """Every evaluation name of ``reports`` once, in the order it first appears."""
    return list(dict.fromkeys(k for r in reports for k in r))


def plot_residue_curves(panels: Sequence[CurvePanel], path: PathLike, ncols: int = 6) -> Path:
    """Small multiples in the given order, one panel per run: accuracy per residue with its 95% band, one colour per
    evaluation (overlaid), dotted vertical lines every S positions (between phase S - 1 and phase 0) and each
    reference mean as a dashed line in its evaluation's colour; a run without reports is titled "no results"."""
    if not panels:
        raise ValueError("nothing to plot: no runs")
    names = _evaluation_names([p.reports for p in panels])
    colors = dict(zip(names, palette(len(names))))
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(2.9 * ncols, 2.3 * nrows + 0.8))
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
    modulus = max((r["modulus"] for p in panels for r in p.reports.values()), default=1)
    for ax, panel in zip(axes, panels):
        for name, rep in panel.reports.items():
            groups = rep["residue"]["groups"]
            x = np.array([g["group"] for g in groups])
            lo, hi = (np.array([_pct(g[k]) for g in groups]) for k in ("lower", "upper"))
            ax.fill_between(x, lo, hi, color=colors[name], alpha=0.25, lw=0)
            ax.plot(x, [_pct(g["accuracy"]) for g in groups], "-", color=colors[name], lw=1.2, marker="o", ms=2)
        for name, mean in panel.reference.items():
            ax.axhline(_pct(mean), ls="--", lw=0.9, color=colors.get(name, "black"))
        if panel.stride:
            for b in range(panel.stride, modulus, panel.stride):
                ax.axvline(b - 0.5, ls=":", lw=0.8, color="0.35", zorder=0)
        stride = "no results" if not panel.reports else "no stride" if panel.stride is None else f"S={panel.stride}"
        ax.set_title(f"{panel.label} ({stride})", fontsize=8)
        ax.set_xticks(range(0, modulus, max(1, -(-modulus // MAX_TICKS))))
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        percent_axis(ax)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[(nrows - 1) * ncols :]:
        ax.set_xlabel(f"target position mod {modulus}", fontsize=8)
    for ax in axes[::ncols]:
        ax.set_ylabel("top-1 accuracy (%)", fontsize=8)
    handles = [Line2D([], [], color=colors[n], lw=1.5, label=n) for n in names]
    handles.append(Line2D([], [], color="0.2", ls="--", lw=0.9, label="reference mean (the evaluation's colour)"))
    handles.append(Line2D([], [], color="0.35", ls=":", lw=0.8, label="every S positions (phase S - 1 | phase 0)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle("accuracy per target position (bands: 95% intervals)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save_figure(fig, path)


def plot_residue_heatmap(rows: Sequence[tuple[str, dict[str, dict]]], path: PathLike) -> Path:
    """Runs (rows, in the given order) x target position mod M (columns): accuracy (%), one panel per evaluation side
    by side on one colour scale (0-100); a run without that evaluation is a grey row."""
    names = _evaluation_names([reports for _, reports in rows])
    if not names:
        raise ValueError("nothing to plot: no run has a lookup report")
    modulus = max(r["modulus"] for _, reports in rows for r in reports.values())
    fig = Figure(figsize=(1.5 + 0.28 * modulus * len(names) + 1.2, 1.2 + 0.24 * len(rows)), layout="constrained")
    axes = fig.subplots(1, len(names), sharey=True, squeeze=False)[0]
    cmap = colormaps["viridis"].with_extremes(bad="0.85")
    for ax, name in zip(axes, names):
        data = np.full((len(rows), modulus), np.nan)  # (run, residue)
        for i, (_, reports) in enumerate(rows):
            for g in reports[name]["residue"]["groups"] if name in reports else ():
                data[i, g["group"]] = _pct(g["accuracy"])
        im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=0, vmax=100, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(modulus), [str(r) for r in range(modulus)], fontsize=6)
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
        ax.set_xlabel(f"target position mod {modulus}", fontsize=8)
        ax.set_title(name, fontsize=9)
    fig.colorbar(im, ax=list(axes), fraction=0.03, pad=0.01).set_label("top-1 accuracy (%)", fontsize=8)
    fig.suptitle("accuracy per target position, every run (grey: no result)", fontsize=10)
    return save_figure(fig, path)
