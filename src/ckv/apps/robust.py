"""``make robust``: phase-robust compression at equal KV memory (docs/robustness.md), on the two failure mechanisms'
tasks.

Two CPU tasks on make demo's model, optimiser and budget (docs/robustness.md): **split** (straddling: make demo's
split records, ``conf/experiment/robust_split.yaml``) and **dense** (crowding: four records ``K(k) V(k, v)`` per
8-token window, ``conf/experiment/robust_dense.yaml``). On each: the task's baseline gate, DeepSeek-V4's compressor
and the full-attention control (the core set; every other fix of ``MODELS`` on request), seed 0 (more with
``--seeds``), the same budget for all, each trained with ``train.py`` and evaluated with ``eval.py``'s
position-matched lookup (``ckv.apps.demo``'s machinery); then one table (mean, per-phase
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ckv import flops
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
from ckv.flops import parameter_count
from ckv.io.layout import MODEL_DIR, read_run_config
from ckv.io.results import read_json
from ckv.io.weights import load_config

BYTES_PER_ELEMENT = 2  # KV memory is reported for a bf16 cache (ckv.flops.kv_bytes_per_token)
SEEDS = (0,)  # make robust's default: the seed replication is make robust-confirm's (three fresh seeds)
ABLATION_SEEDS = (0, 1)


@dataclass(frozen=True)
class Model:
    """One model of a task: its ``train.py`` overrides (an attention option plus option groups, e.g.
    ``attention=w4s4 attention/mixing=conv``), its role, the equal-memory baseline a fix is compared with,
    and whether ``make robust`` trains it (``core``: each task's baseline, V4's compressor and the control, the six
    runs of one seed that fit 30 minutes of 2 cores at make demo's budget) or only ``--all``, ``--add`` and
    ``--models`` do."""

    name: str
    option: str  # space-separated train.py overrides
    role: str  # "baseline", "fix" or "control"
    baseline: Optional[str] = None  # a fix's equal-memory baseline (same entries per token, heads, local window)
    core: bool = True


# the ablation ladder (docs/robustness.md, "Ablation"): conf/attention/v4_<step>.yaml, each the previous step plus
# one change; the ladder starts at the W8/S4 gate (split's overlap_w8s4) and its last step is deepseek_v4_csa
LADDER_STEPS = (
    "ladder1_series",
    "ladder2_vector_gate",
    "ladder3_tied",
    "ladder4_postnorm",
    "ladder5_rope",
    "ladder6_sink",
    "ladder7_output_rope",
)
LADDER = ("overlap_w8s4", *LADDER_STEPS)
# the confirmation (docs/robustness.md, "Confirmation: criteria"): the finalists, their baseline and the control
# on seeds no earlier run used, judged by confirm_verdicts
CONFIRM_TASK = "split"
# run in this order: the baseline and the control first, so each finalist's verdict is complete after its seeds
CONFIRM_MODELS = ("gate_w4s4", "full", "v4_csa_w8s4", "v4_csa_conv_w8s4")
CONFIRM_FINALISTS = ("v4_csa_w8s4", "v4_csa_conv_w8s4")
CONFIRM_SEEDS = (100, 101, 102)
NONINFERIORITY_MARGIN = 0.05  # C2: every phase of a finalist within this of the control's mean (one-sided 5%)
Z_ONE_SIDED_95 = 1.6448536269514722
Z_TWO_SIDED_95 = 1.959963984540054

# task -> models; the run folder is <out>/runs/<task>_<model>/seed=<seed>. Every model of a task shares the
# experiment's model, data, optimiser, budget and local window (4 tokens; full attention, which takes none, drops it);
# only the attention option differs.
MODELS: dict[str, tuple[Model, ...]] = {
    # straddling: every compressed model stores one entry per 4 tokens (S = 4)
    "split": (
        Model("gate_w4s4", "attention=w4s4", "baseline"),
        # fix 2: causal mixing before pooling
        Model("conv_w4s4", "attention=w4s4 attention/mixing=conv", "fix", "gate_w4s4", core=False),
        # fix 3: layer grids shifted by 0, 2
        Model("stagger_w4s4", "attention=w4s4 attention/grid=stagger", "fix", "gate_w4s4", core=False),
        # fix 1: W = 2S, offset-specific maps; shared maps; V4's two series; V4's with mixing (fixes 1 + 2)
        Model("overlap_w8s4", "attention=w8s4", "fix", "gate_w4s4", core=False),
        Model("overlap_shared_w8s4", "attention=w8s4_shared", "fix", "gate_w4s4", core=False),
        Model("v4_csa_w8s4", "attention=deepseek_v4_csa", "fix", "gate_w4s4"),
        Model("v4_csa_conv_w8s4", "attention=deepseek_v4_csa attention/mixing=conv", "fix", "gate_w4s4", core=False),
        # fix 4 (a crowding fix)
        Model("entropy_w4s4", "attention=w4s4 trainer/gate_entropy=floor", "fix", "gate_w4s4", core=False),
        # the ablation ladder from the W8/S4 gate (overlap_w8s4) to V4's CSA, one change per step (LADDER)
        *(Model(name, f"attention=v4_{name}", "fix", "gate_w4s4", core=False) for name in LADDER_STEPS),
        Model("full", "attention=full ~attention.local_window", "control"),
    ),
    # crowding: the paper's W = 8 / S = 4 (every 2-token record fits one window) and W = S = 8 (one entry per 8)
    "dense": (
        Model("gate_w8s4", "attention=w8s4", "baseline"),
        # fix 4: gate-entropy floor
        Model("entropy_w8s4", "attention=w8s4 trainer/gate_entropy=floor", "fix", "gate_w8s4", core=False),
        Model("overlap_shared_w8s4", "attention=w8s4_shared", "fix", "gate_w8s4", core=False),
        Model("v4_csa_w8s4", "attention=deepseek_v4_csa", "fix", "gate_w8s4"),
        Model("v4_csa_conv_w8s4", "attention=deepseek_v4_csa attention/mixing=conv", "fix", "gate_w8s4", core=False),
        Model("gate_w8s8", "attention=w8s8", "baseline", core=False),
        Model(
            "conv_w8s8",
            "attention=w8s8 attention/mixing=conv attention.mixing.kernel=4",
            "fix",
            "gate_w8s8",
            core=False,
        ),
        Model("stagger_w8s8", "attention=w8s8 attention/grid=stagger", "fix", "gate_w8s8", core=False),
        # a crowding family: two KV heads on window grids offset by 0 and 4, W = S = 8: the W8/S4 1-KV-head gate's
        # long-sequence KV bytes per token (two entries per 8 tokens), its baseline
        Model("heads_w8s8_kv2", "attention=w8s8_kv2_heads", "fix", "gate_w8s4", core=False),
        Model("full", "attention=full ~attention.local_window", "control"),
    ),
}
CONTROL_STRIDE = {"split": 4, "dense": 8}  # full attention has no stride: its phases are taken mod this
ANALYSED_TASKS = ("dense",)  # the crowding analysis (gate concentration beside knock-outs) runs on these
# base examples of the crowding analysis: its knock-outs re-evaluate the task once per layer and KV head, and read
# phase effects of tens of pp, which need no flatness test (the benchmark's own evaluation uses the task's 1,024)
ANALYSIS_N_BASE = 512
MIN_GAIN = 0.30  # the minimum: a fix raises the worst phase by >= 30 pp over its baseline, in every seed
CONTROL_LEARNED = 0.40  # the goal is judged only against a control whose mean reaches this (make demo's bar)
GOAL_MARGIN = 0.05  # the goal: worst phase within 5 pp of full attention's and flat (equivalence), every seed


MODEL_BY_RUN = {f"{task}_{m.name}": m for task, models in MODELS.items() for m in models}


def plan(
    tasks: tuple[str, ...],
    seeds: tuple[int, ...],
    everything: bool = False,
    add: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
) -> tuple[DemoRun, ...]:
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
        DemoRun(
            f"robust_{task}",
            seed,
            m.role,
            tuple(m.option.split()),
            (f"task.stride={CONTROL_STRIDE[task]}",) if m.role == "control" else (),
            name=f"{task}_{m.name}",
        )
        for task in tasks
        for m in sorted(MODELS[task], key=lambda m: only.index(m.name) if m.name in only else -1)
        if (m.name in only if only else m.core or everything or m.name in add)
        for seed in seeds
    )


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
    """One table row of a finished run: its results' headline, per-phase accuracy, memory and cost."""
    rep = d["results"]
    h = rep["headline"]
    cfg = load_config(Path(d["dir"]) / MODEL_DIR)
    task_tokens = read_run_config(d["dir"])["data"]["seq_len"]  # the task's longest example
    residue = rep["residue"]["gap"]
    return {
        "task": d["run"].experiment.removeprefix("robust_"),
        "model": d["run"].name.split("_", 1)[1],
        "role": d["run"].role,
        "baseline": MODEL_BY_RUN[d["run"].name].baseline,
        "seed": d["run"].seed,
        "steps": d["steps"],
        "train_seconds": d["train_seconds"],
        "stride": rep["stride"],
        "mean": h["mean"],
        "per_phase": [g["accuracy"] for g in rep["phase"]["groups"]],
        "per_phase_lower": [g["lower"] for g in rep["phase"]["groups"]],
        "per_phase_upper": [g["upper"] for g in rep["phase"]["groups"]],
        "mean_lower": rep["phase"]["mean"]["lower"],
        "mean_upper": rep["phase"]["mean"]["upper"],
        "worst_phase": h["worst_phase"],
        "worst_phase_accuracy": h["worst_phase_accuracy"],
        "phase_gap": h["phase_gap"],
        "phase_gap_lower": h["phase_gap_lower"],
        "phase_gap_upper": h["phase_gap_upper"],
        "phase_p_value": h["phase_p_value"],
        "phase_noise_floor": h["phase_noise_floor"],
        "residue_gap": residue["value"],
        "residue_gap_lower": residue["lower"],
        "residue_gap_upper": residue["upper"],
        "residue_noise_floor": residue["noise_floor"],
        **flatness_fields(rep, "phase"),
        **flatness_fields(rep, "residue"),
        "kv_bytes_per_token": flops.kv_bytes_per_token(cfg, None, BYTES_PER_ELEMENT),
        "task_tokens": task_tokens,
        "kv_bytes_per_token_task": flops.kv_bytes_per_token(cfg, task_tokens, BYTES_PER_ELEMENT),
        "parameters": parameter_count(cfg),
        "results": str(d["dir"]),
    }


def table(rows: list[dict]) -> str:
    """The printed table, one line per run: memory (KV bytes per token in the long-sequence limit and at the
    task's own length T: everything the decode cache holds after T tokens over T, ``ckv.flops.kv_bytes_per_token``)
    and cost, accuracy, the phase gap with its interval, noise floor, permutation p, one-sided 95% upper bound
    (``<=``), minimum detectable gap (``MDE``, 80% power) and verdict (gap / flat / undecided at the equivalence
    margin), and the residue gap with its interval, noise floor and minimum detectable gap."""
    head = (
        f"{'task/model/seed':34s} {'KV B/tok':>8s} {'at T':>9s} {'params':>8s} {'train s':>7s} {'mean %':>6s} "
        f"{'worst %':>7s}  "
        f"{'per-phase accuracy % (phase = pos mod S)':42s} {'phase gap pp [95%]':>19s} {'floor':>5s} {'p':>6s} "
        f"{'<= pp':>5s} {'MDE':>5s} {'verdict':>9s} {'residue gap pp [95%]':>20s} {'floor':>5s} {'MDE':>5s}"
    )
    lines = [head]
    for r in rows:
        per = " / ".join(f"{100 * a:.0f}" for a in r["per_phase"]) + f" (S={r['stride']})"
        gap = f"{100 * r['phase_gap']:.1f} [{100 * r['phase_gap_lower']:.1f}, {100 * r['phase_gap_upper']:.1f}]"
        res = f"{100 * r['residue_gap']:.1f} [{100 * r['residue_gap_lower']:.1f}, {100 * r['residue_gap_upper']:.1f}]"
        lines.append(
            f"{r['task'] + '/' + r['model'] + '/' + str(r['seed']):34s} {r['kv_bytes_per_token']:8.0f} "
            f"{r['kv_bytes_per_token_task']:5.0f}@{r['task_tokens']:<3d} "
            f"{r['parameters']:8d} {r['train_seconds']:7.0f} {100 * r['mean']:6.1f} "
            f"{100 * r['worst_phase_accuracy']:7.1f}  {per:42s} {gap:>19s} "
            f"{100 * r['phase_noise_floor']:5.1f} {r['phase_p_value']:6.4f} {pp(r['phase_upper_one_sided']):>5s} "
            f"{pp(r['phase_mde']):>5s} {str(r['phase_verdict']):>9s} {res:>20s} "
            f"{100 * r['residue_noise_floor']:5.1f} {pp(r['residue_mde']):>5s}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Worst-phase accuracy against KV bytes per token: one panel per task, one point per run, one colour per
    model; models of equal memory are spread a little along x (the axis is logarithmic: full attention stores
    4-8x more per token)."""
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows}, key=list(MODELS).index)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        models = [m for m in MODELS[task] if any(r["task"] == task and r["model"] == m.name for r in rows)]
        for i, m in enumerate(models):
            pts = [r for r in rows if r["task"] == task and r["model"] == m.name]
            dodge = 2 ** (0.06 * (i - (len(models) - 1) / 2))
            ax.scatter(
                [r["kv_bytes_per_token"] * dodge for r in pts],
                [100 * r["worst_phase_accuracy"] for r in pts],
                color=plt.cm.tab10(i),
                marker={"control": "s", "baseline": "X"}.get(m.role, "o"),
                label=f"{m.name} ({m.role})",
                s=45,
                alpha=0.85,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV-cache bytes per token (bf16, all layers; equal-memory models spread a little)")
        ax.set_ylabel("worst-phase accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{task}: one point per seed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def criteria(rows: list[dict]) -> list[Check]:
    """The study's success criteria, per fix, over its seeds (a criterion needs every seed of the fix, of its
    baseline and of the control): the minimum (worst phase raised by >= MIN_GAIN over the equal-memory baseline
    of the same seed) and the goal (flat: the equivalence test bounds the phase gap under its margin,
    ``ckv.eval.stats.gap_verdict``; and worst phase within GOAL_MARGIN of full attention's of the same seed; not
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
            Check(
                f"{task}/{model}: worst phase >= {100 * MIN_GAIN:.0f} pp above {r0['baseline']} in every seed",
                all(g >= MIN_GAIN for g in gains),
                "; ".join(
                    f"seed {s}: {100 * f['worst_phase_accuracy']:.1f}% vs {100 * b['worst_phase_accuracy']:.1f}% "
                    f"({100 * g:+.1f} pp)"
                    for s, (f, b, _), g in zip(seeds, pairs, gains)
                ),
            )
        )
        flat = [f["phase_verdict"] == "flat" for f, _, _ in pairs]
        near = [f["worst_phase_accuracy"] >= c["worst_phase_accuracy"] - GOAL_MARGIN for f, _, c in pairs]
        unlearned = [(s, c["mean"]) for s, (_, _, c) in zip(seeds, pairs) if c["mean"] < CONTROL_LEARNED]
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
            Check(
                f"{task}/{model}: flat (phase gap's one-sided 95% upper bound under {pp(r0['phase_margin'])} pp) and "
                f"worst phase within {100 * GOAL_MARGIN:.0f} pp of full attention's in every seed",
                all(flat) and all(near),
                "; ".join(
                    f"seed {s}: {f['phase_verdict']}, gap {100 * f['phase_gap']:.1f} pp "
                    f"[{100 * f['phase_gap_lower']:.1f}, {100 * f['phase_gap_upper']:.1f}] "
                    f"<= {pp(f['phase_upper_one_sided'])} p = "
                    f"{f['phase_p_value']:.4f} floor {100 * f['phase_noise_floor']:.1f} MDE {pp(f['phase_mde'])}, "
                    f"worst {100 * f['worst_phase_accuracy']:.1f}% vs full {100 * c['worst_phase_accuracy']:.1f}%"
                    for s, (f, _, c) in zip(seeds, pairs)
                ),
            )
        )
    return checks


