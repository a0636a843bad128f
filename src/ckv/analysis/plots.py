"""Every PNG plot of the mechanism analyses, one file on purpose: ckv.analysis's one matplotlib home (knock-out, gates,
gate cycling, joint view, selection), sharing its colour scales and figure helpers.

Heatmaps use diverging colour maps centred on "no effect": knock-out effects in percent of the clean accuracy
(red = accuracy lost, blue = gained, centred at 0) and gate profiles as log2 of the mass relative to uniform
(green = above uniform, brown = below, centred at uniform). Values outside the colour range saturate; the
numbers in the cells are the real values. Grey cells are undefined (e.g. a phase the clean model never gets
right). Accuracy plots show percent on a fixed 0-100 axis with 95% intervals (cluster bootstrap over key->value
mappings: the results' ``interval``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ckv.eval.plots import PCT, palette, percent_axis, save_figure
from ckv.geometry import phase

ANNOTATE_MAX_CELLS = 600  # larger heatmaps get no numbers in their cells


def _array(values: Sequence[Sequence[Optional[float]]]) -> np.ndarray:
    return np.array([[np.nan if v is None else float(v) for v in row] for row in values], dtype=np.float64)


def _heatmap(
    fig: Figure,
    ax: Axes,
    data: np.ndarray,
    *,
    rows: list[str],
    cols: list[str],
    cmap: str,
    vlim: float,
    center: float,
    cbar_label: str,
    text: Optional[list[list[str]]] = None,
) -> None:
    """``data`` (R, C) with a symmetric colour range ``center +- vlim``, a labelled colour bar and, for small
    maps, ``text`` in each cell."""
    cm = colormaps[cmap].with_extremes(bad="0.8")
    norm = Normalize(vmin=center - vlim, vmax=center + vlim)
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cm, norm=norm, aspect="auto", interpolation="nearest")
    bar = fig.colorbar(im, ax=ax, extend="both", fraction=0.05, pad=0.02)
    bar.set_label(cbar_label, fontsize=8)
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    if text is None or data.size > ANNOTATE_MAX_CELLS:
        return
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            dark = np.isfinite(data[i, j]) and abs(data[i, j] - center) > 0.6 * vlim
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7, color="white" if dark else "black")


def _height(n_rows: int) -> float:
    return max(2.8, 0.32 * n_rows + 1.8)


# ---- knock-out -------------------------------------------------------------------------------------------------
def _effect_cells(units: list[dict]) -> tuple[np.ndarray, list[list[str]]]:
    """Effects (U, S) and cell texts: the effect, ``*`` when its 95% interval excludes 0."""
    data = _array([[p["effect"] for p in u["phases"]] for u in units])
    text = []
    for u in units:
        row = []
        for p in u["phases"]:
            lo, hi = p["effect_lower"], p["effect_upper"]
            sig = lo is not None and hi is not None and (hi < 0 or lo > 0)
            row.append("n/a" if p["effect"] is None else f"{p['effect']:.0f}{'*' if sig else ''}")
        text.append(row)
    return data, text


def _effect_range(data: np.ndarray) -> float:
    finite = np.abs(data[np.isfinite(data)])
    return float(np.clip(finite.max() if finite.size else 0.0, 5.0, 100.0))


EFFECT_LABEL = "effect (% of clean accuracy)"


def plot_knockout(result: dict, out_dir: Path, title: str) -> list[Path]:
    """``knockout_layers.png`` (layers x phases) and ``knockout_heads.png`` (KV-head groups x phases)."""
    S = result["stride"]
    clean = " / ".join(f"{PCT * g['accuracy']:.0f}" for g in result["clean"]["phase"]["groups"])
    paths = []
    for kind, what in (("layers", "layer"), ("heads", "KV-head group (layer, KV head)")):
        units = [u for u in result["units"] if (u["kv_head"] is None) == (kind == "layers")]
        if not units:
            continue
        data, text = _effect_cells(units)
        fig = Figure(figsize=(max(5.5, 0.75 * S + 3.5), _height(len(units))))
        ax = fig.subplots()
        _heatmap(
            fig,
            ax,
            data,
            rows=[u["label"] for u in units],
            cols=[str(r) for r in range(S)],
            cmap="RdBu",
            vlim=_effect_range(data),
            center=0.0,
            cbar_label=EFFECT_LABEL,
            text=text,
        )
        ax.set_xlabel(f"phase of the target position (mod {S})")
        ax.set_ylabel(f"knocked-out {what}")
        ax.set_title(
            f"{title}: mean ablation at the final query position\nclean accuracy per phase {clean} %; "
            "* = paired 95% interval excludes 0; grey = clean accuracy 0",
            fontsize=9,
        )
        paths.append(save_figure(fig, out_dir / f"knockout_{kind}.png"))
    return paths


# ---- gates -----------------------------------------------------------------------------------------------------
def _profile_ratios(profiles: list[Optional[list[float]]]) -> np.ndarray:
    """(R, longest) the profiles as rows, NaN after a shorter one's end and for a missing one (a layer schedule's
    windows may differ, and its layers without gates have none)."""
    ratio = np.full((len(profiles), max((len(p) for p in profiles if p), default=1)), np.nan)
    for row, p in zip(ratio, profiles):
        row[: len(p or [])] = p or []
    return ratio


def _profile_cells(profiles: list[Optional[list[float]]]) -> tuple[np.ndarray, list[list[str]]]:
    """log2 of the mass relative to uniform (R, W) and the ratios as cell texts (empty past a row's end)."""
    ratio = _profile_ratios(profiles)
    return np.log2(np.maximum(ratio, 1e-6)), [["" if np.isnan(v) else f"{v:.2f}" for v in row] for row in ratio]


def _profile_range(profiles: list[Optional[list[float]]]) -> float:
    """One colour range for all profile panels of a figure: the largest |log2 ratio|, in [1, 6]."""
    return float(np.clip(np.nanmax(np.abs(np.log2(np.maximum(_profile_ratios(profiles), 1e-6)))), 1.0, 6.0))


PROFILE_LABEL = "log2(gate mass / uniform)"


def plot_gate_profiles(rows: list[dict], window: int, path: Path, title: str) -> Path:
    """Offset profiles of every layer and KV head, one heatmap per branch; row labels carry the static and
    per-window effective numbers of offsets."""
    branches = [b for b in ("K", "V") if any(r["branch"] == b for r in rows)]
    n = max(sum(r["branch"] == b for r in rows) for b in branches)
    fig = Figure(figsize=(5.0 * len(branches) + 1.0, _height(n)))
    vlim = _profile_range([r["profile"] for r in rows])
    for ax, b in zip(fig.subplots(1, len(branches), squeeze=False)[0], branches):
        rs = [r for r in rows if r["branch"] == b]
        data, text = _profile_cells([r["profile"] for r in rs])
        labels = [f"L{r['layer']} kv{r['kv_head']} ({r['static']:.1f} | {r['per_window']:.1f})" for r in rs]
        _heatmap(
            fig,
            ax,
            data,
            rows=labels,
            cols=[str(i) for i in range(window)],
            cmap="BrBG",
            vlim=vlim,
            center=0.0,
            cbar_label=PROFILE_LABEL,
            text=text,
        )
        ax.set_xlabel(f"offset in the window (0..{window - 1})")
        ax.set_title(f"{b} gates: mean weight per offset x {window} (1 = uniform)", fontsize=9)
    fig.suptitle(
        f"{title}: gate offset profiles\nrow labels: layer, KV head (static exp(H(E[alpha])) | per-window "
        f"E[exp(H(alpha))]; 1 = one-hot, {window} = uniform)",
        fontsize=9,
    )
    fig.tight_layout()
    return save_figure(fig, path)


def plot_gate_training(series: list[dict], window: int, path: Path, title: str) -> Path:
    """Static (solid) and per-window (dashed) effective numbers of offsets against the checkpoint step, one
    panel per branch and a colour per layer/KV head, and the lookup accuracy per phase over training."""
    steps = [s["step"] for s in series]
    branches = [b for b in ("K", "V") if any(g["branch"] == b for g in series[0]["gates"])]
    heads = sorted({(g["layer"], g["kv_head"]) for g in series[0]["gates"]})
    colors = dict(zip(heads, palette(len(heads))))
    fig = Figure(figsize=(4.6 * (len(branches) + 1), 4.2))
    axes = fig.subplots(1, len(branches) + 1)
    for ax, b in zip(axes, branches):
        for h in heads:
            pick = [next(g for g in s["gates"] if g["branch"] == b and (g["layer"], g["kv_head"]) == h) for s in series]
            ax.plot(steps, [g["static"] for g in pick], "o-", color=colors[h], ms=3, label=f"L{h[0]} kv{h[1]}")
            ax.plot(steps, [g["per_window"] for g in pick], "--", color=colors[h], lw=1)
        ax.set_ylim(0.9, window + 0.1)
        ax.set_xlabel("training step (checkpoint)")
        ax.set_ylabel(f"effective number of offsets (1 = one-hot, {window} = uniform)")
        ax.set_title(f"{b} gates", fontsize=9)
        ax.grid(alpha=0.3)
        styles = [
            Line2D([], [], color="black", ls="-", label="static"),
            Line2D([], [], color="black", ls="--", label="per window"),
        ]
        ax.legend(handles=ax.get_legend_handles_labels()[0][:12] + styles, fontsize=7, ncol=2)
    acc = axes[-1]
    S = len(series[0]["accuracy"]["phase"])
    for r, color in zip(range(S), palette(S)):
        acc.plot(steps, [PCT * s["accuracy"]["phase"][r] for s in series], "o-", ms=3, color=color, label=f"phase {r}")
    acc.plot(steps, [PCT * s["accuracy"]["mean"] for s in series], "k--", lw=1.5, label="mean")
    percent_axis(acc)
    acc.set_xlabel("training step (checkpoint)")
    acc.set_ylabel("top-1 accuracy (%)")
    acc.set_title("lookup accuracy on the same prompts", fontsize=9)
    acc.grid(alpha=0.3)
    acc.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{title}: gate concentration over training", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_emergence(series: Sequence[dict], path: Path, title: str = "emergence over training") -> Path:
    """The skill and the weak phase over training, one row per run (``series``: ``{"label", "tokens", "mean",
    "worst", "gap", "concentration"}``, lists over its checkpoints): left, mean accuracy, worst group and
    best-minus-worst gap (percent) against tokens seen; right, the mean static effective number of gate offsets
    (1 = one-hot), or "no gates" (full attention)."""
    fig = Figure(figsize=(10, 2.6 * len(series) + 0.6))
    axes = np.atleast_2d(fig.subplots(len(series), 2, squeeze=False))
    colors = dict(zip(("mean", "worst", "gap"), palette(3)))
    for (left, right), s in zip(axes, series):
        tokens = np.asarray(s["tokens"], dtype=np.float64) / 1e6
        for m, style in (("mean", "o-"), ("worst", "s-"), ("gap", "^--")):
            left.plot(tokens, [PCT * v for v in s[m]], style, ms=3, color=colors[m], label=m)
        percent_axis(left)
        left.set_ylabel("%")
        left.set_title(f"{s['label']}: accuracy (mean, worst group) and gap", fontsize=9)
        left.grid(alpha=0.3)
        left.legend(fontsize=7)
        conc = [c for c in s["concentration"] if c is not None]
        if conc:
            right.plot([t for t, c in zip(tokens, s["concentration"]) if c is not None], conc, "o-", ms=3, color="k")
            right.set_ylim(0.9, None)
            right.set_ylabel("effective offsets (static)")
            right.grid(alpha=0.3)
        else:
            _empty(right, "no gates")
        right.set_title(f"{s['label']}: gate concentration", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("tokens seen (millions)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


# ---- gate cycling ----------------------------------------------------------------------------------------------
def _fmt_interval(fit: Optional[dict]) -> str:
    if not fit or fit["value"] is None:
        return "n/a"
    if fit["lower"] is None:
        return f"{fit['value']:.2f}"
    return f"{fit['value']:.2f} [{fit['lower']:.2f}, {fit['upper']:.2f}]"


def plot_gate_cycling(result: dict, path: Path, title: str) -> Path:
    """Per shift d: observed accuracy per phase (cluster-bootstrap bars), the prediction ``A_0((r - d) mod S)`` and
    the clean curve; last panel: predicted vs observed change over all shifts (hollow: boundary phase, excluded
    from R^2)."""
    S, boundary, deltas, clean = result["stride"], result["boundary_phase"], result["deltas"], result["clean"]
    n = len(deltas) + 1
    ncols = min(4, n)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(3.8 * ncols, 3.4 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    x = np.arange(S)
    a0 = PCT * np.asarray(clean["accuracy"])
    for ax, d in zip(axes, deltas):
        y = PCT * np.asarray(d["observed"])
        err = np.maximum(np.stack([y - PCT * np.asarray(d["lower"]), PCT * np.asarray(d["upper"]) - y]), 0)
        ax.axvspan(boundary - 0.5, boundary + 0.5, color="0.92", zorder=0)
        ax.plot(x, a0, ":", color="0.5", label="clean A_0(r)")
        ax.plot(x, PCT * np.asarray(d["predicted"]), "s--", mfc="none", color="tab:orange", label="predicted A_0(r-d)")
        ax.errorbar(x, y, yerr=err, fmt="o-", color="tab:blue", capsize=3, ms=4, label="observed A_d(r)")
        percent_axis(ax)
        ax.set_xticks(x)
        ax.set_xlabel(f"phase r (mod {S}); shaded: boundary")
        ax.set_ylabel("top-1 accuracy (%)")
        ax.set_title(
            f"shift d={d['delta']}: R^2 (corr^2, excl. boundary) {_fmt_interval(d['corr2_excl_boundary'])}\n"
            f"interior {_fmt_interval(d['corr2_interior'])}, MAE {_fmt_interval(d['mae_all_phases_pp'])} pp",
            fontsize=8,
        )
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    sc = axes[len(deltas)]
    changes = []
    for d, color in zip(deltas, palette(len(deltas))):
        if phase(d["delta"], S) == 0:
            continue
        pred = PCT * (np.asarray(d["predicted"]) - np.asarray(clean["accuracy"]))
        obs = PCT * (np.asarray(d["observed"]) - np.asarray(clean["accuracy"]))
        keep = x != boundary
        sc.scatter(
            pred[keep], obs[keep], color=color, s=25, edgecolors="black", linewidths=0.4, label=f"d={d['delta']}"
        )
        sc.scatter(pred[~keep], obs[~keep], facecolors="none", edgecolors=color, s=25)
        changes += [*pred, *obs]
    lim = max(5.0, float(np.nanmax(np.abs(changes)))) if changes else 5.0
    sc.plot([-lim, lim], [-lim, lim], "k--", lw=0.8, label="observed = predicted")
    sc.axhline(0, color="0.8", lw=0.8)
    sc.axvline(0, color="0.8", lw=0.8)
    sc.set_xlabel("predicted change A_0(r-d) - A_0(r) (pp)")
    sc.set_ylabel("observed change A_d(r) - A_0(r) (pp)")
    pooled = result["pooled"]
    sc.set_title(
        f"pooled over shifts: corr^2 {_fmt_interval(pooled['corr2_excl_boundary'])}, "
        f"1 - SS_res/SS_tot {_fmt_interval(pooled['r2_identity_excl_boundary'])}",
        fontsize=8,
    )
    sc.legend(fontsize=7)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: gate cycling ({result['shifted']}); clean mean {PCT * clean['mean']:.1f}%", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


# ---- joint view ------------------------------------------------------------------------------------------------
def _fmt_corr(c: Optional[float]) -> str:
    return "n/a" if c is None else f"{c:+.2f}"


def plot_joint(result: dict, path: Path, title: str) -> Path:
    """Rows: (layer, KV head). Left: knock-out effect per phase (the paper's fold of the residues); then the K and
    V gate profiles per phase (the paper's g(r): offsets folded to phases, V rolled by -1), as its Figure 4."""
    rows, S, W = result["rows"], result["stride"], result["window"]
    branches = [b for b in ("k", "v") if any(r[f"{b}_phase_profile"] is not None for r in rows)]
    fig = Figure(figsize=(4.0 + 0.6 * S + (1.0 + 0.6 * S) * len(branches), _height(len(rows))))
    axes = fig.subplots(1, 1 + len(branches), gridspec_kw={"width_ratios": [S + 2] * (1 + len(branches))})
    data, text = _effect_cells(
        [
            {
                "phases": [
                    {"effect": e, "effect_lower": lo, "effect_upper": hi}
                    for e, lo, hi in zip(r["knockout_folded"], r["knockout_folded_lower"], r["knockout_folded_upper"])
                ]
            }
            for r in rows
        ]
    )
    labels = [
        f"L{r['layer']} kv{r['kv_head']} (r_K {_fmt_corr(r['loss_vs_k'])}, r_V {_fmt_corr(r['loss_vs_v'])})"
        for r in rows
    ]
    _heatmap(
        fig,
        axes[0],
        data,
        rows=labels,
        cols=[str(r) for r in range(S)],
        cmap="RdBu",
        vlim=_effect_range(data),
        center=0.0,
        cbar_label=EFFECT_LABEL,
        text=text,
    )
    axes[0].set_xlabel(f"phase (mod {S})")
    axes[0].set_title(f"knock-out of the KV-head group\n(mean over the residues mod {result['modulus']})", fontsize=9)
    vlim = _profile_range([r[f"{b}_phase_profile"] for b in branches for r in rows])
    for ax, b in zip(axes[1:], branches):
        prof, ptext = _profile_cells([r[f"{b}_phase_profile"] for r in rows])
        _heatmap(
            fig,
            ax,
            prof,
            rows=["" for _ in rows],
            cols=[str(i) for i in range(S)],
            cmap="BrBG",
            vlim=vlim,
            center=0.0,
            cbar_label=PROFILE_LABEL,
            text=ptext,
        )
        ax.set_xlabel(f"phase (mod {S})" + (" of the key (value gate at r + 1)" if b == "v" else ""))
        ax.set_title(f"{b.upper()} gate per phase (W={W} offsets folded)", fontsize=9)
    fig.suptitle(
        f"{title}: knock-out effect (% of clean accuracy, * = 95% interval excludes 0) vs gate mass per phase "
        "(/ uniform share, 1 = uniform)\nr_K, r_V: correlation of the loss profile (-effect) with the K, V profile",
        fontsize=9,
    )
    fig.tight_layout()
    return save_figure(fig, path)


# ---- several runs (a study's seeds) ----------------------------------------------------------------------------
MECHANISM_PANELS = ("knockout", "K gates", "V gates", "gate_cycling")  # the columns of plot_mechanisms


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8)
    ax.set_axis_off()


def _cycling_fits(ax: Axes, res: dict) -> None:
    """The gate-cycling fit per shift: the paper's R^2 (corr^2 excluding the boundary phase) with its interval."""
    fits = [d["corr2_excl_boundary"] for d in res["deltas"]]
    y, lo, hi = (np.array([np.nan if f[k] is None else f[k] for f in fits]) for k in ("value", "lower", "upper"))
    x = np.arange(len(fits))
    ax.bar(x, y, color="tab:blue", alpha=0.6)
    ax.errorbar(x, y, yerr=np.maximum(np.stack([y - lo, hi - y]), 0), fmt="none", ecolor="black", capsize=3)
    ax.set_xticks(x, [str(d["delta"]) for d in res["deltas"]], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_xlabel("gate shift d", fontsize=8)
    ax.set_ylabel("R^2 (corr^2, excl. boundary)", fontsize=8)
    ax.set_title(f"gate cycling; pooled {_fmt_interval(res['pooled']['corr2_excl_boundary'])}", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    if np.isnan(y).all():
        ax.text(
            0.5, 0.5, "n/a at every shift\n(no change to correlate)", ha="center", va="center", transform=ax.transAxes
        )


def _mechanism_panel(fig: Figure, ax: Axes, column: str, results: dict[str, dict]) -> None:
    """One cell of ``plot_mechanisms``: ``column`` of one run drawn from its analyses' ``results`` (by name)."""
    name = "gates" if column.endswith("gates") else column
    if name not in results:
        return _empty(ax, f"no {name} result")
    res = results[name]
    if name == "gate_cycling":
        return _cycling_fits(ax, res)
    if name == "knockout":
        units = [u for u in res["units"] if u["kv_head"] is None]  # layers x phases
        data, text = _effect_cells(units)
        rows, cols = [u["label"] for u in units], [str(r) for r in range(res["stride"])]
        colours = {"cmap": "RdBu", "vlim": _effect_range(data), "cbar_label": EFFECT_LABEL}
        xlabel, title = f"phase (mod {res['stride']})", "knock-out of each layer (* : 95% interval excludes 0)"
    else:
        gates = [g for g in res["gates"] if g["branch"] == column[0]]
        if not gates:
            return _empty(ax, f"no {column} (tied K/V)")
        data, text = _profile_cells([g["profile"] for g in gates])
        rows = [f"L{g['layer']} kv{g['kv_head']} (peak {g['peak_offset']})" for g in gates]
        cols = [str(i) for i in range(res["window"])]
        colours = {"cmap": "BrBG", "vlim": _profile_range([g["profile"] for g in gates]), "cbar_label": PROFILE_LABEL}
        xlabel, title = f"offset in the window (0..{res['window'] - 1})", f"{column}: mass per offset / uniform"
    _heatmap(fig, ax, data, rows=rows, cols=cols, center=0.0, text=text, **colours)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(title, fontsize=8)


def plot_mechanisms(items: Sequence[tuple[str, dict[str, dict]]], path: Path, title: str) -> Path:
    """One row per run (e.g. a study's seeds of one model): the knock-out effect of each layer per phase, the K and
    V gates' mass per offset (preferred offsets per layer), and the gate-cycling fit per shift (the paper's R^2,
    with its 95% interval). ``items``: (label, analysis results by name: ``knockout``, ``gates``,
    ``gate_cycling``); an analysis a run lacks reads "no ... result"."""
    if not items:
        raise ValueError("nothing to plot: no analysed runs")
    columns = [c for c in MECHANISM_PANELS if any(("gates" if c.endswith("gates") else c) in r for _, r in items)]
    if not columns:
        raise ValueError("nothing to plot: the runs have no knockout, gates or gate_cycling result")
    fig = Figure(figsize=(5.2 * len(columns), 0.4 + 2.9 * len(items)))
    axes = fig.subplots(len(items), len(columns), squeeze=False)
    for row, (label, results) in zip(axes, items):
        for ax, column in zip(row, columns):
            _mechanism_panel(fig, ax, column, results)
        row[0].set_ylabel(f"{label}\n{row[0].get_ylabel()}", fontsize=8)
    fig.suptitle(f"{title}: knock-outs per layer and phase, gate offset profiles, gate cycling", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_selection(result: dict, path: Path, title: str) -> Path:
    """``analysis=selection``'s plot. Left: accuracy per phase, one line per selector. Right: the last layer's
    covered rate per phase, one line per selector with its Wilson interval, and the geometric expectation of a
    random top-k (dashed, black)."""
    fig = Figure(figsize=(12, 4.5))
    acc, cov = fig.subplots(1, 2)
    for j, (name, res) in enumerate(result["selectors"].items()):
        color = colormaps["tab10"](j)
        phases = [p["phase"] for p in res["phases"]]
        acc.plot(phases, [PCT * p["accuracy"] for p in res["phases"]], "-o", color=color, label=name)
        last = [p["layers"][-1]["covered"] for p in res["phases"]]
        cov.errorbar(
            phases,
            [PCT * c["rate"] for c in last],
            yerr=[[PCT * (c["rate"] - c["lower"]) for c in last], [PCT * (c["upper"] - c["rate"]) for c in last]],
            fmt="-s",
            color=color,
            capsize=3,
            label=name,
        )
    if result["geometric"] is not None:
        geo = result["geometric"]["phases"]
        cov.plot([p["phase"] for p in geo], [PCT * p["covered"][-1] for p in geo], "k--", label="random (geometry)")
    for ax, what in ((acc, "accuracy (%)"), (cov, "target record covered by the last layer's selection (%)")):
        _phase_panel(ax, what, result["stride"], fontsize=7)
    fig.suptitle(f"{title}: top-{result['topk']}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def _phase_panel(ax: Axes, what: str, stride: int, fontsize: int) -> None:
    """A per-phase panel's axes: phases 0..stride-1 on x, ``what`` in percent on y, grid and legend."""
    ax.set_xlabel(f"phase of the target record (position mod {stride})")
    ax.set_ylabel(what)
    ax.set_ylim(-2, 102)
    ax.set_xticks(range(stride))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=fontsize)


def plot_selection_study(
    rows: Sequence[dict],
    sel_rows: Sequence[dict],
    analyses: dict[str, dict],
    path: Path,
    *,
    models: Sequence[str],
    seeds: Sequence[int],
    layer: int,
    stride: int,
    topk: int,
    solid: str,
) -> Path:
    """``make selection``'s plot. Left: accuracy per phase, one line per run of ``rows`` (colour per model of
    ``models``, line style per seed of ``seeds``). Right: per phase, the share of prompts whose target record layer
    ``layer``'s selection covers, per selector (colour) and model (``solid``'s lines solid, the others dashed), mean
    over the seeds' ``analyses``, phases mod ``stride``, beside the geometric expectation of a random top-``topk``
    (black, dashed)."""
    fig = Figure(figsize=(12, 4.5))
    acc, cov = fig.subplots(1, 2)
    styles = ("-", "--", ":", "-.")
    for r in rows:
        ls = styles[seeds.index(r["seed"]) % len(styles)] if r["seed"] in seeds else "-"
        acc.plot(
            range(len(r["per_phase"])),
            [PCT * a for a in r["per_phase"]],
            ls,
            color=colormaps["tab10"](models.index(r["model"])),
            marker="o",
            label=f"{r['model']}/seed={r['seed']}",
        )
    names = sorted({(r["model"], r["selector"]) for r in sel_rows})
    selectors = sorted({s for _, s in names})
    for model, selector in names:
        labels = [lab for lab in analyses if lab.startswith(f"{model}/")]
        curves = [
            [p["layers"][layer]["covered"]["rate"] for p in analyses[lab]["selectors"][selector]["phases"]]
            for lab in labels
        ]
        cov.plot(
            range(stride),
            [PCT * sum(c[i] for c in curves) / len(curves) for i in range(stride)],
            "-" if model == solid else "--",
            marker="s",
            color=colormaps["tab10"](selectors.index(selector)),
            label=f"{model}: {selector}",
        )
    geo = [a["geometric"] for a in analyses.values() if a["geometric"] is not None]
    if geo:
        cov.plot(
            range(stride),
            [PCT * sum(g["phases"][i]["covered"][layer] for g in geo) / len(geo) for i in range(stride)],
            "k--",
            label=f"random top-{topk} (geometry)",
        )
    for ax, what in ((acc, "accuracy (%)"), (cov, f"target record covered by L{layer}'s selection (%)")):
        _phase_panel(ax, what, stride, fontsize=6)
    acc.set_title("fixed-query lookup, per phase")
    cov.set_title(f"selection at the query, top-{topk} (analysis=selection; mean over seeds)")
    fig.tight_layout()
    return save_figure(fig, path)
