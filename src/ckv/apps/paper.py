"""``conf/study/paper.yaml``'s report (docs/paper.md): ckv's numbers beside the paper's controlled table, the rank
agreement across the compressed variants, the study's claims, and its figures (every run's per-residue curves, the
run x residue heatmap, the baseline seeds' knock-outs, gate profiles and gate cycling).

Not an app: the generic command (``python -m ckv.apps.study paper``) calls ``report`` after the runs. Every number
read here is the mod-24 grouping of ckv's lookup report (``residue``: target position mod 24, the paper's groups):
mean, worst group and best-minus-worst gap, each with its cluster-bootstrap interval, for each padding.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ckv.analysis.plots import plot_mechanisms
from ckv.apps.study_config import ROOT, Study
from ckv.apps.study_results import Check, check_lines, pp
from ckv.eval.flatness import row_verdict
from ckv.eval.plots import CurvePanel, plot_residue_curves, plot_residue_heatmap
from ckv.eval.summary import flatness_fields
from ckv.io.results import read_json

PADDINGS = ("prefix", "in_sequence")  # the study's evaluations; the CSV spells the second "in-sequence"
METRICS = ("mean", "worst", "gap")
GAP_ROLES = ("mean", "no_rope", "kv_heads")  # criterion 4: each keeps a significant gap (FAIL: flat)
WORST_ROLES = ("overlap", "tail")  # criterion 5: each raises the worst group over the learned baseline seeds
CLAIM_ROLES = ("control", "baseline", *GAP_ROLES, *WORST_ROLES)  # every role the claims read
MIN_RANK_PAIRS = 3  # pairs a bootstrap interval of Spearman's rho needs
ResultOf = Callable[[str, str], Optional[dict]]  # (label, padding) -> its claim row, or None without a result


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
    """Ranks (1..n) of ``x`` along the last axis, ties sharing their mean rank (vectorised: the bootstrap ranks
    thousands of resamples at once)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, axis=-1, kind="stable")
    s = np.take_along_axis(x, order, axis=-1)
    n = x.shape[-1]
    pos = np.broadcast_to(np.arange(n, dtype=np.float64), s.shape)
    starts = np.ones(s.shape, dtype=bool)  # the first of each run of equal values (in sorted order)
    starts[..., 1:] = s[..., 1:] != s[..., :-1]
    ends = np.ones(s.shape, dtype=bool)  # the last of each run
    ends[..., :-1] = starts[..., 1:]
    first = np.maximum.accumulate(np.where(starts, pos, 0.0), axis=-1)
    last = np.flip(np.minimum.accumulate(np.flip(np.where(ends, pos, n - 1.0), -1), axis=-1), -1)
    ranks = np.empty_like(s)
    np.put_along_axis(ranks, order, (first + last) / 2 + 1, axis=-1)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation of ``a`` and ``b`` along the last axis (NaN where either is constant)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdims=True), rb - rb.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(-1) / np.sqrt((ra**2).sum(-1) * (rb**2).sum(-1))


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def rank_agreement(
    ours: list[float], theirs: list[float], n_bootstrap: int = 2000, seed: int = 0
) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """Spearman's rho of two paired lists, one pair per row of the paper's table, with a 95% percentile bootstrap
    interval over the pairs: each resample draws as many pairs as there are, with replacement, each pair kept whole;
    a resample with a constant side has no ranking (rho undefined) and is dropped, not counted. ``rho`` is ``None``
    with fewer than 2 pairs or a constant side, the interval ``None`` with fewer than ``MIN_RANK_PAIRS`` pairs or
    when no resample is left."""
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    rho = _finite(float(spearman(a, b))) if len(a) >= 2 else None
    if len(a) < MIN_RANK_PAIRS:
        return rho, None, None
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_bootstrap, len(a)))  # (resample, pair)
    boot = spearman(a[idx], b[idx])
    boot = boot[np.isfinite(boot)]
    if not len(boot):
        return rho, None, None
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return rho, float(lo), float(hi)


