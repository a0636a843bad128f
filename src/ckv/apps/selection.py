"""``make selection``: does DeepSeek-V4's top-k selection create phase sensitivity where dense V4 is flat?
(docs/selection.md)

One CPU task where selection binds (``conf/experiment/select_lookup.yaml``: make demo's model, optimiser and split
records, whose final query sees up to 15 compressed entries, of which top-2 selection keeps 2) and four models, two
seeds each, the same budget: V4's dense CSA (``deepseek_v4_csa``), its sparse form with the lightning indexer
trained by V4's recipe (``deepseek_v4_csa_sparse``: ``trainer.indexer.dense_steps``, dense training of the whole
model with the indexer learning alongside for the first ``DENSE_STEPS``, then sparse training), the same layer
with ORACLE selection from the first step
(``deepseek_v4_csa_oracle``: the top-2 of the layer's own dense attention mass, separating "the indexer picks
wrong" from "top-k itself loses the record") and the full-attention control. Each is trained with ``train.py``
and evaluated with ``eval.py``'s fixed-query position-matched lookup (``ckv.apps.demo``'s machinery); the
selecting models also with ``eval.py analysis=selection`` (how often each layer's selection at the query holds the
target record, per phase), and the dense models once more with oracle top-2 imposed at inference
(``analysis.oracle_topk``: the same weights, a perfect selector; rows ``dense+oracle``), which asks what top-k
costs a model that learned the task without it.
Then one table (mean, worst phase, per-phase accuracy, phase gap with interval, noise floor, equivalence verdict,
MDE, the indexer's recall at the end of training, the rate at which the target record is covered per phase) and one
plot, under ``outputs/selection/``.

    python -m ckv.apps.selection            # make selection (8 runs; time in the Makefile and docs/selection.md)
    python -m ckv.apps.selection --quick    # seed 0, a few steps per model: checks the pipeline only

The control check (full attention learned the task: mean >= 80% in every seed) is reported, not enforced: the run
exits 0 when every command succeeded and non-zero when one failed.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ckv.apps.demo import (
    QUICK_EVAL,
    TASK,
    Check,
    DemoRun,
    Timer,
    demo_arguments,
    job_env,
    pp,
    run_command,
    run_plan,
    write_study_record,
)
from ckv.eval.summary import flatness_fields
from ckv.io.results import read_json
from ckv.train.metrics import read_metrics

EXPERIMENT = "select_lookup"
SEEDS = (0, 1)
STRIDE = 4  # the compressed models' stride; full attention's phases are taken mod this
TOPK = (
    2  # entries each query keeps (of up to 15 at the final query): the two selecting models' attention.selection.topk
)
# base examples of the evaluation (x 8 shifts: 2,048 prompts, a multiple of 8**2), a quarter of make demo's 1,024:
# evaluation under 2 minutes a model on 2 shared cores; the MDE column states what that sample can resolve
N_BASE = 256
# the sparse model's dense stage (trainer.indexer.dense_steps): the first 3/4 of select_lookup's 1,200 steps (V4
# trains dense, then sparse); quick runs: 9 of QUICK_TRAIN's 12
DENSE_STEPS = 900
QUICK_DENSE_STEPS = 9
CONTROL_LEARNED = 0.80  # the control must reach this mean in every seed for the comparison to mean anything


@dataclass(frozen=True)
class Model:
    """One model of the study: its ``train.py`` overrides and role (``dense``, ``indexer``, ``oracle`` or
    ``control``)."""

    name: str
    option: str
    role: str

    @property
    def selects(self) -> bool:
        return self.role in ("indexer", "oracle")


MODELS = (
    Model("dense", "attention=deepseek_v4_csa", "dense"),
    Model("sparse", f"attention=deepseek_v4_csa_sparse attention.selection.topk={TOPK}", "indexer"),
    Model("oracle", f"attention=deepseek_v4_csa_oracle attention.selection.topk={TOPK}", "oracle"),
    Model("full", "attention=full", "control"),
)
MODEL_BY_NAME = {m.name: m for m in MODELS}


def plan(seeds: tuple[int, ...], quick: bool = False) -> tuple[DemoRun, ...]:
    """Every (model, seed) run, named after the model (``<out>/runs/<model>/seed=<seed>``), evaluated on ``N_BASE``
    base examples (quick: ``QUICK_EVAL``'s)."""
    return tuple(
        DemoRun(
            EXPERIMENT,
            seed,
            m.role,
            tuple(m.option.split())
            + (
                (f"trainer.indexer.dense_steps={QUICK_DENSE_STEPS if quick else DENSE_STEPS}",)
                if m.role == "indexer"
                else ()
            ),
            (() if quick else (f"task.n_base={N_BASE}",)) + ((f"task.stride={STRIDE}",) if m.role == "control" else ()),
            name=m.name,
        )
        for m in MODELS
        for seed in seeds
    )


def analyse(done: list[dict], out: Path, quick: bool, workers: int, env: dict, clock: Timer) -> dict[str, dict]:
    """``eval.py analysis=selection`` on the same prompts as the evaluation: on every selecting model, and on every
    dense model with oracle top-``TOPK`` imposed at inference (``analysis.oracle_topk``: the same weights, a perfect
    selector). Returns the results by run label."""
    todo = [d for d in done if MODEL_BY_NAME[d["run"].name].selects or d["run"].role == "dense"]

    def one(d: dict) -> tuple[str, dict]:
        run = d["run"]
        cmd = [sys.executable, "eval.py", f"model.path='{d['dir']}'", f"task={TASK}", "analysis=selection"]
        imposed = (f"analysis.oracle_topk={TOPK}",) if run.role == "dense" else ()
        run_command(
            [*cmd, *imposed, "progress=false", *(QUICK_EVAL if quick else (f"task.n_base={N_BASE}",))],
            out / "logs" / f"selection_{run.name}_seed{run.seed}.log",
            env,
        )
        res = read_json(Path(d["dir"]) / "eval" / TASK / "selection" / "selection.json")["analysis"]["results"]
        print(f"[{clock}] {run.label}: selection analysis done", flush=True)
        return run.label, res

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, todo))