def _se(lower: float, upper: float) -> float:
    """The standard error a 95% interval implies (its half-width over z_0.975)."""
    return (upper - lower) / (2 * Z_TWO_SIDED_95)


def noninferiority_bound(fix: dict, control: dict) -> list[float]:
    """Per phase of ``fix``: the one-sided 95% lower bound of (phase accuracy - the control's mean accuracy), each
    from the two runs' 95% cluster-bootstrap intervals as normal standard errors (independent models)."""
    se_c = _se(control["mean_lower"], control["mean_upper"])
    return [
        a - control["mean"] - Z_ONE_SIDED_95 * (_se(lo, hi) ** 2 + se_c**2) ** 0.5
        for a, lo, hi in zip(fix["per_phase"], fix["per_phase_lower"], fix["per_phase_upper"])
    ]


def confirm_verdicts(rows: list[dict]) -> list[Check]:
    """The confirmation's verdicts, as committed in docs/robustness.md ("Confirmation: criteria"): validity
    (the control learned, the baseline shows a real gap, in every seed), then per finalist C1 (phase-gap verdict
    ``flat`` in every seed: equivalence at the 5 pp margin) and C2 (in every seed, every phase's one-sided 95% lower
    bound of its accuracy minus the same seed's control mean above -NONINFERIORITY_MARGIN) and the verdict:
    confirmed (C1 and C2), flat but not as good as full attention (C1 only), or not confirmed. A finalist, its
    baseline or the control missing a seed leaves it unjudged (no check)."""
    by = {(r["model"], r["seed"]): r for r in rows if r["task"] == CONFIRM_TASK}
    seeds = sorted({s for _, s in by})
    base = [by.get(("gate_w4s4", s)) for s in seeds]
    ctrl = [by.get(("full", s)) for s in seeds]
    if not seeds or any(r is None for r in base + ctrl):
        return []
    learned = Check(
        f"validity: the control (full) learns the task (mean >= {100 * CONTROL_LEARNED:.0f}%) in every seed",
        all(c["mean"] >= CONTROL_LEARNED for c in ctrl),
        "; ".join(
            f"seed {s}: mean {100 * c['mean']:.1f}% [{100 * c['mean_lower']:.1f}, {100 * c['mean_upper']:.1f}], "
            f"verdict {c['phase_verdict']}"
            for s, c in zip(seeds, ctrl)
        ),
    )
    mechanism = Check(
        "validity: the baseline (gate_w4s4) shows a real phase gap in every seed",
        all(b["phase_verdict"] == "gap" for b in base),
        "; ".join(
            f"seed {s}: gap {100 * b['phase_gap']:.1f} pp [{100 * b['phase_gap_lower']:.1f}, "
            f"{100 * b['phase_gap_upper']:.1f}], worst {100 * b['worst_phase_accuracy']:.1f}%, {b['phase_verdict']}"
            for s, b in zip(seeds, base)
        ),
    )
    checks = [learned, mechanism]
    if not (learned.passed and mechanism.passed):
        return checks
    for name in CONFIRM_FINALISTS:
        fixes = [by.get((name, s)) for s in seeds]
        if any(f is None for f in fixes):
            continue
        flat = [f["phase_verdict"] == "flat" for f in fixes]
        bounds = [min(noninferiority_bound(f, c)) for f, c in zip(fixes, ctrl)]
        near = [b > -NONINFERIORITY_MARGIN for b in bounds]
        checks.append(
            Check(
                f"C1 {name}: flat (phase gap's one-sided 95% upper bound under {pp(fixes[0]['phase_margin'])} pp) "
                "in every seed",
                all(flat),
                "; ".join(
                    f"seed {s}: gap {100 * f['phase_gap']:.1f} pp [{100 * f['phase_gap_lower']:.1f}, "
                    f"{100 * f['phase_gap_upper']:.1f}] <= {pp(f['phase_upper_one_sided'])}, "
                    f"MDE {pp(f['phase_mde'])}, {f['phase_verdict']}"
                    for s, f in zip(seeds, fixes)
                ),
            )
        )
        checks.append(
            Check(
                f"C2 {name}: every phase non-inferior to full attention's mean (margin "
                f"{100 * NONINFERIORITY_MARGIN:.0f} pp, one-sided 95%) in every seed",
                all(near),
                "; ".join(
                    f"seed {s}: worst phase {100 * f['worst_phase_accuracy']:.1f}% vs full's mean "
                    f"{100 * c['mean']:.1f}%, lowest bound of (phase - full) {100 * b:+.1f} pp"
                    for s, f, c, b in zip(seeds, fixes, ctrl, bounds)
                ),
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
                f"gap {100 * r['phase_gap']:.1f} pp [{100 * r['phase_gap_lower']:.1f}, "
                f"{100 * r['phase_gap_upper']:.1f}] <= {pp(r['phase_upper_one_sided'])} MDE {pp(r['phase_mde'])} "
                f"{r['phase_verdict']}; KV {r['kv_bytes_per_token']:.0f} B/token ({r['kv_bytes_per_token_task']:.0f} "
                f"at T = {r['task_tokens']})"
            )
    return lines


def analyse(done: list[dict], out: Path, quick: bool, workers: int, env: dict, clock: Timer) -> list[dict]:
    """The crowding analysis on ``ANALYSED_TASKS``' compressed models: ``eval.py analysis=joint`` (per layer and KV
    head, the knock-out effect per phase beside the K and V gate profiles, docs/analysis.md), one summary per run.
    ``static`` is the effective number of offsets of the window-averaged gate (1 = one offset, W = uniform)."""
    todo = [
        d for d in done if d["run"].experiment.removeprefix("robust_") in ANALYSED_TASKS and d["run"].role != "control"
    ]

    def one(d: dict) -> dict:
        run_command(
            [
                sys.executable,
                "eval.py",
                f"model.path='{d['dir']}'",
                f"task={TASK}",
                "analysis=joint",
                "progress=false",
                *(QUICK_EVAL if quick else (f"task.n_base={ANALYSIS_N_BASE}",)),
            ],
            out / "logs" / f"joint_{d['run'].name}_seed{d['run'].seed}.log",
            env,
        )
        res = read_json(Path(d["dir"]) / "eval" / TASK / "joint" / "joint.json")["analysis"]["results"]
        print(f"[{clock}] {d['run'].label}: crowding analysis done", flush=True)
        return {
            "label": d["run"].label,
            "window": res["window"],
            "stride": res["stride"],
            "worst_phase": res["clean"]["worst_phase"],
            "layers": [
                {
                    k: u.get(k)
                    for k in (
                        "layer",
                        "kv_head",
                        "k_static",
                        "v_static",
                        "k_peak",
                        "v_peak",
                        "worst_phase",
                        "loss_vs_k",
                        "loss_vs_v",
                        "knockout",
                    )
                }
                for u in res["rows"]
            ],
            "file": str(Path(d["dir"]) / "eval" / TASK / "joint" / "joint.json"),
        }

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, todo))