@dataclass(frozen=True)
class RankLine:
    """One Spearman agreement with the paper (``rank_lines``): of ``metric`` (``gap`` or ``worst``) under
    ``padding``, ``rho`` with its 95% bootstrap interval (``None`` where not computed) over ``n`` pairs (ckv's
    evaluation of a run beside the paper's row of that run), ``seeds`` of them the baseline's seeds (one pair per
    seed: the paper's table lists each seed as a row), and ``why`` there is no interval (``""`` when there is)."""

    metric: str
    padding: str
    rho: Optional[float]
    lower: Optional[float]
    upper: Optional[float]
    n: int
    seeds: int
    why: str = ""


def rank_lines(
    rows: dict[str, dict[str, dict]],
    ids: dict[str, str],
    roles: dict[str, str],
    paper: dict[tuple[str, str], dict],
    learned: set[tuple[str, str]],
) -> list[RankLine]:
    """Spearman agreement with the paper, per padding, of the gap and of the worst group: one line each, whatever is
    missing. The pairs are the compressed runs (``ids``' order, every role but ``control``) that finished the
    padding, learned there (``(label, padding)`` in ``learned``) and have the paper's row; each baseline seed is
    one pair, beside the paper's row of the same seed. A line without an interval says why: how many compressed
    runs finished, learned and have the paper's row."""
    compressed = [lab for lab in ids if roles.get(lab) != "control"]
    out = []
    for pad in PADDINGS:
        finished = [lab for lab in compressed if pad in rows.get(lab, {})]
        kept = [lab for lab in finished if (lab, pad) in learned]
        paired = [lab for lab in kept if (ids[lab], pad) in paper]
        seeds = sum(roles.get(lab) == "baseline" for lab in paired)
        for metric in ("gap", "worst"):
            ours = [rows[lab][pad][metric][0] for lab in paired]
            theirs = [paper[(ids[lab], pad)][metric][0] for lab in paired]
            rho, lo, hi = rank_agreement(ours, theirs)
            why = (
                ""
                if lo is not None
                else f"no interval under {MIN_RANK_PAIRS} pairs: {len(finished)} of {len(compressed)} compressed "
                f"runs finished, {len(kept)} of them learned, {len(paired)} of those have the paper's row"
                if len(paired) < MIN_RANK_PAIRS
                else "no interval: a side is constant in every resample"
            )
            out.append(RankLine(metric, pad, rho, lo, hi, len(paired), seeds, why))
    return out


def run_rows(done: list[dict]) -> dict[str, dict[str, dict]]:
    """Finished runs' numbers: label -> padding -> ``measured``."""
    return {d["run"].label: {k: measured(v) for k, v in d["evaluations"].items()} for d in done}


def claim_row(report: dict) -> dict:
    """What the claims read of one evaluation: the headline (mean with its interval, mod-24 gap with interval,
    permutation p, noise floor, worst group, dominant period), the model's stride and the mod-24 gap's flatness
    fields (``residue_*``: its one-sided upper bound, MDE)."""
    return {**report["headline"], "stride": report["stride"], **flatness_fields(report, "residue")}


def verdict(r: dict, criteria: dict[str, float]) -> str:
    """The mod-24 gap's verdict of a ``claim_row`` by the one rule of every table (``ckv.eval.flatness.row_verdict``):
    ``gap`` when significant (permutation p < 0.05 and the interval above the noise floor), else ``flat`` when the
    one-sided upper bound is under ``criteria.flat_margin``, else ``undecided``."""
    return row_verdict(r, "residue", criteria["flat_margin"])


def gap_text(r: dict) -> str:
    return (
        f"gap {pp(r['residue_gap'])} pp [{pp(r['residue_gap_lower'])}, {pp(r['residue_gap_upper'])}], "
        f"p = {r['residue_p_value']:.4f}, noise floor {pp(r['residue_noise_floor'])} pp"
    )