def final_recall(run_dir: Path) -> Optional[float]:
    """The indexer's recall at the last step that logged it (``metrics.jsonl``), None without an indexer."""
    logged = [r["indexer_recall"] for r in read_metrics(run_dir) if r.get("indexer_recall") is not None]
    return logged[-1] if logged else None


def row(d: dict, selection: Optional[dict], imposed: bool = False) -> dict:
    """One table row: the run's headline, per-phase accuracy and flatness, and per phase the rate at which each
    layer's selection covers the target record (None for models without selection). ``imposed``: the row of the
    dense run with oracle top-``TOPK`` imposed at inference, whose statistics come from the selection analysis."""
    rep, run = (selection["report"] if imposed else d["results"]), d["run"]
    h = rep["headline"]
    return {
        "model": f"{run.name}+oracle" if imposed else run.name,
        "role": "imposed" if imposed else run.role,
        "seed": run.seed,
        "steps": d["steps"],
        "train_seconds": d["train_seconds"],
        "stride": rep["stride"],
        "mean": h["mean"],
        "per_phase": [g["accuracy"] for g in rep["phase"]["groups"]],
        "worst_phase": h["worst_phase"],
        "worst_phase_accuracy": h["worst_phase_accuracy"],
        "phase_gap": h["phase_gap"],
        "phase_gap_lower": h["phase_gap_lower"],
        "phase_gap_upper": h["phase_gap_upper"],
        "phase_p_value": h["phase_p_value"],
        "phase_noise_floor": h["phase_noise_floor"],
        **flatness_fields(rep, "phase"),
        "recall": final_recall(Path(d["dir"])),
        "covered": None if selection is None else [p["covered"] for p in selection["phases"]],  # phase -> layers
        "hit": None if selection is None else [p["hit"] for p in selection["phases"]],
        "selection_layers": None if selection is None else selection["layers"],
        "results": str(d["dir"]),
    }


def rows_of(done: list[dict], selections: dict[str, dict]) -> list[dict]:
    """The table's rows: every run (the dense runs without their imposed-oracle analysis), then each dense run with
    oracle selection imposed."""
    rows = [row(d, None if d["run"].role == "dense" else selections.get(d["run"].label)) for d in done]
    dense = [d for d in done if d["run"].role == "dense" and d["run"].label in selections]
    return rows + [row(d, selections[d["run"].label], imposed=True) for d in dense]


def covered_text(r: dict) -> str:
    """Per phase, the covered rate of each layer (``L0/L1``), or ``-`` without selection."""
    if r["covered"] is None:
        return "- (every visible entry)"
    return " | ".join("/".join(f"{100 * c:.0f}" for c in layers) for layers in r["covered"])


def table(rows: list[dict]) -> str:
    """The printed table, one line per run: accuracy (mean, worst phase, per phase), the phase gap with its
    interval, noise floor, permutation p, one-sided 95% upper bound (``<=``), minimum detectable gap (``MDE``,
    80% power) and verdict (gap / flat / undecided), the indexer's final recall, and per phase the percentage of
    prompts whose target record each layer's selection covers (``L0/L1``)."""
    lines = [
        f"{'model/seed':16s} {'steps':>5s} {'train s':>7s} {'mean %':>6s} {'worst %':>7s}  "
        f"{'per-phase accuracy % (phase = pos mod 4)':41s} {'phase gap pp [95%]':>19s} {'floor':>5s} {'p':>6s} "
        f"{'<= pp':>5s} {'MDE':>5s} {'verdict':>9s} {'recall':>6s}  target covered % per phase (L0/L1)"
    ]
    for r in rows:
        per = " / ".join(f"{100 * a:.1f}" for a in r["per_phase"])
        gap = f"{100 * r['phase_gap']:.1f} [{100 * r['phase_gap_lower']:.1f}, {100 * r['phase_gap_upper']:.1f}]"
        recall = "-" if r["recall"] is None else f"{r['recall']:.2f}"
        lines.append(
            f"{r['model'] + '/' + str(r['seed']):16s} {r['steps']:5d} {r['train_seconds']:7.0f} {100 * r['mean']:6.1f} "
            f"{100 * r['worst_phase_accuracy']:7.1f}  {per:41s} {gap:>19s} {100 * r['phase_noise_floor']:5.1f} "
            f"{r['phase_p_value']:6.4f} {pp(r['phase_upper_one_sided']):>5s} {pp(r['phase_mde']):>5s} "
            f"{str(r['phase_verdict']):>9s} {recall:>6s}  {covered_text(r)}"
        )
    return "\n".join(lines)


