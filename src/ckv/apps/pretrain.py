"""``conf/study/pretrain.yaml``'s report (docs/pretrain.md): pretrained models beside make paper's task-trained rows of
the same variants and the paper's, with paired differences, the study's claims, and its figures (every run's
per-residue curves; the emergence of the skill and of the weak phase over training).

Not an app: the generic command (``python -m ckv.apps.study pretrain``) calls ``report`` after the runs. The numbers
are the mod-24 groups of ckv's lookup report, as make paper's (``ckv.apps.paper``: its learned bar, its verdict rule,
its rank agreement). A pretrained run and its task-trained row are scored on prompts of one design (the same
mappings, shifts and target positions; the words differ), so their per-prompt outcomes pair: each difference's
interval is a cluster bootstrap over the mappings that resamples both at once (``paired_group_differences``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from ckv.analysis.paired import paired_group_differences
from ckv.analysis.plots import plot_emergence
from ckv.apps.paper import (
    NO_RESULT,
    PADDINGS,
    best_group,
    claim_row,
    control_flat_checks,
    curve_panels,
    learned_runs,
    not_learned,
    outcome,
    paper_path,
    period_check,
    rank_check,
    rank_lines,
    read_paper,
    run_rows,
    verdict,
    verdict_text,
)
from ckv.apps.study_config import Study
from ckv.apps.study_results import Check, check_lines, pp
from ckv.apps.study_run import eval_names
from ckv.eval.plots import plot_residue_curves
from ckv.eval.stats import StatsOptions
from ckv.io.layout import eval_dir, read_run_config
from ckv.io.results import RESULTS_CSV, read_int_columns, read_json

TASK_TRAINED = "task_trained"  # make paper's recipe: the rows the three questions compare with
BOUNDARY_ROLES = ("baseline", "kv8", "no_rope")  # W = S scalar gates: the weakest phase should be S - 1
CLAIM_ROLES = ("control", "baseline", "kv8", "deepseek", "no_rope", TASK_TRAINED)  # every role the claims read


def outcomes(d: dict, task_name: str) -> Optional[dict[str, np.ndarray]]:
    """Per-prompt columns of one evaluation's ``results.csv`` (``base``, ``shift``, ``residue``, ``correct``) sorted
    by (base, shift), or ``None`` when the file is absent."""
    path = eval_dir(d["dir"], task_name) / RESULTS_CSV
    if not path.is_file():
        return None
    cols = read_int_columns(path, ("base", "shift", "residue", "correct"))
    order = np.lexsort((cols["shift"], cols["base"]))
    return {k: v[order] for k, v in cols.items()}


def paired(a: dict[str, np.ndarray], b: dict[str, np.ndarray], modulus: int) -> Optional[dict[str, dict]]:
    """Differences ``a - b`` (mean, worst group, gap over the ``modulus`` groups) of two evaluations of one design,
    with paired intervals; ``None`` when the prompts do not pair (another design: mappings, shifts or residues
    differ)."""
    same = all(len(a[k]) == len(b[k]) and np.array_equal(a[k], b[k]) for k in ("base", "shift", "residue"))
    if not same:
        return None
    return paired_group_differences(a["correct"], b["correct"], a["residue"], modulus, a["base"], StatsOptions())


def _diff(x: Optional[dict]) -> str:
    if not x or x["value"] is None:
        return "n/a"
    return f"{pp(x['value']):>5s} [{pp(x['lower'])}, {pp(x['upper'])}]"


def _iv(value: float, lo: float, hi: float) -> str:
    return f"{pp(value)} [{pp(lo)}, {pp(hi)}]"


def row(report: dict) -> dict:
    """What the claims read of one evaluation: make paper's ``claim_row`` and the accuracy of each phase group."""
    return {**claim_row(report), "phase_accuracy": [g["accuracy"] for g in report["phase"]["groups"]]}


def comparisons(study: Study, done: list[dict]) -> dict[tuple[str, str], dict]:
    """(pretrained label, padding) -> ``{"twin", "diff"}``: its task-trained row (``params.task_trained``) and the
    paired differences pretrained - task-trained (``None`` where either did not finish or the prompts do not pair)."""
    names = eval_names(study.task, study.evals)
    by_label = {d["run"].label: d for d in done}
    out = {}
    for label, twin in study.params.get("task_trained", {}).items():
        for key, task_name in names.items():
            a, b = by_label.get(label), by_label.get(twin)
            if a is None or b is None or key not in a["evaluations"] or key not in b["evaluations"]:
                out[(label, key)] = {"twin": twin, "diff": None}
                continue
            oa, ob = outcomes(a, task_name), outcomes(b, task_name)
            modulus = a["evaluations"][key]["headline"]["modulus"]
            out[(label, key)] = {"twin": twin, "diff": None if oa is None or ob is None else paired(oa, ob, modulus)}
    return out


