"""``make demo-v4``: transformers' own DeepSeek-V4 next to ckv's V4 variant, ckv's W = S = 4 gate and full attention.

Four models, one budget, one evaluation (the study ``conf/study/demo_v4.yaml`` over ``ckv.apps.study``): each trains
on the demo's split-record lookup task with ``experiment=demo_gate_s4``'s data, optimiser, schedule, batch and
steps, and each is scored by ``eval.py task=demo_lookup`` (position-matched lookup, per-phase accuracy mod 4, gap
with its interval, permutation p, noise floor); then one table, one phase plot (``comparison_phases.png``) and, per
model, which mechanism the numbers show.

    python -m ckv.apps.demo_v4              # the full run (make demo-v4)
    python -m ckv.apps.demo_v4 --quick      # a few steps per model: checks the pipeline, not the science

The models:
  - ``v4_hf``: transformers' ``DeepseekV4ForCausalLM`` with 2 CSA layers and a 4-token sliding window
    (``conf/hf/deepseek_v4_demo.yaml``), trained by ``ckv.apps.train_hf_v4`` and loaded by ``eval.py model=hf``;
  - ``v4_csa``: ckv's ``attention=deepseek_v4_csa`` with the demo's 4-token local window (``demo_v4_csa``);
  - ``gate_s4``: ckv's W = S = 4 learned-gate compressor (``demo_gate_s4``, as in ``make demo``);
  - ``full``: the full-attention control (``demo_full``).
Without DeepSeek-V4 in the installed transformers the first model is left out, and the run says so.

A model shows a phase effect when its gap is significant and its interval clears the noise floor
(``ckv.eval.stats.gap_is_real``); it shows straddling when, in addition, its weakest phase is the boundary phase
S - 1 (a record whose first token sits there is split across two pooled entries). This task does not test
crowding. The run exits 1 only when the control has not learned (the comparison would mean nothing), or when a
command fails; ``--quick`` exits 0 whatever the numbers say.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional

from ckv.apps.study import study_arguments
from ckv.apps.study_config import Run, load_study
from ckv.apps.study_results import (
    CONTROL_LEARNED,
    Check,
    check_lines,
    control_learned,
    exit_code,
    gap_text,
    result_row,
    run_records,
    table,
)
from ckv.apps.study_run import run_plan, start
from ckv.apps.train_hf_v4 import compose_train_config, has_deepseek_v4
from ckv.data import lookup_format_for
from ckv.eval.plots import plot_phase_overlay
from ckv.eval.stats import gap_is_real
from ckv.eval.summary import results_file, summary_row
from ckv.io.results import read_json, write_csv, write_json

STUDY = load_study("demo_v4")
BASE = STUDY.params["base"]  # the experiment whose data, optimiser, schedule and budget every model trains with
STRIDE = STUDY.params["stride"]  # the compressed models' stride: the phase period of every model's evaluation


def hf_eval_overrides() -> tuple[str, ...]:
    """``eval.py`` overrides that score a transformers model on ``BASE``'s lookup layout at stride ``STRIDE``
    (a transformers folder carries no ckv data config, so the layout and the record counts are given)."""
    data = compose_train_config([f"experiment={BASE}"], "unused").data
    lookup, fmt = data.lookup, dataclasses.asdict(lookup_format_for(data))
    spec = ",".join(f"{k}:{'null' if v is None else v}" for k, v in fmt.items())
    return (
        "model=hf",
        f"model.stride={STRIDE}",
        f"task.n_records={lookup.n_records}",
        f"task.n_demos={lookup.n_queries - 1}",
        f"task.vocab.format={{{spec}}}",
    )


def v4_plan(with_hf: bool) -> tuple[Run, ...]:
    """The study's four models in table order: transformers' V4 (``role: v4_hf``) scored through
    ``hf_eval_overrides``, or left out without it."""
    return tuple(
        dataclasses.replace(r, eval_overrides=hf_eval_overrides()) if r.role == "v4_hf" else r
        for r in STUDY.runs
        if with_hf or r.role != "v4_hf"
    )


def mechanisms(done: list[dict]) -> list[str]:
    """One plain line per model: has it learned, does it show a phase effect, is its weakest phase the boundary."""
    lines = []
    for d in done:
        r = result_row(d)
        s = r["stride"]
        real = gap_is_real(r["phase_p_value"], r["phase_gap_lower"], r["phase_noise_floor"])
        straddling = real and r["worst_phase"] == s - 1
        lines.append(
            f"{d['run'].label}: learned {'yes' if control_learned(r) else 'no'} "
            f"(mean {100 * r['mean']:.1f}%); "
            f"phase effect {'yes' if real else 'no'} ({gap_text(r)}, p = {r['phase_p_value']:.4f}, "
            f"noise floor {100 * r['phase_noise_floor']:.1f} pp); straddling {'yes' if straddling else 'no'} "
            f"(weakest phase {r['worst_phase']}, boundary phase {s - 1})"
        )
    return lines


def control_check(done: list[dict]) -> list[Check]:
    """The one claim the comparison rests on: the full-attention control has learned the task."""
    checks = []
    for d in done:
        if d["run"].role == "control":
            r = result_row(d)
            checks.append(
                Check(
                    f"{d['run'].label}: full attention has learned (mean >= {100 * CONTROL_LEARNED:.0f}%)",
                    control_learned(r),
                    f"mean {100 * r['mean']:.1f}%",
                )
            )
    return checks


def write_summary(done: list[dict], out: Path) -> Path:
    """``summary.csv`` / ``summary.json`` (ckv.eval's summary rows) and the phase plot of every model, in plan
    order. Not ``eval.py summary=...``: that one collects ckv run folders only, and its stride x window grid has
    no window for a transformers model."""
    items = [(d["run"].label, read_json(results_file(d["dir"], STUDY.task))) for d in done]
    rows = [summary_row(label, r) for label, r in items]
    write_json(out / "summary.json", {"task": STUDY.task, "runs": rows})
    write_csv(out / "summary.csv", rows)
    return plot_phase_overlay([(label, r["results"]) for label, r in items], out / "comparison_phases.png")


def main(argv: Optional[list[str]] = None) -> int:
    ap = study_arguments(__doc__, STUDY.out)
    args = ap.parse_args(argv)
    with_hf = has_deepseek_v4()
    plan = v4_plan(with_hf)
    out = Path(args.out).resolve()
    if not with_hf:
        print(
            "the installed transformers has no DeepseekV4ForCausalLM (transformers >= 5.x ships it): "
            "transformers' V4 model is left out; running ckv's three models only",
            flush=True,
        )
    clock, env = start(STUDY, plan, out, args.quick, args.workers)
    done = run_plan(plan, out, args.quick, args.workers, env, clock, STUDY.task)
    plot = write_summary(done, out)
    findings, checks = mechanisms(done), control_check(done)
    print("\n" + table(done) + "\n")
    print(
        "what each model shows (phase effect: significant gap above the noise floor; straddling: and its weakest "
        "phase is the boundary phase S - 1; crowding is not tested by this task):"
    )
    for line in findings:
        print(f"  {line}")
    for line in check_lines(checks, ("PASS", "FAIL")):
        print(line)
    if args.quick:
        print("quick mode: a few steps per model say nothing about the mechanisms; only the pipeline was checked")
    record = out / f"{STUDY.record}.json"
    write_json(
        record,
        {
            "quick": args.quick,
            "transformers_v4": with_hf,
            "seconds": time.monotonic() - clock.start,
            "findings": findings,
            "checks": [c.__dict__ for c in checks],
            "runs": run_records(done, STUDY.task),
            "plots": {"phases": str(plot)},
        },
    )
    print(f"[{clock}] plot: {plot}; table: {out / 'summary.csv'}; record: {record}")
    return exit_code(checks, args.quick)


if __name__ == "__main__":
    sys.exit(main())
