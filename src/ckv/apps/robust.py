"""``make robust``: phase-robust compression at equal KV memory (docs/robustness.md), on the two failure mechanisms' tasks.

Two CPU tasks on make demo's model, optimiser and budget (docs/robustness.md): **split** (straddling: make demo's
split records, ``conf/experiment/robust_split.yaml``) and **dense** (crowding: four single-token records per
8-token window, ``conf/experiment/robust_dense.yaml``). On each: the baseline gate, every fix that exists, and the
full-attention control, two seeds each, the same budget for all, each trained with ``train.py`` and evaluated with
``eval.py``'s position-matched lookup (``ckv.apps.demo``'s machinery); then one table (mean, per-phase accuracy,
worst phase, phase and residue gaps with intervals and noise floors, KV bytes per token, parameters, training time)
and one plot of worst-phase accuracy against KV bytes per token, under ``outputs/robust/``.

    python -m ckv.apps.robust                  # the full benchmark: 24 models (not yet run: docs/robustness.md)
    python -m ckv.apps.robust --quick          # one seed, a few steps per model: checks the pipeline only
    python -m ckv.apps.robust --task dense     # one task only

The benchmark makes no pass/fail claims yet; a failed command exits non-zero.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from ckv.apps.demo import DemoRun, Timer, demo_arguments, job_env, run_plan
from ckv.config import ModelConfig
from ckv.flops import parameter_count
from ckv.io.layout import MODEL_DIR
from ckv.io.results import write_json
from ckv.io.weights import load_config

BYTES_PER_ELEMENT = 2  # KV memory is reported for a bf16 cache
SEEDS = (0, 1)

# task -> (model name, attention option, role); the run folder is <out>/runs/<task>_<model>/seed=<seed>.
# Every model of a task shares the experiment's model, data, optimiser, budget and local window (4 tokens).
MODELS: dict[str, tuple[tuple[str, str, str], ...]] = {
    # straddling: every compressed model stores one entry per 4 tokens (S = 4)
    "split": (
        ("gate_w4s4", "w4s4", "baseline"),
        ("conv_w4s4", "w4s4_conv", "fix"),             # fix 2: causal depthwise mixing before pooling
        ("overlap_w8s4", "w8s4", "fix"),               # fix 1: W = 2S, offset-specific maps
        ("overlap_shared_w8s4", "w8s4_shared", "fix"),  # fix 1: W = 2S, maps shared across offsets
        ("v4_csa_w8s4", "deepseek_v4_csa", "fix"),     # fix 1: V4's two-series maps (local window 4, not 128)
        ("full", "full", "control"),
    ),
    # crowding: W = S = 8 (one entry per 8 tokens) and the paper's W = 8 / S = 4 (one per 4)
    "dense": (
        ("gate_w8s8", "w8s8", "baseline"),
        ("conv_w8s8", "w8s8_conv", "fix"),
        ("gate_w8s4", "w8s4", "baseline"),
        ("overlap_shared_w8s4", "w8s4_shared", "fix"),
        ("v4_csa_w8s4", "deepseek_v4_csa", "fix"),
        ("full", "full", "control"),
    ),
}
CONTROL_STRIDE = {"split": 4, "dense": 8}  # full attention has no stride: its phases are taken mod this


def plan(tasks: tuple[str, ...], seeds: tuple[int, ...]) -> tuple[DemoRun, ...]:
    """Every (task, model, seed) run, named ``<task>_<model>`` under ``<out>/runs``."""
    return tuple(
        DemoRun(f"robust_{task}", seed, role, (f"attention={option}",),
                (f"task.stride={CONTROL_STRIDE[task]}",) if role == "control" else (), name=f"{task}_{model}")
        for task in tasks for model, option, role in MODELS[task] for seed in seeds
    )


def kv_bytes_per_token(config: ModelConfig, bytes_per_element: int = BYTES_PER_ELEMENT) -> float:
    """KV-cache bytes a model adds per token over all layers, in the long-sequence limit: full attention keeps
    every key and value; compressed attention one entry (key, and value unless tied) per ``stride`` tokens. The
    local window and the pending hidden states are a constant, not a per-token cost."""
    a = config.attention
    per_entry = config.kv_heads * config.head_dim * (1 if a.tied_kv else 2) * bytes_per_element
    return config.n_layers * per_entry / (a.stride if a.compressed else 1)


def row(d: dict) -> dict:
    """One table row of a finished run: its results' headline, per-phase accuracy, memory and cost."""
    rep = d["results"]
    h = rep["headline"]
    cfg = load_config(Path(d["dir"]) / MODEL_DIR)
    residue = rep["residue"]["gap"]
    return {
        "task": d["run"].experiment.removeprefix("robust_"), "model": d["run"].name.split("_", 1)[1],
        "role": d["run"].role, "seed": d["run"].seed, "steps": d["steps"], "train_seconds": d["train_seconds"],
        "stride": rep["stride"], "mean": h["mean"], "per_phase": [g["accuracy"] for g in rep["phase"]["groups"]],
        "worst_phase": h["worst_phase"], "worst_phase_accuracy": h["worst_phase_accuracy"],
        "phase_gap": h["phase_gap"], "phase_gap_lower": h["phase_gap_lower"], "phase_gap_upper": h["phase_gap_upper"],
        "phase_p_value": h["phase_p_value"], "phase_noise_floor": h["phase_noise_floor"],
        "residue_gap": residue["value"], "residue_gap_lower": residue["lower"], "residue_gap_upper": residue["upper"],
        "residue_noise_floor": residue["noise_floor"],
        "kv_bytes_per_token": kv_bytes_per_token(cfg), "parameters": parameter_count(cfg),
        "results": str(d["dir"]),
    }