def table(rows: dict[str, dict[str, dict]], labels: list[str], compared: dict, paper: dict, ids: dict) -> str:
    """One line per pretrained run and padding: its mean, worst group and gap (95% intervals), its task-trained
    row's gap, the paired difference of the gap (pretrained - task-trained) and the paper's gap."""
    head = (
        f"{'run':26s} {'padding':11s} {'mean':>20s} {'worst':>20s} {'gap':>20s} {'task-trained gap':>22s} "
        f"{'gap difference':>22s} {'paper gap':>10s}"
    )
    lines = [head]
    for lab in labels:
        for pad in PADDINGS:
            r = rows.get(lab, {}).get(pad)
            cells = ["n/a"] * 3 if r is None else [_iv(*r[m]) for m in ("mean", "worst", "gap")]
            c = compared.get((lab, pad))
            twin = rows.get(c["twin"], {}).get(pad) if c else None
            theirs = paper.get((ids.get(lab, ""), pad), {}).get("gap", (None,))[0]
            lines.append(
                f"{lab:26s} {pad:11s} {cells[0]:>20s} {cells[1]:>20s} {cells[2]:>20s} "
                f"{(_iv(*twin['gap']) + ' ' + c['twin'].split('/')[0]) if twin else 'n/a':>22s} "
                f"{_diff((c or {}).get('diff') and c['diff']['gap']):>22s} "
                f"{pp(theirs) if theirs is not None else 'n/a':>10s}"
            )
    return "\n".join(lines)


def _question(
    claim: str, labs: list[str], pad: str, claim_rows: dict, learned: set, criteria: dict, compared: dict
) -> Check:
    """Q1 / Q2: every run of ``labs`` keeps a significant gap under ``pad``: PASS when each is significant, FAIL when
    one is flat, else undecided (a run without a result or not learned: undecided); each with its paired difference
    of the gap against its task-trained row."""
    parts, verdicts = [], []
    for lab in labs:
        r = claim_rows.get(lab, {}).get(pad)
        c = compared.get((lab, pad)) or {}
        diff = f"; gap - task-trained ({c.get('twin', 'n/a')}) {_diff((c.get('diff') or {}).get('gap'))} pp"
        if r is None:
            parts.append(f"{lab}: {NO_RESULT}")
            verdicts.append(None)
        elif (lab, pad) not in learned:
            parts.append(f"{lab}: {not_learned(r, criteria)}{diff}")
            verdicts.append(None)
        else:
            parts.append(f"{lab}: {verdict_text(r, criteria)}{diff}")
            verdicts.append({"gap": True, "flat": False}.get(verdict(r, criteria)))
    passed = False if False in verdicts else True if verdicts and all(v is True for v in verdicts) else None
    return outcome(claim, passed, "; ".join(parts) or "no run of this role")


def _spread(labs: list[str], pad: str, claim_rows: dict, learned: set, spread: list[float], compared: dict) -> Check:
    """Q3: the baseline's gap inside the paper's seed spread ``spread`` (pp): PASS when every seed's gap lies inside,
    FAIL when every seed's interval lies outside it, else undecided."""
    lo, hi = spread[0] / 100, spread[1] / 100
    inside, outside, parts = [], [], []
    for lab in labs:
        r = claim_rows.get(lab, {}).get(pad)
        if r is None or (lab, pad) not in learned:
            parts.append(f"{lab}: {NO_RESULT if r is None else 'not learned'}")
            inside.append(False)
            outside.append(False)
            continue
        g, gl, gu = r["residue_gap"], r["residue_gap_lower"], r["residue_gap_upper"]
        inside.append(lo <= g <= hi)
        outside.append(gu < lo or gl > hi)
        c = compared.get((lab, pad)) or {}
        parts.append(f"{lab}: {_iv(g, gl, gu)} pp; gap - task-trained {_diff((c.get('diff') or {}).get('gap'))} pp")
    passed = True if labs and all(inside) else False if labs and all(outside) else None
    claim = f"{pad}: the baseline's gap lies inside the paper's seed spread ({spread[0]}-{spread[1]} pp)"
    return outcome(claim, passed, "; ".join(parts) or "no baseline run")


