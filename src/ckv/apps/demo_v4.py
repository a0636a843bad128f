"""``make demo-v4``: transformers' own DeepSeek-V4 next to ckv's V4 variant, ckv's W = S = 4 gate and full attention.

Four models, one budget, one evaluation (``make demo``'s machinery in ``ckv.apps.demo``): each trains on the demo's
split-record lookup task with ``experiment=demo_gate_s4``'s data, optimiser, schedule, batch and steps, and each is
scored by ``eval.py task=demo_lookup`` (position-matched lookup, per-phase accuracy mod 4, gap with its interval,
permutation p, noise floor); then one table, one phase plot (``comparison_phases.png``) and, per model, which
mechanism the numbers show.

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

from ckv.apps.demo import (
    TASK,
    Check,
    DemoRun,
    Timer,
    demo_arguments,
    exit_code,
    job_env,
    run_plan,
    run_records,
    table,
)
from ckv.apps.train_hf_v4 import compose_train_config, has_deepseek_v4
from ckv.data import lookup_format_for
from ckv.eval.plots import plot_phase_overlay
from ckv.eval.stats import gap_is_real
from ckv.eval.summary import results_file, summary_row
from ckv.io.results import read_json, write_csv, write_json

BASE = "demo_gate_s4"  # the experiment whose data, optimiser, schedule and budget every model trains with
STRIDE = 4  # the compressed models' stride: the phase period of every model's evaluation


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


def v4_plan(with_hf: bool) -> tuple[DemoRun, ...]:
    """The four models (three without transformers' V4), in table order."""
    hf = DemoRun(
        BASE, 0, "v4_hf", eval_overrides=hf_eval_overrides(), name="demo_v4_hf", entry=("-m", "ckv.apps.train_hf_v4")
    )
    ckv_runs = (
        DemoRun("demo_v4_csa", 0, "v4_ckv"),
        DemoRun("demo_gate_s4", 0, "gate"),
        # the control has no stride: group its targets by the compressed models' phase (mod 4)
        DemoRun("demo_full", 0, "control", eval_overrides=(f"task.stride={STRIDE}",)),
    )
    return ((hf,) if with_hf else ()) + ckv_runs


def mechanisms(done: list[dict]) -> list[str]:
    """One plain line per model: has it learned, does it show a phase effect, is its weakest phase the boundary."""
    lines = []
    for d in done:
        rep = d["results"]
        h, s = rep["headline"], rep["stride"]
        real = gap_is_real(h["phase_p_value"], h["phase_gap_lower"], h["phase_noise_floor"])
        straddling = real and h["worst_phase"] == s - 1
        lines.append(
            f"{d['run'].label}: learned {'yes' if h['mean'] >= 0.40 else 'no'} (mean {100 * h['mean']:.1f}%); "
            f"phase effect {'yes' if real else 'no'} (gap {100 * h['phase_gap']:.1f} pp "
            f"[{100 * h['phase_gap_lower']:.1f}, {100 * h['phase_gap_upper']:.1f}], p = {h['phase_p_value']:.4f}, "
            f"noise floor {100 * h['phase_noise_floor']:.1f} pp); straddling {'yes' if straddling else 'no'} "
            f"(weakest phase {h['worst_phase']}, boundary phase {s - 1})"
        )
    return lines


def control_check(done: list[dict]) -> list[Check]:
    """The one claim the comparison rests on: the full-attention control has learned the task."""
    checks = []
    for d in done:
        if d["run"].role == "control":
            mean = d["results"]["headline"]["mean"]
            checks.append(
                Check(
                    f"{d['run'].label}: full attention has learned (mean >= 40%)",
                    mean >= 0.40,
                    f"mean {100 * mean:.1f}%",
                )
            )
    return checks


def write_summary(done: list[dict], out: Path) -> Path:
    """``summary.csv`` / ``summary.json`` (ckv.eval's summary rows) and the phase plot of every model, in plan
    order. Not ``eval.py summary=...``: that one collects ckv run folders only, and its stride x window grid has
    no window for a transformers model."""
    items = [(d["run"].label, read_json(results_file(d["dir"], TASK))) for d in done]
    rows = [summary_row(label, r) for label, r in items]
    write_json(out / "summary.json", {"task": TASK, "runs": rows})
    write_csv(out / "summary.csv", rows)
    return plot_phase_overlay([(label, r["results"]) for label, r in items], out / "comparison_phases.png")


def main(argv: Optional[list[str]] = None) -> int:
    ap = demo_arguments(__doc__, "outputs/demo-v4")
    args = ap.parse_args(argv)
    with_hf = has_deepseek_v4()
    plan = v4_plan(with_hf)
    out = Path(args.out).resolve()
    clock = Timer()
    if not with_hf:
        print(
            "the installed transformers has no DeepseekV4ForCausalLM (transformers >= 5.x ships it): "
            "transformers' V4 model is left out; running ckv's three models only",
            flush=True,
        )
    print(
        f"ckv demo-v4 -> {out}: {len(plan)} models, {args.workers} at a time"
        f"{' (quick: pipeline check, not the science)' if args.quick else ''}",
        flush=True,
    )
    done = run_plan(plan, out, args.quick, args.workers, job_env(), clock)
    plot = write_summary(done, out)
    findings, checks = mechanisms(done), control_check(done)
    print("\n" + table(done) + "\n")
    print(
        "what each model shows (phase effect: significant gap above the noise floor; straddling: and its weakest "
        "phase is the boundary phase S - 1; crowding is not tested by this task):"
    )
    for line in findings:
        print(f"  {line}")
    for c in checks:
        print(f"  [{'PASS' if c.passed else 'FAIL'}] {c.claim}: {c.detail}")
    if args.quick:
        print("quick mode: a few steps per model say nothing about the mechanisms; only the pipeline was checked")
    write_json(
        out / "demo_v4.json",
        {
            "quick": args.quick,
            "transformers_v4": with_hf,
            "seconds": time.monotonic() - clock.start,
            "findings": findings,
            "checks": [c.__dict__ for c in checks],
            "runs": run_records(done),
            "plots": {"phases": str(plot)},
        },
    )
    print(f"[{clock}] plot: {plot}; table: {out / 'summary.csv'}; record: {out / 'demo_v4.json'}")
    return exit_code(checks, args.quick)


if __name__ == "__main__":
    sys.exit(main())