def table(rows: list[dict]) -> str:
    """The printed table, one line per run."""
    head = (f"{'task/model/seed':34s} {'KV B/tok':>8s} {'params':>8s} {'train s':>7s} {'mean %':>6s} {'worst %':>7s}  "
            f"{'per-phase accuracy % (phase = pos mod S)':42s} {'phase gap pp [95%]':>19s} {'floor':>5s} {'p':>6s} "
            f"{'residue gap pp [95%]':>20s} {'floor':>5s}")
    lines = [head]
    for r in rows:
        per = " / ".join(f"{100 * a:.0f}" for a in r["per_phase"]) + f" (S={r['stride']})"
        gap = f"{100 * r['phase_gap']:.1f} [{100 * r['phase_gap_lower']:.1f}, {100 * r['phase_gap_upper']:.1f}]"
        res = f"{100 * r['residue_gap']:.1f} [{100 * r['residue_gap_lower']:.1f}, {100 * r['residue_gap_upper']:.1f}]"
        lines.append(f"{r['task'] + '/' + r['model'] + '/' + str(r['seed']):34s} {r['kv_bytes_per_token']:8.0f} "
                     f"{r['parameters']:8d} {r['train_seconds']:7.0f} {100 * r['mean']:6.1f} "
                     f"{100 * r['worst_phase_accuracy']:7.1f}  {per:42s} {gap:>19s} "
                     f"{100 * r['phase_noise_floor']:5.1f} {r['phase_p_value']:6.4f} {res:>20s} "
                     f"{100 * r['residue_noise_floor']:5.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Worst-phase accuracy against KV bytes per token: one panel per task, one point per run, one colour per
    model (the x axis is logarithmic: full attention stores 4-8x more per token)."""
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows}, key=list(MODELS).index)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        models = [m for m, _, _ in MODELS[task] if any(r["task"] == task and r["model"] == m for r in rows)]
        for i, model in enumerate(models):
            pts = [r for r in rows if r["task"] == task and r["model"] == model]
            ax.scatter([r["kv_bytes_per_token"] for r in pts], [100 * r["worst_phase_accuracy"] for r in pts],
                       color=plt.cm.tab10(i), marker="o" if pts[0]["role"] != "control" else "s", label=model, s=40)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV-cache bytes per token (bf16, all layers)")
        ax.set_ylabel("worst-phase accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{task}: one point per seed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = demo_arguments(__doc__, "outputs/robust", "seed 0 only, a few steps per model: pipeline check only")
    ap.add_argument("--task", choices=("both", *MODELS), default="both", help="which task(s) to run")
    args = ap.parse_args(argv)
    runs = plan(tuple(MODELS) if args.task == "both" else (args.task,), SEEDS[:1] if args.quick else SEEDS)
    out = Path(args.out).resolve()
    clock = Timer()
    print(f"ckv robust -> {out}: {len(runs)} models, {args.workers} at a time"
          f"{' (quick: pipeline check, not the science)' if args.quick else ''}", flush=True)
    rows = [row(d) for d in run_plan(runs, out, args.quick, args.workers, job_env(), clock)]
    print("\n" + table(rows) + "\n")
    png = out / "worst_phase_vs_kv_bytes.png"
    plot(rows, png)
    write_json(out / "robust.json", {"quick": args.quick, "seconds": time.monotonic() - clock.start, "rows": rows,
                                     "plot": str(png)})
    if args.quick:
        print("quick mode: a few steps per model; the numbers above check the pipeline, not the science")
    print(f"[{clock}] plot: {png}; record: {out / 'robust.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