def _boundary(lab: str, pad: str, r: Optional[dict], learned: bool, criteria: dict) -> Check:
    """The weakest phase group of a W = S scalar-gate run is its boundary phase S - 1: PASS when it is, FAIL when
    another phase is lower; undecided without a significant gap (or a result, or learning). ``r``: a ``row``."""
    claim = f"{lab} {pad}: the weakest phase group is the boundary phase S - 1"
    if r is None or not learned:
        return outcome(claim, None, NO_RESULT if r is None else not_learned(r, criteria))
    s = r["stride"]
    phases = r["phase_accuracy"]
    worst = min(range(len(phases)), key=lambda p: phases[p])
    text = f"phases 0..{s - 1}: " + " / ".join(pp(a) for a in phases) + f" %; weakest {worst}"
    if verdict(r, criteria) != "gap":
        return outcome(claim, None, f"no significant gap ({verdict_text(r, criteria)}); {text}")
    return outcome(claim, worst == s - 1, text)


def claims(
    study: Study, claim_rows: dict, roles: dict[str, str], learned: set, compared: dict, ranks: list
) -> list[Check]:
    """The study's claims (conf/study/pretrain.yaml, "The claims"), each PASS / FAIL / undecided; every claim but the
    precondition reads "no verdict" when the precondition fails."""
    criteria = study.criteria
    of = {role: [lab for lab in roles if roles[lab] == role] for role in set(roles.values())}
    controls = of.get("control", [])
    bar, cap = criteria["learned_best"], criteria["control_saturated"]
    cells = [(lab, pad, claim_rows.get(lab, {}).get(pad)) for lab in controls for pad in PADDINGS]
    ok = bool(controls) and all(r is not None and best_group(r) >= bar for _, _, r in cells)
    out = [
        outcome(
            f"precondition: every full-attention control learned (best group >= {pp(bar)}%) in both paddings",
            ok,
            "; ".join(
                f"{lab} {pad} "
                + (
                    NO_RESULT
                    if r is None
                    else f"best {pp(best_group(r))}%, mean {pp(r['mean'])}% "
                    f"({'not saturated' if r['mean'] <= cap else 'saturated'}: the regime aims at <= {pp(cap)}%)"
                )
                for lab, pad, r in cells
            )
            or "the study has no control",
        )
    ]
    out += control_flat_checks(controls, lambda lab, pad: claim_rows.get(lab, {}).get(pad), criteria)
    pretrained = [lab for lab in roles if roles[lab] not in ("control", TASK_TRAINED)]
    for pad in PADDINGS:
        unlearned = [lab for lab in pretrained if (lab, pad) not in learned]
        extra = f"; not learned or no result: {', '.join(unlearned)}" if unlearned else ""
        out.append(period_check(pad, pretrained, claim_rows, learned, criteria, "learned pretrained variant", extra))
    for lab in [x for role in BOUNDARY_ROLES for x in of.get(role, [])]:
        for pad in PADDINGS:
            out.append(_boundary(lab, pad, claim_rows.get(lab, {}).get(pad), (lab, pad) in learned, criteria))
    spread = study.params["paper_spread"]
    for pad in PADDINGS:
        out.append(
            _question(
                f"Q1 {pad}: DeepSeek-V4's compressor keeps a significant gap after pretraining",
                of.get("deepseek", []),
                pad,
                claim_rows,
                learned,
                criteria,
                compared,
            )
        )
        out.append(
            _question(
                f"Q2 {pad}: 8 KV heads keep a significant gap after pretraining (every seed)",
                of.get("kv8", []),
                pad,
                claim_rows,
                learned,
                criteria,
                compared,
            )
        )
        out.append(_spread(of.get("baseline", []), pad, claim_rows, learned, spread[pad], compared))
    out += [rank_check(line) for line in ranks]
    if not ok:
        out = out[:1] + [
            Check(c.claim, False, "no verdict (precondition not met): " + c.detail, decided=False) for c in out[1:]
        ]
    return out


def _concentration(d: dict) -> dict[int, float]:
    """Step -> the mean static effective number of offsets over the run's gates (layers, KV heads, K and V), from
    its gates analysis over the checkpoints (none without that analysis)."""
    found = (d.get("analyses") or {}).get("gates") or {}
    if "file" not in found:
        return {}
    series = read_json(Path(found["file"]))["analysis"]["results"].get("checkpoints") or []
    return {s["step"]: float(np.mean([g["static"] for g in s["gates"]])) for s in series if s["gates"]}


def emergence(done: list[dict]) -> list[dict]:
    """Per run evaluated at its checkpoints (the study's ``checkpoints``): ``{"label", "tokens", "mean", "worst",
    "gap", "concentration"}``, lists over its checkpoints in step order: tokens seen, the mod-24 mean, worst group and
    gap of the checkpoint's evaluation, and the gate concentration (``_concentration``; ``None`` without gates)."""
    series = []
    for d in done:
        points = d.get("checkpoints") or {}
        if not points:
            continue
        steps = sorted(points)
        trainer = read_run_config(d["dir"])
        per_step = trainer["trainer"]["global_batch_size"] * trainer["data"]["seq_len"]
        heads = [points[s]["headline"] for s in steps]
        conc = _concentration(d)
        series.append(
            {
                "label": d["run"].label,
                "tokens": [s * per_step for s in steps],
                "mean": [h["mean"] for h in heads],
                "worst": [h["worst_residue_accuracy"] for h in heads],
                "gap": [h["residue_gap"] for h in heads],
                "concentration": [conc.get(s) for s in steps],
            }
        )
    return series


