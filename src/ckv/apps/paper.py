"""``conf/study/paper.yaml``'s report (docs/paper.md): ckv's numbers beside the paper's controlled table, the rank
agreement across the compressed variants, the study's claims, and its figures (every run's per-residue curves, the
run x residue heatmap, the baseline seeds' knock-outs, gate profiles and gate cycling).

Not an app: the generic command (``python -m ckv.apps.study paper``) calls ``report`` after the runs. Every number
read here is the mod-24 grouping of ckv's lookup report (``residue``: target position mod 24, the paper's groups):
mean, worst group and best-minus-worst gap, each with its cluster-bootstrap interval, for each padding.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import numpy as np

from ckv.analysis.plots import plot_mechanisms
from ckv.apps.study_config import ROOT, Study
from ckv.apps.study_results import Check, check_lines, pp
from ckv.eval.plots import CurvePanel, plot_residue_curves, plot_residue_heatmap
from ckv.eval.stats import gap_is_real
from ckv.eval.summary import flatness_fields
from ckv.io.results import read_json

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
        return {}, f"the paper's column is n/a: {path} is absent"
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
    """The paper's CSV: ``params.paper_csv`` relative to the checkout (conf/study/data/, shipped with ckv)."""
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
    rows: dict[str, dict[str, dict]],
    ids: dict[str, str],
    paper: dict[tuple[str, str], dict],
    compressed: list[str],
    learned: set[tuple[str, str]],
) -> list[tuple[str, tuple[float, Optional[float], Optional[float]], int]]:
    """Spearman agreement with the paper across the ``compressed`` runs that learned (``(label, padding)`` in
    ``learned``), per padding, of the gap and of the worst group: ``(what, (rho, lower, upper), n variants)``; a run
    or paper row missing is left out."""
    out = []
    for pad in PADDINGS:
        for metric in ("gap", "worst"):
            pairs = [
                (rows[lab][pad][metric][0], paper[(ids[lab], pad)][metric][0])
                for lab in compressed
                if pad in rows.get(lab, {}) and (ids[lab], pad) in paper and (lab, pad) in learned
            ]
            if len(pairs) >= 2:
                a, b = zip(*pairs)
                out.append((f"Spearman of {metric} ({pad})", rank_agreement(list(a), list(b)), len(pairs)))
    return out


def run_rows(done: list[dict]) -> dict[str, dict[str, dict]]:
    """Finished runs' numbers: label -> padding -> ``measured``."""
    return {d["run"].label: {k: measured(v) for k, v in d["evaluations"].items()} for d in done}


def claim_row(report: dict) -> dict:
    """What the claims read of one evaluation: the headline (mean, mod-24 gap with interval, permutation p, noise
    floor, worst group, dominant period), the model's stride and the mod-24 gap's flatness fields (``residue_*``)."""
    return {**report["headline"], "stride": report["stride"], **flatness_fields(report, "residue")}


def _gap(r: dict) -> str:
    return (
        f"gap {pp(r['residue_gap'])} pp [{pp(r['residue_gap_lower'])}, {pp(r['residue_gap_upper'])}], "
        f"p = {r['residue_p_value']:.4f}, noise floor {pp(r['residue_noise_floor'])} pp"
    )


def _real(r: dict) -> bool:
    return gap_is_real(r["residue_p_value"], r["residue_gap_lower"], r["residue_noise_floor"])


def best_group(r: dict) -> float:
    """The best group's accuracy of a ``claim_row``: its worst group plus its best-minus-worst gap."""
    return r["worst_residue_accuracy"] + r["residue_gap"]


def learned_runs(rows: dict[str, dict[str, dict]], bar: float) -> set[tuple[str, str]]:
    """``(label, padding)`` of every evaluation whose best group reaches ``bar`` (``criteria.learned_best``)."""
    return {(lab, pad) for lab, pads in rows.items() for pad, r in pads.items() if best_group(r) >= bar}


