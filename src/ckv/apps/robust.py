"""``make robust``: phase-robust compression at equal KV memory (docs/robustness.md), on the two failure mechanisms'
tasks.

Two CPU tasks on make demo's model, optimiser and budget (docs/robustness.md): **split** (straddling: make demo's
split records, ``conf/experiment/robust_split.yaml``) and **dense** (crowding: four records ``K(k) V(k, v)`` per
8-token window, ``conf/experiment/robust_dense.yaml``). On each: the task's baseline gate, DeepSeek-V4's compressor
and the full-attention control (the core set; every other fix of ``MODELS`` on request), seed 0 (more with
``--seeds``), the same budget for all, each trained with ``train.py`` and evaluated with ``eval.py``'s
position-matched lookup: the study ``conf/study/robust.yaml`` (``--confirm``: ``robust_confirm.yaml``,
``--ablation``: ``robust_ablation.yaml``) over ``ckv.apps.study``; then one table (mean, per-phase
accuracy, worst phase, phase and residue gaps with intervals and noise floors, KV bytes per token, parameters,
training time), the success criteria per fix (``criteria``), the crowding analysis of the dense task's compressed
models (``analyse``: gate concentration beside knock-outs), and one plot of worst-phase accuracy against KV bytes
per token, under ``outputs/robust/``.

    python -m ckv.apps.robust                  # make robust: the core set, seed 0 (6 runs; docs/robustness.md)
    python -m ckv.apps.robust --seeds 0 1      # the same on two seeds (12 runs, twice as long)
    python -m ckv.apps.robust --all            # every model of MODELS
    python -m ckv.apps.robust --add conv_w4s4  # the core set and token mixing (finished runs reused)
    python -m ckv.apps.robust --quick          # one seed, a few steps per model: checks the pipeline only
    python -m ckv.apps.robust --task dense     # one task only
    python -m ckv.apps.robust --replot         # redraw the plot from outputs/robust/robust.json

The criteria are reported (MET / not met), not enforced: the run exits 0 when every command succeeded and
non-zero when one failed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ckv import flops
from ckv.apps.robust_confirm import CONFIRM, CONFIRM_MODELS, CONFIRM_SEEDS, CONFIRM_TASK, confirm_verdicts
from ckv.apps.robust_crowding import analyse, analysed_tasks, crowding_lines
from ckv.apps.study import study_arguments
from ckv.apps.study_config import Run, compared_stride, load_study
from ckv.apps.study_results import (
    COMPACT_PHASE_COLUMNS,
    CONTROL_LEARNED,
    Check,
    Column,
    check_lines,
    control_learned,
    every_seed,
    gap_columns,
    gap_text,
    per_phase_column,
    pp,
    result_row,
    write_study_record,
    write_table,
)
from ckv.apps.study_run import run_plan, start
from ckv.eval.plots import plot_worst_phase_vs_kv_bytes
from ckv.flops import parameter_count
from ckv.io.layout import MODEL_DIR, read_run_config
from ckv.io.results import read_json
from ckv.io.weights import load_config

BYTES_PER_ELEMENT = 2  # KV memory is reported for a bf16 cache (ckv.flops.kv_bytes_per_token)
STUDY, ABLATION = load_study("robust"), load_study("robust_ablation")


@dataclass(frozen=True)
class Model:
    """One model of a task (conf/study/robust.yaml): its ``train.py`` overrides (an attention option plus option
    groups, e.g. ``attention=w4s4 attention/mixing=conv``), its role, the equal-memory baseline a fix is compared
    with, and whether ``make robust`` trains it (``core``) or only ``--all``, ``--add`` and ``--models`` do."""

    name: str
    option: str  # space-separated train.py overrides
    role: str  # "baseline", "fix" or "control"
    baseline: Optional[str] = None  # a fix's equal-memory baseline (same entries per token, heads, local window)
    core: bool = False
    phase_of: Optional[str] = None  # the control: the model whose stride its phases are read mod


TASKS: dict[str, dict] = STUDY.params["tasks"]
# task -> models; the run folder is <out>/runs/<task>_<model>/seed=<seed>
MODELS: dict[str, tuple[Model, ...]] = {
    task: tuple(
        Model(m["name"], m["train"], m["role"], m.get("baseline"), m.get("core", False), m.get("phase_of"))
        for m in spec["models"]
    )
    for task, spec in TASKS.items()
}
SEEDS, ABLATION_SEEDS = STUDY.seeds, ABLATION.seeds
LADDER = tuple(STUDY.params["ladder"])  # the ablation ladder's steps, the W8/S4 gate first
LADDER_STEPS = LADDER[1:]
MIN_GAIN, GOAL_MARGIN = STUDY.criteria["min_gain"], STUDY.criteria["goal_margin"]
MODEL_BY_RUN = {f"{task}_{m.name}": m for task, models in MODELS.items() for m in models}


def plan(
    tasks: tuple[str, ...],
    seeds: tuple[int, ...],
    everything: bool = False,
    add: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
) -> tuple[Run, ...]:
    """Every (task, model, seed) run, named ``<task>_<model>`` under ``<out>/runs``: the core models and those
    named in ``add`` with their baselines (in every task that has them), or with ``everything`` every model, or
    with ``only`` exactly the models it names (in every task that has them, in its order)."""
    known = {m.name for models in MODELS.values() for m in models}
    for flag, names in (("--add", add), ("--models", only)):
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(
                f"{flag} {' '.join(unknown)}: not a model of {', '.join(MODELS)} (choose from {sorted(known)})"
            )
    add = tuple(add) + tuple(m.baseline for models in MODELS.values() for m in models if m.name in add and m.baseline)
    return tuple(
        Run(
            TASKS[task]["experiment"],
            seed,
            m.role,
            tuple(m.option.split()),
            () if m.phase_of is None else (f"task.stride={phase_stride(task, m)}",),
            name=f"{task}_{m.name}",
        )
        for task in tasks
        for m in sorted(MODELS[task], key=lambda m: only.index(m.name) if m.name in only else -1)
        if (m.name in only if only else m.core or everything or m.name in add)
        for seed in seeds
    )


def phase_stride(task: str, model: Model) -> int:
    """The stride ``model`` (a control) of ``task`` reads its phases mod: that of its ``phase_of`` model
    (``ckv.apps.study_config.compared_stride``)."""
    runs = [Run(TASKS[task]["experiment"], 0, m.role, tuple(m.option.split()), name=m.name) for m in MODELS[task]]
    return compared_stride(model.phase_of, runs, f"conf/study/robust.yaml params.tasks.{task} {model.name}")


def resolve_seeds(seeds: Optional[list[int]], confirm: bool, ablation: bool, quick: bool) -> tuple[int, ...]:
    """The seeds of a command: ``--seeds`` as given, else the confirmation's, the ablation's or ``SEEDS``; the first
    only with ``--quick``. ValueError (one line) for repeated or negative seeds, or ``--seeds`` with ``--confirm``."""
    if confirm and seeds is not None:
        raise ValueError("--confirm trains the seeds its committed criteria name; --seeds cannot change them")
    chosen = tuple(seeds or (CONFIRM_SEEDS if confirm else ABLATION_SEEDS if ablation else SEEDS))
    if len(set(chosen)) != len(chosen) or min(chosen) < 0:
        raise ValueError(f"--seeds {' '.join(map(str, chosen))}: distinct seeds >= 0, please")
    return chosen[:1] if quick else chosen


def row(d: dict) -> dict:
    """One table row of a finished run: its task, model and baseline, the study's one row of its results
    (``ckv.apps.study_results.result_row``), and its memory and cost."""
    cfg = load_config(Path(d["dir"]) / MODEL_DIR)
    task_tokens = read_run_config(d["dir"])["data"]["seq_len"]  # the task's longest example
    task, model = d["run"].name.split("_", 1)
    return {
        "task": task,
        "model": model,
        "baseline": MODEL_BY_RUN[d["run"].name].baseline,
        **result_row(d),
        "kv_bytes_per_token": flops.kv_bytes_per_token(cfg, None, BYTES_PER_ELEMENT),
        "task_tokens": task_tokens,
        "kv_bytes_per_token_task": flops.kv_bytes_per_token(cfg, task_tokens, BYTES_PER_ELEMENT),
        "parameters": parameter_count(cfg),
    }


COLUMNS = (
    Column("task/model/seed", lambda r: f"{r['task']}/{r['model']}/{r['seed']}", 34, "<", ""),
    Column("KV B/tok", lambda r: f"{r['kv_bytes_per_token']:.0f}", 8),
    Column("at T", lambda r: f"{r['kv_bytes_per_token_task']:5.0f}@{r['task_tokens']:<3d}", 9),
    Column("params", lambda r: f"{r['parameters']:d}", 8),
    Column("train s", lambda r: f"{r['train_seconds']:.0f}", 7),
    Column("mean %", lambda r: f"{100 * r['mean']:.1f}", 6),
    Column("worst %", lambda r: f"{100 * r['worst_phase_accuracy']:.1f}", 7),
    per_phase_column(42, 0, sep=" "),
    *COMPACT_PHASE_COLUMNS,
    *gap_columns("residue", "gap floor mde", ("residue gap pp [95%]", "floor", "MDE"), (20, 5, 5)),
)


def table(rows: list[dict]) -> str:
    """The printed table (``ckv.apps.study_results.write_table``), one line per run: memory (KV bytes per token in the
    long-sequence limit and at the task's own length T: everything the decode cache holds after T tokens over T,
    ``ckv.flops.kv_bytes_per_token``) and cost, accuracy, the phase gap with its interval, noise floor, permutation
    p, one-sided 95% upper bound (``<=``), minimum detectable gap (``MDE``, 80% power) and verdict (gap / flat /
    undecided at the equivalence margin), and the residue gap with its interval, noise floor and minimum
    detectable gap."""
    return write_table(rows, COLUMNS)


def criteria(rows: list[dict]) -> list[Check]:
    """The study's success criteria, per fix, over its seeds (a criterion needs every seed of the fix, of its
    baseline and of the control): the minimum (worst phase raised by >= MIN_GAIN over the equal-memory baseline
    of the same seed) and the goal (flat: the equivalence test bounds the phase gap under its margin,
    ``ckv.eval.flatness.gap_verdict``; and worst phase within GOAL_MARGIN of full attention's of the same seed; not
    judged where the control has not learned the task). A fix whose baseline or control is missing from ``rows``
    in some seed gets one ``not judged`` check naming them."""
    by = {(r["task"], r["model"], r["seed"]): r for r in rows}
    first_seed = min((r["seed"] for r in rows), default=0)
    checks = []
    for r0 in rows:
        if r0["role"] != "fix" or r0["seed"] != first_seed:
            continue
        task, model = r0["task"], r0["model"]
        seeds = sorted(r["seed"] for r in rows if r["task"] == task and r["model"] == model)
        pairs = [(by[(task, model, s)], by.get((task, r0["baseline"], s)), by.get((task, "full", s))) for s in seeds]
        if any(b is None or c is None for _, b, c in pairs):
            missing = [name for name, i in ((r0["baseline"], 1), ("full", 2)) if any(p[i] is None for p in pairs)]
            checks.append(
                Check(
                    f"{task}/{model}: not judged: {' and '.join(missing)} not among this command's runs in every seed",
                    False,
                    f"seeds {', '.join(map(str, seeds))}; add {' '.join(missing)} to --models (or use --add)",
                )
            )
            continue
        gains = [f["worst_phase_accuracy"] - b["worst_phase_accuracy"] for f, b, _ in pairs]
        checks.append(
            every_seed(
                f"{task}/{model}: worst phase >= {100 * MIN_GAIN:.0f} pp above {r0['baseline']} in every seed",
                seeds,
                [g >= MIN_GAIN for g in gains],
                [
                    f"{100 * f['worst_phase_accuracy']:.1f}% vs {100 * b['worst_phase_accuracy']:.1f}% "
                    f"({100 * g:+.1f} pp)"
                    for (f, b, _), g in zip(pairs, gains)
                ],
            )
        )
        flat = [f["phase_verdict"] == "flat" for f, _, _ in pairs]
        near = [f["worst_phase_accuracy"] >= c["worst_phase_accuracy"] - GOAL_MARGIN for f, _, c in pairs]
        unlearned = [(s, c["mean"]) for s, (_, _, c) in zip(seeds, pairs) if not control_learned(c)]
        if unlearned:  # "as good as full attention" means nothing against a control that has not learned the task
            checks.append(
                Check(
                    f"{task}/{model}: goal not judged: the full-attention control has not learned the task "
                    f"(mean < {100 * CONTROL_LEARNED:.0f}%)",
                    False,
                    "; ".join(f"seed {s}: control mean {100 * m:.1f}%" for s, m in unlearned),
                )
            )
            continue
        checks.append(
            every_seed(
                f"{task}/{model}: flat (phase gap's one-sided 95% upper bound under {pp(r0['phase_margin'])} pp) and "
                f"worst phase within {100 * GOAL_MARGIN:.0f} pp of full attention's in every seed",
                seeds,
                [fl and ne for fl, ne in zip(flat, near)],
                [
                    f"{f['phase_verdict']}, {gap_text(f)} <= {pp(f['phase_upper_one_sided'])} p = "
                    f"{f['phase_p_value']:.4f} floor {100 * f['phase_noise_floor']:.1f} MDE {pp(f['phase_mde'])}, "
                    f"worst {100 * f['worst_phase_accuracy']:.1f}% vs full {100 * c['worst_phase_accuracy']:.1f}%"
                    for f, _, c in pairs
                ],
            )
        )
    return checks


def ladder_lines(rows: list[dict]) -> list[str]:
    """The ablation ladder (``LADDER``) on the split task, one line per step and seed: what the step changes (its
    YAML's name), worst phase, phase gap with interval, one-sided upper bound, MDE and verdict, KV bytes."""
    by = {(r["model"], r["seed"]): r for r in rows if r["task"] == "split"}
    lines = []
    for step in LADDER:
        for seed in sorted(s for m, s in by if m == step):
            r = by[(step, seed)]
            lines.append(
                f"{step:22s} seed {seed}: mean {100 * r['mean']:5.1f}%, worst {100 * r['worst_phase_accuracy']:5.1f}%, "
                f"{gap_text(r)} <= {pp(r['phase_upper_one_sided'])} MDE {pp(r['phase_mde'])} "
                f"{r['phase_verdict']}; KV {r['kv_bytes_per_token']:.0f} B/token ({r['kv_bytes_per_token_task']:.0f} "
                f"at T = {r['task_tokens']})"
            )
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = study_arguments(__doc__, STUDY.out, "the first seed only, a few steps per model: pipeline check only")
    ap.add_argument("--task", choices=("both", *MODELS), default="both", help="which task(s) to run")
    ap.add_argument("--all", action="store_true", help="every model of MODELS, not only the core set")
    ap.add_argument(
        "--add",
        nargs="+",
        default=(),
        metavar="MODEL",
        help="models outside the core set to train as well (finished runs in --out are reused: their "
        "'train s' is then the seconds of the resume check, not of their training)",
    )
    ap.add_argument(
        "--models",
        nargs="+",
        default=(),
        metavar="MODEL",
        help="exactly these models (in every task of --task that has them), not the core set",
    )
    ap.add_argument(
        "--ablation",
        action="store_true",
        help="the ablation ladder on the split task (W8/S4 gate to deepseek_v4_csa, one change per step)",
    )
    ap.add_argument(
        "--confirm",
        action="store_true",
        help=f"the confirmation: {', '.join(CONFIRM_MODELS)} on the split task, seeds "
        f"{', '.join(map(str, CONFIRM_SEEDS))} (default --out {CONFIRM.out}), and its verdicts",
    )
    ap.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        metavar="SEED",
        help=f"seeds of every run (default: {' '.join(map(str, SEEDS))}; with --ablation "
        f"{' '.join(map(str, ABLATION_SEEDS))}; --confirm's are fixed)",
    )
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from --out's robust.json")
    args = ap.parse_args(argv)
    study = CONFIRM if args.confirm else ABLATION if args.ablation else STUDY
    if args.out == ap.get_default("out"):
        args.out = study.out
    out = Path(args.out).resolve()
    png = out / "worst_phase_vs_kv_bytes.png"
    if args.replot:
        plot_worst_phase_vs_kv_bytes(read_json(out / f"{study.record}.json")["rows"], MODELS, png)
        print(f"plot: {png}")
        return 0
    try:
        if args.confirm or args.ablation:
            if args.task == "dense" or args.models or args.all or args.add:
                raise ValueError("--confirm and --ablation run their own models on the split task")
        seeds = resolve_seeds(args.seeds, args.confirm, args.ablation, args.quick)
        runs = plan(
            (CONFIRM_TASK,)
            if args.confirm or args.ablation
            else tuple(MODELS)
            if args.task == "both"
            else (args.task,),
            seeds,
            everything=args.all,
            add=tuple(args.add),
            only=CONFIRM_MODELS if args.confirm else LADDER if args.ablation else tuple(args.models),
        )
    except ValueError as e:
        ap.error(str(e))
    clock, env = start(study, runs, out, args.quick, args.workers)
    done = run_plan(runs, out, args.quick, args.workers, env, clock, study.task)
    rows = [row(d) for d in done]
    analyses = analyse(done, STUDY, out, args.quick, args.workers, env, clock)
    print("\n" + table(rows) + "\n")
    checks = criteria(rows)
    for line in check_lines(checks, ("MET", "not met")):
        print(line)
    verdicts = confirm_verdicts(rows) if args.confirm else []
    if verdicts:
        print("\nconfirmation (criteria committed in docs/robustness.md, 'Confirmation: criteria'):")
        for line in check_lines(verdicts, ("MET", "not met")):
            print(line)
    ladder = ladder_lines(rows)
    if ladder:
        print("\nablation ladder (split task; each step adds one change to the previous one):")
        for line in ladder:
            print(f"  {line}")
    if analyses:
        tasks = ", ".join(analysed_tasks(STUDY))
        print(f"\ncrowding analysis (eval.py analysis=joint on each compressed model of {tasks}):")
        for line in crowding_lines(analyses):
            print(f"  {line}")
    plot_worst_phase_vs_kv_bytes(rows, MODELS, png)
    write_study_record(
        out,
        study.record,
        args.quick,
        clock,
        png,
        {
            "rows": rows,
            "criteria": [c.__dict__ for c in checks],
            "confirmation": [c.__dict__ for c in verdicts],
            "crowding": analyses,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