def probe_lines(study: Study, done: list[dict]) -> tuple[list[str], dict[str, dict]]:
    """The filler-length probe's table (the study's ``probes``: every pretrained run, none of the task-trained twins,
    whose synthetic vocabulary has no text): per run, its flips of the top-1 over the filler lengths, the share of
    lengths whose top-1 is the expected answer (overall and per phase, filler tokens mod the run's stride), the share
    where the expected answer is more probable than the other candidates, and the periodicity of its probability at
    that stride against chance; and those numbers by run for the record. Descriptive: no claim reads it (the
    criteria were committed before it joined the study)."""
    runs = [d for d in done if "probe" in d]
    if study.probes is None or not runs:
        return [], {}
    first = runs[0]["probe"]
    lines = [
        f"filler-length probe (task={study.probes.task}: {len(first['lengths'])} filler lengths; "
        f"'{first['labels'][0]}' expected, {', '.join(repr(x) for x in first['labels'][1:])} the other candidates; "
        "descriptive, not a claim):",
        f"  {'run':<26} {'S':>2} {'flips':>5} {'top-1 = expected':>16}  per phase (%)            "
        f"{'expected > others':>17}  periodicity (chance)  dominant period",
    ]
    record = {}
    for d in runs:
        r, h = d["probe"], d["probe"]["headline"]
        per = " ".join(f"{100 * x['expected_top1_share']:3.0f}" for x in r["phases"])
        pe = r["periodicity"] or {}
        score = "n/a" if pe.get("score") is None else f"{pe['score']:.2f} ({pe['chance']:.2f})"
        dom = "none" if h["dominant_period"] is None else f"{h['dominant_period']} (p={pe['dominant_p_value']:.3f})"
        lines.append(
            f"  {d['run'].label:<26} {r['stride']:>2} {r['flips']:>5} {pp(h['expected_top1_share']) + '%':>16}  "
            f"{per:<24} {pp(h['expected_best_share']) + '%':>17}  {score:<21} {dom}"
        )
        record[d["run"].label] = {
            "stride": r["stride"],
            "flips": r["flips"],
            "expected_top1_share": h["expected_top1_share"],
            "expected_best_share": h["expected_best_share"],
            "per_phase": {x["phase"]: x["expected_top1_share"] for x in r["phases"]},
            "periodicity": pe,
        }
    return lines, record


def report(study: Study, done: list[dict], out: Path, quick: bool) -> tuple[list[Check], dict]:
    """Print and write (``<out>/pretrain_table.txt``) the table beside make paper's rows and the paper's, the claims,
    the filler-length probe's table and the figures' paths; return the claims as checks and the figures and probe
    numbers for the record."""
    paper, why = read_paper(paper_path(study))
    roles = {r.label: r.role for r in study.runs}
    ids = study.params["paper_ids"]
    rows = run_rows(done)
    claim_rows = {d["run"].label: {k: row(v) for k, v in d["evaluations"].items()} for d in done}
    learned = learned_runs(claim_rows, study.criteria["learned_best"])
    compared = comparisons(study, done)
    pretrained = [lab for lab in roles if roles[lab] != TASK_TRAINED]
    compressed_ids = {lab: v for lab, v in ids.items() if lab in roles and roles[lab] != "control"}
    ranks = rank_lines(rows, {**compressed_ids}, roles, paper, {x for x in learned if x[0] in compressed_ids})
    text = [table(rows, pretrained, compared, paper, ids)] + ([why] if why else [])
    checks = claims(study, claim_rows, roles, learned, compared, ranks)
    text += check_lines(checks, ("PASS", "FAIL", "undecided"))
    probe, probes = probe_lines(study, done)
    text += probe
    panels = curve_panels(done, pretrained, roles, ids, paper)
    paths = {"curves": str(plot_residue_curves(panels, out / "pretrain_curves.png"))}
    series = emergence(done)
    if series:
        paths["emergence"] = str(plot_emergence(series, out / "pretrain_emergence.png"))
    text += ["figures:", *(f"  {name}: {p}" for name, p in paths.items())]
    print("\n" + "\n".join(text) + "\n")
    (out / "pretrain_table.txt").write_text("\n".join(text) + "\n")
    return checks, {"figures": paths, **({"probes": probes} if probes else {})}