def _not_learned(r: dict, criteria: dict[str, float]) -> str:
    return (
        f"not learned: best group {pp(best_group(r))}% under {pp(criteria['learned_best'])}% (no phase conclusion); "
        + _gap(r)
    )


def _outcome(claim: str, verdict: Optional[bool], detail: str) -> Check:
    """A check: ``verdict`` True (PASS), False (FAIL) or None (undecided)."""
    return Check(claim, verdict is True, detail, decided=verdict is not None)


def claims(
    rows: dict[str, dict[str, dict]],
    roles: dict[str, str],
    criteria: dict[str, float],
    ranks: list[tuple[str, tuple[float, Optional[float], Optional[float]], int]],
    paper_gaps: list[float],
    learned: set[tuple[str, str]],
) -> list[Check]:
    """The study's claims (docs/paper.md, "Criteria"), each PASS / FAIL / undecided with its interval. ``rows``:
    label -> padding -> ``claim_row``; ``roles``: label -> role (conf/study/paper.yaml); ``ranks``: ``rank_lines``;
    ``paper_gaps``: the paper baseline seeds' prefix gaps; ``learned``: ``learned_runs``. Precondition: every
    full-attention control's mean is at least ``criteria.control_mean`` in both paddings; otherwise every claim is
    undecided (no verdict). A compressed evaluation whose best group is under ``criteria.learned_best`` did not learn:
    no phase conclusion is drawn from it (its claims read undecided, it joins no comparison or rank)."""
    of = {role: [lab for lab in rows if roles.get(lab) == role] for role in set(roles.values())}
    controls, baseline = of.get("control", []), of.get("baseline", [])
    compressed = [lab for lab in rows if roles.get(lab) != "control"]
    bar = criteria["control_mean"]
    low = [f"{lab} {pad} {pp(r['mean'])}%" for lab in controls for pad, r in rows[lab].items() if r["mean"] < bar]
    ok = bool(controls) and not low
    out = [
        _outcome(
            f"precondition: every full-attention control's mean >= {pp(bar)}% in both paddings",
            ok,
            "; ".join(
                f"{lab} {pad} {pp(r['mean'])}% [{pp(r['mean_lower'])}, {pp(r['mean_upper'])}]"
                for lab in controls
                for pad, r in rows[lab].items()
            )
            or "no control finished",
        )
    ]
    for pad in PADDINGS:
        unlearned = [lab for lab in compressed if pad in rows[lab] and (lab, pad) not in learned]
        real = [
            (lab, rows[lab][pad])
            for lab in compressed
            if pad in rows[lab] and (lab, pad) in learned and _real(rows[lab][pad])
        ]
        wrong = [
            f"{lab} period {r['dominant_period']} (S={r['stride']})"
            for lab, r in real
            if r["dominant_period"] != r["stride"]
        ]
        out.append(
            _outcome(
                f"{pad}: the dominant period equals S for every compressed variant with a significant gap",
                None if not real else not wrong,
                f"{len(real)} of {len(compressed)} learned with a significant gap; "
                + ("; ".join(wrong) if wrong else "all at their S" if real else "none to judge")
                + (f"; not learned: {', '.join(unlearned)}" if unlearned else ""),
            )
        )
    for lab in controls:
        for pad, r in rows[lab].items():
            verdict = {"flat": True, "gap": False}.get(r["residue_verdict"])
            out.append(
                _outcome(
                    f"{lab} {pad}: flat (mod-24 gap's one-sided 95% upper bound under {pp(r['residue_margin'])} pp)",
                    verdict,
                    f"{_gap(r)}, upper bound {pp(r['residue_upper_one_sided'])} pp, smallest gap detected with "
                    f"{pp(r['residue_mde_power'])}% power: {pp(r['residue_mde'])} pp",
                )
            )
    for lab in [x for role in ("mean", "no_rope", "kv_heads") for x in of.get(role, [])]:
        for pad, r in rows[lab].items():
            if (lab, pad) not in learned:
                out.append(_outcome(f"{lab} {pad}: keeps a significant gap", None, _not_learned(r, criteria)))
                continue
            verdict = True if _real(r) else False if r["residue_verdict"] == "flat" else None
            out.append(_outcome(f"{lab} {pad}: keeps a significant gap", verdict, _gap(r)))
    for lab in [x for role in ("overlap", "tail") for x in of.get(role, [])]:
        for pad, r in rows[lab].items():
            base = [rows[b][pad]["worst_residue_accuracy"] for b in baseline if (b, pad) in learned]
            verdict = (
                None
                if not base or (lab, pad) not in learned
                else True
                if r["worst_residue_lower"] > max(base)
                else False
                if r["worst_residue_upper"] < float(np.mean(base))
                else None
            )
            out.append(
                _outcome(
                    f"{lab} {pad}: raises the worst group over the baseline (its interval above every baseline seed's)",
                    verdict,
                    f"worst {pp(r['worst_residue_accuracy'])}% [{pp(r['worst_residue_lower'])}, "
                    f"{pp(r['worst_residue_upper'])}] vs the learned baseline seeds "
                    f"{', '.join(pp(b) for b in base) or '-'}%"
                    + ("" if (lab, pad) in learned else f"; {_not_learned(r, criteria)}"),
                )
            )
    for what, (rho, lo, hi), n in ranks:
        verdict = None if lo is None or hi is None else True if lo > 0 else False if hi <= 0 else None
        out.append(
            _outcome(
                f"rank agreement with the paper: {what} > 0 (95% bootstrap over variants)",
                verdict,
                f"rho {rho:.2f} [{'-' if lo is None else f'{lo:.2f}'}, {'-' if hi is None else f'{hi:.2f}'}] over {n}",
            )
        )
    if not ranks:
        out.append(_outcome("rank agreement with the paper (Spearman of gap and worst group)", None, "no paper rows"))
    for pad in PADDINGS:
        seeds = [(lab, rows[lab][pad]) for lab in baseline if pad in rows[lab]]
        gaps = [r["residue_gap"] for _, r in seeds]
        spread = f"{pp(min(gaps))}-{pp(max(gaps))} pp" if gaps else "-"
        theirs = f"{pp(min(paper_gaps))}-{pp(max(paper_gaps))} pp" if paper_gaps else "n/a"
        unlearned = [lab for lab, _ in seeds if (lab, pad) not in learned]
        out.append(
            _outcome(
                f"{pad}: every baseline seed has a significant gap (seed spread beside the paper's)",
                None if not seeds or unlearned else all(_real(r) for _, r in seeds),
                f"gap over {len(seeds)} seeds {spread}; the paper's over 4 seeds (prefix) {theirs}"
                + (f"; not learned: {', '.join(unlearned)}" if unlearned else ""),
            )
        )
    if not ok:
        out = out[:1] + [
            Check(c.claim, False, "no verdict (precondition not met): " + c.detail, decided=False) for c in out[1:]
        ]
    return out