def crowding_lines(analyses: list[dict]) -> list[str]:
    """One line per analysed run and layer: gate concentration (static effective offsets of W, K and V, with
    peaks) and the knock-out of the layer's KV head per phase (``100 * (knocked - clean) / clean``, the analysis'
    relative effect), with the phase it hurts most."""
    lines = []
    for a in analyses:
        for u in a["layers"]:
            ko = " / ".join("-" if e is None else f"{e:+.0f}" for e in u["knockout"])
            v = "" if u["v_static"] is None else f", V {u['v_static']:.1f} (peak {u['v_peak']})"
            lines.append(
                f"{a['label']} L{u['layer']} kv{u['kv_head']}: static offsets of W={a['window']}: "
                f"K {u['k_static']:.1f} (peak {u['k_peak']}){v}; "
                f"knock-out effect per phase (% change of accuracy) {ko}, "
                f"most hurt phase {u['worst_phase']}; clean worst phase {a['worst_phase']}"
            )
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = demo_arguments(__doc__, "outputs/robust", "the first seed only, a few steps per model: pipeline check only")
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
        f"{', '.join(map(str, CONFIRM_SEEDS))} (default --out outputs/robust_confirm), and its verdicts",
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
    if args.confirm and args.out == ap.get_default("out"):
        args.out = "outputs/robust_confirm"
    out = Path(args.out).resolve()
    png = out / "worst_phase_vs_kv_bytes.png"
    if args.replot:
        plot(read_json(out / "robust.json")["rows"], png)
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
    clock, env = Timer(), job_env()
    print(
        f"ckv robust -> {out}: {len(runs)} models, {args.workers} at a time"
        f"{' (quick: pipeline check, not the science)' if args.quick else ''}",
        flush=True,
    )
    done = run_plan(runs, out, args.quick, args.workers, env, clock)
    rows = [row(d) for d in done]
    analyses = analyse(done, out, args.quick, args.workers, env, clock)
    print("\n" + table(rows) + "\n")
    checks = criteria(rows)
    for c in checks:
        print(f"  [{'MET' if c.passed else 'not met'}] {c.claim}: {c.detail}")
    verdicts = confirm_verdicts(rows) if args.confirm else []
    if verdicts:
        print("\nconfirmation (criteria committed in docs/robustness.md, 'Confirmation: criteria'):")
        for c in verdicts:
            print(f"  [{'MET' if c.passed else 'not met'}] {c.claim}: {c.detail}")
    ladder = ladder_lines(rows)
    if ladder:
        print("\nablation ladder (split task; each step adds one change to the previous one):")
        for line in ladder:
            print(f"  {line}")
    if analyses:
        print(f"\ncrowding analysis (eval.py analysis=joint on each compressed model of {', '.join(ANALYSED_TASKS)}):")
        for line in crowding_lines(analyses):
            print(f"  {line}")
    plot(rows, png)
    write_study_record(
        out,
        "robust",
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
