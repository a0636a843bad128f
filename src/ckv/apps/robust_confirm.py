"""``make robust-confirm``'s verdicts (docs/robustness.md, "Confirmation: criteria"), committed before its runs: the
confirmation's models, seeds and numbers are ``conf/study/robust_confirm.yaml``'s; ``ckv.apps.robust --confirm``
runs them and prints these checks."""

from __future__ import annotations

from ckv.apps.study_config import load_study
from ckv.apps.study_results import CONTROL_LEARNED, Check, control_learned, every_seed, gap_text, pp
from ckv.eval.flatness import noninferiority_bounds

CONFIRM = load_study("robust_confirm")
CONFIRM_SEEDS = CONFIRM.seeds
CONFIRM_TASK = CONFIRM.params["task"]
CONFIRM_MODELS = tuple(CONFIRM.params["models"])
CONFIRM_FINALISTS = tuple(CONFIRM.params["finalists"])
CONFIRM_BASELINE, CONFIRM_CONTROL = CONFIRM.params["baseline"], CONFIRM.params["control"]
NONINFERIORITY_MARGIN = CONFIRM.criteria["noninferiority_margin"]


def confirm_verdicts(rows: list[dict]) -> list[Check]:
    """The confirmation's verdicts, as committed in docs/robustness.md ("Confirmation: criteria"): validity
    (the control learned, the baseline shows a real gap, in every seed), then per finalist C1 (phase-gap verdict
    ``flat`` in every seed: equivalence at the 5 pp margin) and C2 (in every seed, every phase's one-sided 95% lower
    bound of its accuracy minus the same seed's control mean above -NONINFERIORITY_MARGIN) and the verdict:
    confirmed (C1 and C2), flat but not as good as full attention (C1 only), or not confirmed. A finalist, its
    baseline or the control missing a seed leaves it unjudged (no check)."""
    by = {(r["model"], r["seed"]): r for r in rows if r["task"] == CONFIRM_TASK}
    seeds = sorted({s for _, s in by})
    base = [by.get((CONFIRM_BASELINE, s)) for s in seeds]
    ctrl = [by.get((CONFIRM_CONTROL, s)) for s in seeds]
    if not seeds or any(r is None for r in base + ctrl):
        return []
    learned = every_seed(
        f"validity: the control ({CONFIRM_CONTROL}) learns the task (mean >= {100 * CONTROL_LEARNED:.0f}%) "
        "in every seed",
        seeds,
        [control_learned(c) for c in ctrl],
        [
            f"mean {100 * c['mean']:.1f}% [{100 * c['mean_lower']:.1f}, {100 * c['mean_upper']:.1f}], "
            f"verdict {c['phase_verdict']}"
            for c in ctrl
        ],
    )
    mechanism = every_seed(
        f"validity: the baseline ({CONFIRM_BASELINE}) shows a real phase gap in every seed",
        seeds,
        [b["phase_verdict"] == "gap" for b in base],
        [f"{gap_text(b)}, worst {100 * b['worst_phase_accuracy']:.1f}%, {b['phase_verdict']}" for b in base],
    )
    checks = [learned, mechanism]
    if not (learned.passed and mechanism.passed):
        return checks
    for name in CONFIRM_FINALISTS:
        fixes = [by.get((name, s)) for s in seeds]
        if any(f is None for f in fixes):
            continue
        flat = [f["phase_verdict"] == "flat" for f in fixes]
        bounds = [
            min(
                noninferiority_bounds(
                    f["per_phase"],
                    f["per_phase_lower"],
                    f["per_phase_upper"],
                    c["mean"],
                    c["mean_lower"],
                    c["mean_upper"],
                )
            )
            for f, c in zip(fixes, ctrl)
        ]
        near = [b > -NONINFERIORITY_MARGIN for b in bounds]
        checks.append(
            every_seed(
                f"C1 {name}: flat (phase gap's one-sided 95% upper bound under {pp(fixes[0]['phase_margin'])} pp) "
                "in every seed",
                seeds,
                flat,
                [
                    f"{gap_text(f)} <= {pp(f['phase_upper_one_sided'])}, MDE {pp(f['phase_mde'])}, {f['phase_verdict']}"
                    for f in fixes
                ],
            )
        )
        checks.append(
            every_seed(
                f"C2 {name}: every phase non-inferior to full attention's mean (margin "
                f"{100 * NONINFERIORITY_MARGIN:.0f} pp, one-sided 95%) in every seed",
                seeds,
                near,
                [
                    f"worst phase {100 * f['worst_phase_accuracy']:.1f}% vs full's mean "
                    f"{100 * c['mean']:.1f}%, lowest bound of (phase - full) {100 * b:+.1f} pp"
                    for f, c, b in zip(fixes, ctrl, bounds)
                ],
            )
        )
        verdict = (
            "confirmed"
            if all(flat) and all(near)
            else "flat, not as good as full attention"
            if all(flat)
            else "not confirmed"
        )
        checks.append(
            Check(
                f"verdict {name}: {verdict}",
                verdict == "confirmed",
                "reported, not judged: worst phase vs the baseline's "
                + "; ".join(
                    f"seed {s}: {100 * f['worst_phase_accuracy']:.1f}% vs {100 * b['worst_phase_accuracy']:.1f}% "
                    f"({100 * (f['worst_phase_accuracy'] - b['worst_phase_accuracy']):+.1f} pp)"
                    for s, f, b in zip(seeds, fixes, base)
                ),
            )
        )
    return checks