def checks(rows: list[dict]) -> list[Check]:
    """The control check (full attention learned the task in every seed) and, per selecting model and seed, its
    phase verdict beside the dense model's of the same seed."""
    out = []
    control = [r for r in rows if r["role"] == "control"]
    if control:
        out.append(
            Check(
                f"full attention learned the task (mean >= {100 * CONTROL_LEARNED:.0f}% in every seed)",
                all(r["mean"] >= CONTROL_LEARNED for r in control),
                "; ".join(f"seed {r['seed']}: {100 * r['mean']:.1f}%" for r in control),
            )
        )
    dense = {r["seed"]: r for r in rows if r["role"] == "dense"}
    for r in rows:
        if r["covered"] is None or r["seed"] not in dense:
            continue
        d = dense[r["seed"]]
        out.append(
            Check(
                f"{r['model']}/seed={r['seed']}: flat (the equivalence test bounds its phase gap under "
                f"{pp(r['phase_margin'])} pp)",
                r["phase_verdict"] == "flat",
                f"{r['phase_verdict']}: gap {100 * r['phase_gap']:.1f} pp [{100 * r['phase_gap_lower']:.1f}, "
                f"{100 * r['phase_gap_upper']:.1f}], floor {100 * r['phase_noise_floor']:.1f}, "
                f"p = {r['phase_p_value']:.4f}; dense: {d['phase_verdict']}, gap {100 * d['phase_gap']:.1f} pp "
                f"[{100 * d['phase_gap_lower']:.1f}, {100 * d['phase_gap_upper']:.1f}], mean "
                f"{100 * r['mean']:.1f}% vs dense {100 * d['mean']:.1f}%",
            )
        )
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Left: accuracy per phase, one line per run (colour per model, seed 0 solid, seed 1 dashed). Right: per
    phase, the share of prompts whose target record the last layer's selection covers (selecting models)."""
    import matplotlib.pyplot as plt

    fig, (acc, cov) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {name: plt.cm.tab10(i) for i, name in enumerate([*MODEL_BY_NAME, "dense+oracle"])}
    for r in rows:
        style = dict(color=colours[r["model"]], ls="-" if r["seed"] == min(SEEDS) else "--", marker="o")
        label = f"{r['model']}/seed={r['seed']}"
        phases = range(len(r["per_phase"]))
        acc.plot(phases, [100 * a for a in r["per_phase"]], label=label, **style)
        if r["covered"] is not None:
            cov.plot(phases, [100 * layers[-1] for layers in r["covered"]], label=label, **style)
    for ax, what in ((acc, "accuracy (%)"), (cov, "target record covered by the last layer's top-k (%)")):
        ax.set_xlabel(f"phase of the target record (position mod {STRIDE})")
        ax.set_ylabel(what)
        ax.set_ylim(-2, 102)
        ax.set_xticks(range(STRIDE))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    acc.set_title("fixed-query lookup, per phase")
    cov.set_title("selection at the query (analysis=selection)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    args = demo_arguments(__doc__, "outputs/selection", "seed 0 only, a few steps per model: pipeline check only")
    args = args.parse_args(argv)
    out = Path(args.out).resolve()
    runs = plan(SEEDS[:1] if args.quick else SEEDS, args.quick)
    clock, env = Timer(), job_env()
    print(
        f"ckv selection -> {out}: {len(runs)} models, {args.workers} at a time"
        f"{' (quick: pipeline check, not the science)' if args.quick else ''}",
        flush=True,
    )
    done = run_plan(runs, out, args.quick, args.workers, env, clock)
    selections = analyse(done, out, args.quick, args.workers, env, clock)
    rows = rows_of(done, selections)
    print("\n" + table(rows) + "\n")
    found = checks(rows)
    for c in found:
        print(f"  [{'yes' if c.passed else 'no'}] {c.claim}: {c.detail}")
    png = out / "selection.png"
    plot(rows, png)
    write_study_record(
        out,
        "selection",
        args.quick,
        clock,
        png,
        {
            "rows": rows,
            "checks": [c.__dict__ for c in found],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
