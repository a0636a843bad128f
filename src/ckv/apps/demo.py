"""``make demo``: periodic weak spots on a CPU, measured, next to a full-attention control that has learned.

The demo is the study ``conf/study/demo.yaml`` (``--grid``: ``conf/study/demo_grid.yaml``) over ``ckv.apps.study``:
it drives ``train.py`` and ``eval.py`` with shipped configs (``conf/experiment/demo_*.yaml``,
``conf/eval/task/demo_lookup.yaml``), training its three models (all at once on two cores) and evaluating each on
the position-matched lookup task; it writes the side-by-side comparison through ``eval.py summary=...``, then
prints one table and checks the science it claims (``check_science``, with the YAML's numbers), writing everything
under ``outputs/demo/``. The grid makes no claims: its table says which models learned the task
(``grid_findings``, with its own bar from ``conf/study/demo_grid.yaml``) and what the phase gap shows for those only.

    python -m ckv.apps.demo                 # the full demo (time in the Makefile and docs/demo.md)
    python -m ckv.apps.demo --quick         # a few steps per model: checks the pipeline, not the science
    python -m ckv.apps.demo --grid          # the stride x window x pooling grid (make demo-grid)

The full demo exits 1 when a science check fails; ``--quick`` exits 0 whatever the checks say (its few steps
cannot meet the thresholds: it only shows that every stage runs), and a failed command always exits non-zero. The
grid exits 0 once every stage ran, whichever models learned.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from ckv.apps.study import study_arguments
from ckv.apps.study_config import Study, load_study
from ckv.apps.study_results import (
    CONTROL_LEARNED,
    Check,
    check_lines,
    control_learned,
    exit_code,
    gap_text,
    pp,
    result_row,
    run_records,
    table,
)
from ckv.apps.study_run import run_command, run_plan, start
from ckv.eval.flatness import row_verdict
from ckv.eval.stats import gap_is_real
from ckv.io.results import write_json

DEMO, GRID = load_study("demo"), load_study("demo_grid")


def check_science(done: list[dict], criteria: dict[str, float]) -> list[Check]:
    """The demo's claims (docs/demo.md), each against the measured numbers and ``criteria`` (conf/study/demo.yaml).
    Every check reads the phase gap (best minus worst over the groups of position mod S, S the model's stride; the
    control at the gate models' stride 4), since the claims are about a phase effect of period S, not the residue
    gap."""
    gate_gap, below_gate = criteria["gate_phase_gap"], criteria["control_below_gate"]
    checks: list[Check] = []
    by_role: dict[str, list[tuple[str, dict]]] = {}
    for d in done:
        by_role.setdefault(d["run"].role, []).append((d["run"].label, result_row(d)))
    gate_means = []
    for label, r in by_role.get("gate", []):
        gate_means.append(r["mean"])
        ok = r["phase_gap"] >= gate_gap and r["phase_gap_lower"] > r["phase_noise_floor"]
        checks.append(
            Check(
                f"{label}: phase gap (mod S={r['stride']}) >= {100 * gate_gap:.0f} pp, interval above the noise floor",
                ok,
                f"{gap_text(r)}, noise floor {100 * r['phase_noise_floor']:.1f} pp",
            )
        )
    for label, r in by_role.get("geometry", []):
        # a period counts only where there is a phase effect: significant, and its interval above the noise floor
        real = gap_is_real(r["phase_p_value"], r["phase_gap_lower"], r["phase_noise_floor"])
        ok = real and r["dominant_period"] == r["stride"]
        score = r["periodicity_score"]
        checks.append(
            Check(
                f"{label}: a significant phase effect whose dominant period equals the stride ({r['stride']})",
                ok,
                f"dominant period {r['dominant_period']}, periodicity score "
                f"{'-' if score is None else round(score, 3)}, {gap_text(r)}, p = "
                f"{r['phase_p_value']:.4f}, noise floor {100 * r['phase_noise_floor']:.1f} pp",
            )
        )
    for label, r in by_role.get("control", []):
        best_gate = max(gate_means) if gate_means else 0.0
        ok_mean = control_learned(r) and r["mean"] >= best_gate - below_gate
        checks.append(
            Check(
                f"{label}: full attention has learned (mean >= {100 * CONTROL_LEARNED:.0f}% and >= gate mean - "
                f"{100 * below_gate:.0f} pp)",
                ok_mean,
                f"mean {100 * r['mean']:.1f}% vs best gate mean {100 * best_gate:.1f}%",
            )
        )
        checks.append(
            Check(
                f"{label}: flat at stride {r['stride']}: the phase gap's one-sided 95% upper bound is under "
                f"{100 * r['phase_margin']:.0f} pp (equivalence test)",
                row_verdict(r, "phase") == "flat",
                f"gap {100 * r['phase_gap']:.1f} pp, upper bound {100 * r['phase_upper_one_sided']:.1f} pp, "
                f"p = {r['phase_p_value']:.3f}, noise floor {100 * r['phase_noise_floor']:.1f} pp",
            )
        )
    return checks


def grid_findings(done: list[dict], learned_bar: float) -> list[Check]:
    """The grid's line per model (docs/demo.md, "The grid"): whether it learned the task, i.e. its best phase's
    accuracy is at least ``learned_bar`` (``criteria.learned_best_phase`` in conf/study/demo_grid.yaml; not the
    mean, which a model's own weak phase pulls down), and for a model that learned only, what its phase gap
    (mod S) shows by the one verdict rule (``ckv.eval.flatness.row_verdict``: significance first): a phase effect
    and whether its weakest phase is the boundary phase S - 1, flat, or neither. A model that did not learn gets no
    phase conclusion."""
    findings = []
    for d in done:
        r = result_row(d)
        best = max(r["per_phase"])
        gap = f"gap {pp(r['phase_gap'])} pp [{pp(r['phase_gap_lower'])}, {pp(r['phase_gap_upper'])}]"
        verdict = row_verdict(r, "phase")
        if best < learned_bar:
            detail = f"best phase {pp(best)}%: no phase conclusion"
        elif verdict == "gap":
            boundary = "the boundary phase S - 1" if r["worst_phase"] == r["stride"] - 1 else "not the boundary phase"
            detail = (
                f"best phase {pp(best)}%; phase effect: {gap} above its {pp(r['phase_noise_floor'])} pp noise "
                f"floor, weakest phase {r['worst_phase']} ({boundary})"
            )
        elif verdict == "flat":
            detail = f"best phase {pp(best)}%; flat: {gap}, one-sided upper bound {pp(r['phase_upper_one_sided'])} pp"
        else:
            detail = (
                f"best phase {pp(best)}%; neither a phase effect nor flat: {gap}, p = {r['phase_p_value']:.4f}, "
                f"noise floor {pp(r['phase_noise_floor'])} pp"
            )
        findings.append(Check(f"{d['run'].label} (best phase >= {pp(learned_bar)}%)", best >= learned_bar, detail))
    return findings


def main(argv: Optional[list[str]] = None) -> int:
    ap = study_arguments(__doc__, DEMO.out)
    ap.add_argument(
        "--grid",
        action="store_true",
        help=f"the stride x window x pooling grid (make demo-grid, default --out {GRID.out})",
    )
    ap.set_defaults(workers=None)  # the study's own (the demo's three models all at once; the grid's 12 two at a time)
    args = ap.parse_args(argv)
    study: Study = GRID if args.grid else DEMO
    if args.grid and args.out == ap.get_default("out"):
        args.out = GRID.out
    workers = args.workers or study.workers_for(len(study.runs))
    out = Path(args.out).resolve()
    clock, env = start(study, study.runs, out, args.quick, workers)
    done = run_plan(study.runs, out, args.quick, workers, env, clock, study.task)
    runs = ",".join(f"'{d['dir']}'" for d in done)  # quoted: run folder names hold '='
    run_command(
        [sys.executable, "eval.py", f"summary=[{runs}]", f"task={study.task}", f"summary_out={out}", "progress=false"],
        out / "logs" / "summary.log",
        env,
    )
    # the demo's claims, or the grid's line per model (it makes no claims: its exit code ignores them)
    checks = [] if args.grid else check_science(done, study.criteria)
    findings = grid_findings(done, study.criteria["learned_best_phase"]) if args.grid else []
    print("\n" + table(done, [f.passed for f in findings] if args.grid else None) + "\n")
    for line in check_lines(checks, ("PASS", "FAIL")) + check_lines(findings, ("learned", "NOT LEARNED")):
        print(line)
    if args.grid:
        missed = [d["run"].label for d, f in zip(done, findings) if not f.passed]
        print(f"not learned, so no phase conclusion: {', '.join(missed)}" if missed else "every model learned the task")
    verdict = bool(checks) and all(c.passed for c in checks)
    if args.quick:
        print("quick mode: the thresholds above need the full budget; only the pipeline was checked")
    plots = {
        "phases": out / "comparison_phases.png",
        "residues": out / "comparison_residues.png",
        "grid": out / "summary_grid.png",
    }
    write_json(
        out / f"{study.record}.json",
        {
            "quick": args.quick,
            "grid": args.grid,
            "seconds": time.monotonic() - clock.start,
            "all_passed": verdict,
            "checks": [c.__dict__ for c in checks],
            "learned": [c.__dict__ for c in findings],
            "runs": run_records(done, study.task),
            "plots": {k: str(v) for k, v in plots.items()},
        },
    )
    print(
        f"[{clock}] plots: {', '.join(str(p) for p in plots.values())}; table: {out / 'summary.csv'}; "
        f"record: {out / f'{study.record}.json'}"
    )
    if checks:
        print("the science holds in this run" if verdict else "NOT every claim holds in this run: see FAIL lines above")
    return exit_code(checks, args.quick)


if __name__ == "__main__":
    sys.exit(main())