def verdict_text(r: dict, criteria: dict[str, float]) -> str:
    """The verdict with its reason, then the numbers it rests on."""
    v, margin = verdict(r, criteria), pp(criteria["flat_margin"])
    bound = f"one-sided upper bound {pp(r['residue_upper_one_sided'])} pp"
    why = {
        "gap": "significant: p < 0.05 and the interval above the noise floor",
        "flat": f"not significant, {bound} under {margin} pp",
        "undecided": f"not significant, {bound} not under {margin} pp",
        "not learned": f"the mean's upper bound under {margin}%",
    }[v]
    return f"{v} ({why}): {gap_text(r)}"


def best_group(r: dict) -> float:
    """The best group's accuracy of a ``claim_row``: its worst group plus its best-minus-worst gap."""
    return r["worst_residue_accuracy"] + r["residue_gap"]


def learned_runs(rows: dict[str, dict[str, dict]], bar: float) -> set[tuple[str, str]]:
    """``(label, padding)`` of every evaluation whose best group reaches ``bar`` (``criteria.learned_best``; exactly
    at the bar counts as learned)."""
    return {(lab, pad) for lab, pads in rows.items() for pad, r in pads.items() if best_group(r) >= bar}


def not_learned(r: dict, criteria: dict[str, float]) -> str:
    return (
        f"not learned: best group {pp(best_group(r))}% under {pp(criteria['learned_best'])}% (no phase conclusion); "
        + gap_text(r)
    )


NO_RESULT = "no result (its run or evaluation did not finish)"


def outcome(claim: str, passed: Optional[bool], detail: str) -> Check:
    """A check: ``passed`` True (PASS), False (FAIL) or None (undecided)."""
    return Check(claim, passed is True, detail, decided=passed is not None)


def _worst_claim(
    lab: str, pad: str, r: Optional[dict], base: dict[str, float], learned: bool, criteria: dict[str, float]
) -> Check:
    """Criterion 5 for one evaluation ``r`` of an overlap or tail run: PASS when its worst group's interval lies
    above every learned baseline seed's worst group (``base``: seed label -> worst group, this padding), FAIL when
    its upper bound is under their mean, else undecided; undecided too when it or every seed did not learn, or it
    has no result (``None``)."""
    claim = f"{lab} {pad}: raises the worst group over the baseline (its interval above every learned baseline seed's)"
    if r is None:
        return outcome(claim, None, NO_RESULT)
    lo, hi = r["worst_residue_lower"], r["worst_residue_upper"]
    highest, mean = (max(base.values()), float(np.mean(list(base.values())))) if base else (None, None)
    raised = None if not base or not learned else True if lo > highest else False if hi < mean else None
    seeds = ", ".join(f"{b} {pp(w)}%" for b, w in base.items()) or "none learned"
    return outcome(
        claim,
        raised,
        f"worst {pp(r['worst_residue_accuracy'])}% [{pp(lo)}, {pp(hi)}] vs the learned baseline seeds' worst groups "
        f"({seeds}; highest {pp(highest)}%, mean {pp(mean)}%)" + ("" if learned else f"; {not_learned(r, criteria)}"),
    )


def mean_precondition(controls: list[str], result: ResultOf, bar: float) -> Check:
    """make paper's precondition: every full-attention control's mean is at least ``bar`` in both paddings (a
    control without a result does not meet it; a study without a control never does). ``result(label, padding)``:
    its ``claim_row`` or None."""
    means = [(lab, pad, result(lab, pad)) for lab in controls for pad in PADDINGS]
    ok = bool(controls) and all(r is not None and r["mean"] >= bar for _, _, r in means)
    return outcome(
        f"precondition: every full-attention control's mean >= {pp(bar)}% in both paddings",
        ok,
        "; ".join(
            f"{lab} {pad} "
            + (NO_RESULT if r is None else f"{pp(r['mean'])}% [{pp(r['mean_lower'])}, {pp(r['mean_upper'])}]")
            for lab, pad, r in means
        )
        or "the study has no control",
    )