def curve_panels(
    done: list[dict], ids: dict[str, str], roles: dict[str, str], paper: dict[tuple[str, str], dict]
) -> list[CurvePanel]:
    """One panel per run in the paper's order (``ids``): its reports by padding, its stride (none for the
    full-attention controls, whose reports are read mod ``control_stride``) and the paper's mean per padding."""
    reports = {d["run"].label: d["evaluations"] for d in done}
    panels = []
    for label, vid in ids.items():
        evals = reports.get(label, {})
        stride = None if roles[label] == "control" else next((r["stride"] for r in evals.values()), None)
        reference = {pad: paper[(vid, pad)]["mean"][0] for pad in PADDINGS if (vid, pad) in paper}
        panels.append(CurvePanel(label, evals, stride, reference))
    return panels


def analysis_results(done: list[dict]) -> tuple[list[tuple[str, dict[str, dict]]], list[str]]:
    """The study's analyses (``ckv.apps.study_run.run_analyses``) by run: (label, results by analysis name) for each run
    with at least one result, and one line per analysis result, skip or failure with its file or reason."""
    items, lines = [], []
    for d in done:
        results = {}
        for name, a in d.get("analyses", {}).items():
            if "file" in a:
                env = read_json(Path(a["file"]))["analysis"]
                results[name] = env["results"]
                plots = [str(Path(a["file"]).parent / p) for p in env["results"].get("plots", [])]
                lines.append(f"  {d['run'].label} {name}: {', '.join(plots) or a['file']}")
            else:
                why = a.get("skipped") or a["error"].splitlines()[0]
                lines.append(f"  {d['run'].label} {name}: {'skipped' if 'skipped' in a else 'FAILED'} ({why})")
        if results:
            items.append((d["run"].label, results))
    return items, lines