def control_flat_checks(controls: list[str], result: ResultOf, criteria: dict) -> list[Check]:
    """Every control flat in each padding (``verdict``: flat PASS, a significant gap FAIL, else undecided), with its
    80%-power MDE; undecided without a result."""
    margin = pp(criteria["flat_margin"])
    out = []
    for lab in controls:
        for pad in PADDINGS:
            claim = f"{lab} {pad}: flat (mod-24 gap's one-sided 95% upper bound under {margin} pp, no significant gap)"
            r = result(lab, pad)
            if r is None:
                out.append(outcome(claim, None, NO_RESULT))
                continue
            out.append(
                outcome(
                    claim,
                    {"flat": True, "gap": False}.get(verdict(r, criteria)),
                    f"{verdict_text(r, criteria)}, smallest gap detected with {pp(r['residue_mde_power'])}% power: "
                    f"{pp(r['residue_mde'])} pp",
                )
            )
    return out


def claims(
    rows: dict[str, dict[str, dict]],
    roles: dict[str, str],
    criteria: dict[str, float],
    ranks: list[RankLine],
    paper_gaps: list[float],
    learned: set[tuple[str, str]],
) -> list[Check]:
    """The study's claims (docs/paper.md, "Criteria"), each PASS / FAIL / undecided with its interval. ``rows``:
    label -> padding -> ``claim_row`` of the runs that finished; ``roles``: label -> role of every run of the study,
    finished or not (conf/study/paper.yaml); ``ranks``: ``rank_lines``; ``paper_gaps``: the paper baseline seeds'
    prefix gaps; ``learned``: ``learned_runs``.

    Precondition: every full-attention control's mean is at least ``criteria.control_mean`` in both paddings; a
    control without a result (its run or evaluation failed) does not meet it. Otherwise every claim is undecided (no
    verdict). A compressed evaluation whose best group is under ``criteria.learned_best`` did not learn: no phase
    conclusion is drawn from it (its claims read undecided, it joins no comparison or rank). "A significant gap"
    and "flat" are decided by ``verdict`` (significance first), in every claim."""
    of = {role: [lab for lab in roles if roles[lab] == role] for role in CLAIM_ROLES}
    controls, baseline = of["control"], of["baseline"]
    compressed = [lab for lab in rows if roles.get(lab) != "control"]

    def result(lab: str, pad: str) -> Optional[dict]:
        return rows.get(lab, {}).get(pad)

    def significant(r: dict) -> bool:
        return verdict(r, criteria) == "gap"

    out = [mean_precondition(controls, result, criteria["control_mean"])]
    for pad in PADDINGS:
        unlearned = [lab for lab in compressed if pad in rows[lab] and (lab, pad) not in learned]
        missing = [lab for lab in roles if roles[lab] != "control" and result(lab, pad) is None]
        extra = (f"; not learned: {', '.join(unlearned)}" if unlearned else "") + (
            f"; no result: {', '.join(missing)}" if missing else ""
        )
        out.append(period_check(pad, compressed, rows, learned, criteria, "compressed variant", extra))
    out += control_flat_checks(controls, result, criteria)
    for lab in [x for role in GAP_ROLES for x in of[role]]:
        for pad in PADDINGS:
            claim, r = f"{lab} {pad}: keeps a significant gap", result(lab, pad)
            if r is None or (lab, pad) not in learned:
                out.append(outcome(claim, None, NO_RESULT if r is None else not_learned(r, criteria)))
                continue
            kept = {"gap": True, "flat": False}.get(verdict(r, criteria))
            out.append(outcome(claim, kept, verdict_text(r, criteria)))
    for lab in [x for role in WORST_ROLES for x in of[role]]:
        for pad in PADDINGS:
            base = {b: rows[b][pad]["worst_residue_accuracy"] for b in baseline if (b, pad) in learned}
            out.append(_worst_claim(lab, pad, result(lab, pad), base, (lab, pad) in learned, criteria))
    out += [rank_check(line) for line in ranks]
    for pad in PADDINGS:
        seeds = [(lab, result(lab, pad)) for lab in baseline]
        gaps = [r["residue_gap"] for _, r in seeds if r is not None]
        spread = f"{pp(min(gaps))}-{pp(max(gaps))} pp" if gaps else "-"
        theirs = f"{pp(min(paper_gaps))}-{pp(max(paper_gaps))} pp" if paper_gaps else "n/a"
        missing = [lab for lab, r in seeds if r is None]
        unlearned = [lab for lab, r in seeds if r is not None and (lab, pad) not in learned]
        out.append(
            outcome(
                f"{pad}: every baseline seed has a significant gap (seed spread beside the paper's)",
                None if not gaps or missing or unlearned else all(significant(r) for _, r in seeds),
                f"gap over {len(gaps)} seeds {spread}; the paper's over 4 seeds (prefix) {theirs}"
                + (f"; not learned: {', '.join(unlearned)}" if unlearned else "")
                + (f"; no result: {', '.join(missing)}" if missing else ""),
            )
        )
    if not out[0].passed:
        out = out[:1] + [
            Check(c.claim, False, "no verdict (precondition not met): " + c.detail, decided=False) for c in out[1:]
        ]
    return out


def period_check(
    pad: str, labels: list[str], rows: dict, learned: set, criteria: dict[str, float], what: str, extra: str = ""
) -> Check:
    """The period claim under ``pad``: the dominant period of every learned run of ``labels`` with a significant gap
    (``verdict``) equals its S; undecided when none has one. ``what`` names the runs in the claim, ``extra`` ends its
    detail (the runs left out and why)."""
    real = [
        (lab, rows[lab][pad]) for lab in labels if (lab, pad) in learned and verdict(rows[lab][pad], criteria) == "gap"
    ]
    wrong = [
        f"{lab} period {r['dominant_period']} (S={r['stride']})"
        for lab, r in real
        if r["dominant_period"] != r["stride"]
    ]
    return outcome(
        f"{pad}: the dominant period equals S for every {what} with a significant gap",
        None if not real else not wrong,
        f"{len(real)} of {len(labels)} learned with a significant gap; "
        + ("; ".join(wrong) if wrong else "all at their S" if real else "none to judge")
        + extra,
    )


def rank_check(line: RankLine) -> Check:
    """The rank claim of one ``RankLine``: PASS when its 95% interval lies above 0, FAIL when its upper bound is at or
    under 0, else (or without an interval) undecided."""
    lo, hi = line.lower, line.upper
    return outcome(
        f"rank agreement with the paper: Spearman of {line.metric} ({line.padding}) > 0 "
        "(95% bootstrap over the paired rows)",
        None if lo is None or hi is None else True if lo > 0 else False if hi <= 0 else None,
        f"rho {rho_text(line.rho)} [{rho_text(lo)}, {rho_text(hi)}] over {line.n} rows (each baseline seed one "
        f"row: {line.seeds} here)" + (f"; {line.why}" if line.why else ""),
    )


def rho_text(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def curve_panels(
    done: list[dict],
    labels: Iterable[str],
    roles: dict[str, str],
    ids: Optional[dict[str, str]] = None,
    paper: Optional[dict[tuple[str, str], dict]] = None,
) -> list[CurvePanel]:
    """One panel per run of ``labels``, in their order: its reports by padding, its stride (none for the
    full-attention controls, whose reports are read mod ``control_stride``) and, where ``ids`` names its row of
    ``paper``, the paper's mean per padding."""
    reports = {d["run"].label: d["evaluations"] for d in done}
    panels = []
    for label in labels:
        evals = reports.get(label, {})
        stride = None if roles[label] == "control" else next((r["stride"] for r in evals.values()), None)
        vid = (ids or {}).get(label)
        reference = {pad: paper[(vid, pad)]["mean"][0] for pad in PADDINGS if paper and (vid, pad) in paper}
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
        "curves": plot_residue_curves(curve_panels(done, ids, roles, ids, paper), out / "paper_curves.png"),
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
    ranks = rank_lines(rows, ids, roles, paper, learned)
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