def figures(
    done: list[dict], ids: dict[str, str], roles: dict[str, str], paper: dict[tuple[str, str], dict], out: Path
) -> tuple[dict[str, str], list[str]]:
    """The study's figures (docs/paper.md, "Figures"): ``paper_curves.png`` (every run's accuracy per residue, both
    paddings overlaid, in the paper's order), ``paper_heatmap.png`` (run x residue, one panel per padding) and, when
    the analyses ran, ``paper_mechanisms.png`` (per analysed run: knock-out per layer and phase, gate profiles, gate
    cycling). Returns their paths by name and the report's lines (the figures, then each analysis' files)."""
    reports = {d["run"].label: d["evaluations"] for d in done}
    paths = {
        "curves": plot_residue_curves(curve_panels(done, ids, roles, paper), out / "paper_curves.png"),
        "heatmap": plot_residue_heatmap([(lab, reports.get(lab, {})) for lab in ids], out / "paper_heatmap.png"),
    }
    items, lines = analysis_results(done)
    if items:
        paths["mechanisms"] = plot_mechanisms(items, out / "paper_mechanisms.png", "analysed runs")
    text = ["figures:", *(f"  {name}: {p}" for name, p in paths.items())]
    return {k: str(v) for k, v in paths.items()}, text + (["analyses (per run):", *lines] if lines else [])


def report(study: Study, done: list[dict], out: Path, quick: bool) -> tuple[list[Check], dict]:
    """Print and write (``<out>/paper_table.txt``) the side-by-side table, the rank agreement, the claims and the
    figures' paths; return the claims as checks and the figures (``{"figures": name -> path}``) for the record."""
    paper, why = read_paper(paper_path(study))
    roles = {r.label: r.role for r in study.runs}
    ids: dict[str, str] = {lab: v for lab, v in study.params["paper_ids"].items() if lab in roles}
    rows = run_rows(done)
    compressed = [lab for lab in ids if roles[lab] != "control"]
    claim_rows = {d["run"].label: {k: claim_row(v) for k, v in d["evaluations"].items()} for d in done}
    learned = learned_runs(
        {lab: claim_rows[lab] for lab in compressed if lab in claim_rows}, study.criteria["learned_best"]
    )
    ranks = rank_lines(rows, ids, paper, compressed, learned)
    text = [side_by_side(rows, ids, paper)] + ([why] if why else [])
    baseline_ids = [ids[lab] for lab in ids if roles[lab] == "baseline"]
    paper_gaps = [paper[(v, "prefix")]["gap"][0] for v in baseline_ids if (v, "prefix") in paper]
    checks = claims(claim_rows, roles, study.criteria, ranks, paper_gaps, learned)
    text += check_lines(checks, ("PASS", "FAIL", "undecided"))
    paths, lines = figures(done, ids, roles, paper, out)
    text += lines
    print("\n" + "\n".join(text) + "\n")
    (out / "paper_table.txt").write_text("\n".join(text) + "\n")
    return checks, {"figures": paths}
