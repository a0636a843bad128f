"""``make demo``: periodic weak spots on a CPU, measured, next to a full-attention control that has learned.

The demo only drives ``train.py`` and ``eval.py`` with shipped configs (``conf/experiment/demo_*.yaml``,
``conf/eval/task/demo_lookup.yaml``): it trains its three models (all at once on two cores), evaluates each on the
position-matched lookup task, writes the side-by-side comparison through ``eval.py summary=...``, then prints one
table and checks the science it claims (``CRITERIA``), writing everything under ``outputs/demo/``.

    python -m ckv.apps.demo                 # the full demo (time in the Makefile and docs/demo.md)
    python -m ckv.apps.demo --quick         # a few steps per model: checks the pipeline, not the science

The full demo exits 1 when a science check fails; ``--quick`` exits 0 whatever the checks say (its few steps
cannot meet the thresholds: it only shows that every stage runs), and a failed command always exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ckv.eval.stats import gap_is_real
from ckv.eval.summary import flatness_fields, results_file
from ckv.io.layout import read_run_config
from ckv.io.results import read_json, write_json

ROOT = Path(__file__).resolve().parents[3]  # the checkout: train.py, eval.py and conf/ live here
TASK = "demo_lookup"
DISTRIBUTED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class DemoRun:
    """One model of the demo: an experiment config, a seed, its role in the checks, and extra overrides."""

    experiment: str
    seed: int
    role: str  # "gate" (the main compressed model), "geometry" (a second stride), "control" (full attention), "grid"
    train_overrides: tuple[str, ...] = ()
    eval_overrides: tuple[str, ...] = ()
    name: str = ""  # the run folder's name under <out>/runs (default: the experiment)
    entry: tuple[str, ...] = ("train.py",)  # the trainer command after ``python``; it takes train.py's overrides

    @property
    def label(self) -> str:
        return f"{(self.name or self.experiment).removeprefix('demo_')}/seed={self.seed}"


# three models, trained at once (``main``): on 2 cores no core waits while the last model trains. More seeds of the
# S = 4 gate: ``gate_w4s4`` of ``python -m ckv.apps.robust --seeds 0 1`` (the same experiment) and of robust-confirm.
PLAN = (
    DemoRun("demo_gate_s4", 0, "gate"),
    DemoRun("demo_gate_s2", 0, "geometry"),
    # the control has no stride: group its targets by the gate models' phase (mod 4) so the two are comparable
    DemoRun("demo_full", 0, "control", eval_overrides=("task.stride=4",)),
)

# make demo-grid: strides 2/4/8, W = S and W = 2S, learned gate vs uniform mean (12 models)
GRID = tuple(
    DemoRun(
        "demo_gate_s4",
        0,
        "grid",
        (f"attention.window={w}", f"attention.stride={s}") + (("attention.gate=null",) if p == "mean" else ()),
        name=f"grid_{p}_w{w}s{s}",
    )
    for p in ("gate", "mean")
    for s in (2, 4, 8)
    for w in (s, 2 * s)
)

QUICK_TRAIN = (
    "trainer.max_steps=12",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.log_every=4",
    "optim.warmup_steps=2",
)
QUICK_EVAL = ("task.n_base=64", "stats.n_bootstrap=200", "stats.n_permutations=200")


@dataclass
class Check:
    """One claim of the demo and whether the run's numbers support it."""

    claim: str
    passed: bool
    detail: str


@dataclass
class Timer:
    start: float = field(default_factory=time.monotonic)

    def __str__(self) -> str:
        s = int(time.monotonic() - self.start)
        return f"{s // 60:d}:{s % 60:02d}"


def run_command(cmd: list[str], log: Path, env: dict) -> None:
    """Run ``cmd`` in the checkout with its output in ``log``; a failure raises with the log's last lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- {log} (last lines) ---\n{tail}")


def run_dir(out: Path, run: DemoRun) -> Path:
    """The run folder the demo gives ``train.py`` (``hydra.run.dir``): ``<out>/runs/<experiment>/seed=<seed>``."""
    return out / "runs" / (run.name or run.experiment) / f"seed={run.seed}"


def train_and_evaluate(run: DemoRun, out: Path, quick: bool, env: dict, clock: Timer) -> dict:
    """Train one demo model with ``train.py`` (resuming if its folder exists), then evaluate it with ``eval.py``."""
    py = sys.executable
    t0 = time.monotonic()
    rdir = run_dir(out, run)
    train_cmd = [
        py,
        *run.entry,
        f"experiment={run.experiment}",
        f"seed={run.seed}",
        f"hydra.run.dir='{rdir}'",
        "trainer.progress=false",
        "wandb.enabled=false",
        *run.train_overrides,
        *(QUICK_TRAIN if quick else ()),
    ]
    run_command(train_cmd, out / "logs" / f"train_{run.name or run.experiment}_seed{run.seed}.log", env)
    train_s = time.monotonic() - t0
    eval_cmd = [
        py,
        "eval.py",
        f"model.path='{rdir}'",
        f"task={TASK}",
        "progress=false",
        *run.eval_overrides,
        *(QUICK_EVAL if quick else ()),
    ]
    run_command(eval_cmd, out / "logs" / f"eval_{run.name or run.experiment}_seed{run.seed}.log", env)
    steps = read_run_config(rdir)["trainer"]["max_steps"]
    print(
        f"[{clock}] {run.label}: trained in {train_s:.0f} s, evaluated in {time.monotonic() - t0 - train_s:.0f} s",
        flush=True,
    )
    results = read_json(results_file(rdir, TASK))["results"]
    return {"run": run, "dir": rdir, "train_seconds": train_s, "steps": steps, "results": results}


def job_env() -> dict:
    """The environment of every train/eval job: one thread, offline, headless plots, no launcher rank variables
    (every run is its own single-process job: rank variables left behind would make two runs rendezvous on the
    same port)."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }


def run_plan(plan: tuple[DemoRun, ...], out: Path, quick: bool, workers: int, env: dict, clock: Timer) -> list[dict]:
    """Train and evaluate every run, ``workers`` at a time; returns ``train_and_evaluate``'s records in plan order.
    The first failure stops the plan: queued runs never start."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(train_and_evaluate, r, out, quick, env, clock): r for r in plan}
        results = {}
        for fut in as_completed(futures):
            if fut.exception() is not None:
                for f in futures:
                    f.cancel()
                raise fut.exception()
            results[futures[fut]] = fut.result()
    return [results[r] for r in plan]


def check_science(done: list[dict]) -> list[Check]:
    """The demo's claims (docs/demo.md), each against the measured numbers. Every check reads the phase gap (best minus
    worst over the groups of position mod S, S the model's stride; the control at the gate models' stride 4),
    since the claims are about a phase effect of period S, not the residue gap."""
    checks: list[Check] = []
    by_role: dict[str, list[tuple[DemoRun, dict]]] = {}
    for d in done:
        by_role.setdefault(d["run"].role, []).append((d["run"], d["results"]))
    gate_means = []
    for run, rep in by_role.get("gate", []):
        h = rep["headline"]
        gate_means.append(h["mean"])
        ok = h["phase_gap"] >= 0.20 and h["phase_gap_lower"] > h["phase_noise_floor"]
        checks.append(
            Check(
                f"{run.label}: phase gap (mod S={rep['stride']}) >= 20 pp, interval above the noise floor",
                ok,
                f"gap {100 * h['phase_gap']:.1f} pp [{100 * h['phase_gap_lower']:.1f}, "
                f"{100 * h['phase_gap_upper']:.1f}], noise floor {100 * h['phase_noise_floor']:.1f} pp",
            )
        )
    for run, rep in by_role.get("geometry", []):
        h = rep["headline"]
        # a period counts only where there is a phase effect: significant, and its interval above the noise floor
        real = gap_is_real(h["phase_p_value"], h["phase_gap_lower"], h["phase_noise_floor"])
        ok = real and h["dominant_period"] == rep["stride"]
        score = h["periodicity_score"]
        checks.append(
            Check(
                f"{run.label}: a significant phase effect whose dominant period equals the stride ({rep['stride']})",
                ok,
                f"dominant period {h['dominant_period']}, periodicity score "
                f"{'-' if score is None else round(score, 3)}, gap {100 * h['phase_gap']:.1f} pp "
                f"[{100 * h['phase_gap_lower']:.1f}, {100 * h['phase_gap_upper']:.1f}], p = "
                f"{h['phase_p_value']:.4f}, noise floor {100 * h['phase_noise_floor']:.1f} pp",
            )
        )
    for run, rep in by_role.get("control", []):
        h = rep["headline"]
        best_gate = max(gate_means) if gate_means else 0.0
        ok_mean = h["mean"] >= 0.40 and h["mean"] >= best_gate - 0.15
        checks.append(
            Check(
                f"{run.label}: full attention has learned (mean >= 40% and >= gate mean - 15 pp)",
                ok_mean,
                f"mean {100 * h['mean']:.1f}% vs best gate mean {100 * best_gate:.1f}%",
            )
        )
        f = flatness_fields(rep, "phase")
        checks.append(
            Check(
                f"{run.label}: flat at stride {rep['stride']}: the phase gap's one-sided 95% upper bound is under "
                f"{100 * f['phase_margin']:.0f} pp (equivalence test)",
                f["phase_verdict"] == "flat",
                f"gap {100 * h['phase_gap']:.1f} pp, upper bound {100 * f['phase_upper_one_sided']:.1f} pp, "
                f"p = {h['phase_p_value']:.3f}, noise floor {100 * h['phase_noise_floor']:.1f} pp",
            )
        )
    return checks


def exit_code(checks: list[Check], quick: bool) -> int:
    """1 when a science check failed, else 0 (the grid has no checks). Quick mode (a pipeline check whose
    thresholds are not expected to hold) always gives 0."""
    return 0 if quick or all(c.passed for c in checks) else 1


def pp(x: Optional[float]) -> str:
    """A fraction as percentage points with one decimal, ``-`` when not computed."""
    return "-" if x is None else f"{100 * x:.1f}"


def table(done: list[dict]) -> str:
    """The printed table: mean, per-phase accuracy, phase gap (mod S) with interval, permutation p and noise floor,
    the gap's one-sided 95% upper bound, the minimum detectable gap (80% power) and the verdict (gap / flat /
    undecided, ``ckv.eval.stats.gap_verdict``)."""
    lines = [
        f"{'model':22s} {'steps':>6s} {'train s':>8s} {'mean %':>7s}  {'per-phase accuracy % (phase = pos mod S)':44s}"
        f" {'gap pp [95%]':>20s} {'perm p':>7s} {'floor pp':>8s} {'<= pp':>5s} {'MDE pp':>6s} {'verdict':>9s}"
        f" {'period':>6s}"
    ]
    for d in done:
        rep = d["results"]
        h, groups, f = rep["headline"], rep["phase"]["groups"], flatness_fields(rep, "phase")
        per = " / ".join(f"{100 * g['accuracy']:.1f}" for g in groups) + f"  (S={rep['stride']})"
        gap = f"{100 * h['phase_gap']:.1f} [{100 * h['phase_gap_lower']:.1f}, {100 * h['phase_gap_upper']:.1f}]"
        lines.append(
            f"{d['run'].label:22s} {d['steps']:6d} {d['train_seconds']:8.0f} {100 * h['mean']:7.1f}"
            f"  {per:44s} {gap:>20s} {h['phase_p_value']:7.4f}"
            f" {100 * h['phase_noise_floor']:8.1f} {pp(f['phase_upper_one_sided']):>5s} {pp(f['phase_mde']):>6s}"
            f" {str(f['phase_verdict']):>9s} {str(h['dominant_period']):>6s}"
        )
    return "\n".join(lines)


def run_records(done: list[dict]) -> list[dict]:
    """The runs as stored in the demo's JSON record."""
    return [
        {
            "label": d["run"].label,
            "role": d["run"].role,
            "dir": str(d["dir"]),
            "steps": d["steps"],
            "train_seconds": d["train_seconds"],
            "results": str(results_file(d["dir"], TASK)),
        }
        for d in done
    ]


def write_study_record(out: Path, name: str, quick: bool, clock: Timer, png: Path, record: dict) -> None:
    """A study's last step (``make robust``, ``make selection``): ``<out>/<name>.json`` holds ``quick``, the
    seconds so far, ``record`` and the plot's path; then the quick-mode warning and where everything is."""
    path = out / f"{name}.json"
    write_json(path, {"quick": quick, "seconds": time.monotonic() - clock.start, **record, "plot": str(png)})
    if quick:
        print("quick mode: a few steps per model; the numbers above check the pipeline, not the science")
    print(f"[{clock}] plot: {png}; record: {path}")


def default_workers() -> int:
    """Models trained at once unless an app says otherwise: one per core, at most two (each job has one thread)."""
    return min(2, os.cpu_count() or 1)


def demo_arguments(
    doc: str, out: str, quick_help: str = "a few steps per model: pipeline check only"
) -> argparse.ArgumentParser:
    """The options every demo-style app shares: ``--out``, ``--workers`` (models trained at once), ``--quick``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out, help=f"output folder (default: {out})")
    ap.add_argument("--workers", type=int, default=default_workers(), help="models trained at once")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = demo_arguments(__doc__, "outputs/demo")
    ap.add_argument("--grid", action="store_true", help="the stride x window x pooling grid (make demo-grid)")
    ap.set_defaults(workers=None)  # the demo's three models all at once; the grid's 12 as every app's default
    args = ap.parse_args(argv)
    plan = GRID if args.grid else PLAN
    if args.workers is None:
        args.workers = default_workers() if args.grid else len(PLAN)
    out = Path(args.out).resolve()
    env = job_env()
    clock = Timer()
    print(
        f"ckv demo{' grid' if args.grid else ''} -> {out}: {len(plan)} models, {args.workers} at a time"
        f"{' (quick: pipeline check, not the science)' if args.quick else ''}",
        flush=True,
    )
    done = run_plan(plan, out, args.quick, args.workers, env, clock)
    runs = ",".join(f"'{d['dir']}'" for d in done)  # quoted: run folder names hold '='
    run_command(
        [sys.executable, "eval.py", f"summary=[{runs}]", f"task={TASK}", f"summary_out={out}", "progress=false"],
        out / "logs" / "summary.log",
        env,
    )
    checks = check_science(done)
    print("\n" + table(done) + "\n")
    for c in checks:
        print(f"  [{'PASS' if c.passed else 'FAIL'}] {c.claim}: {c.detail}")
    verdict = bool(checks) and all(c.passed for c in checks)
    if args.quick:
        print("quick mode: the thresholds above need the full budget; only the pipeline was checked")
    plots = {
        "phases": out / "comparison_phases.png",
        "residues": out / "comparison_residues.png",
        "grid": out / "summary_grid.png",
    }
    write_json(
        out / "demo.json",
        {
            "quick": args.quick,
            "grid": args.grid,
            "seconds": time.monotonic() - clock.start,
            "all_passed": verdict,
            "checks": [c.__dict__ for c in checks],
            "runs": run_records(done),
            "plots": {k: str(v) for k, v in plots.items()},
        },
    )
    print(
        f"[{clock}] plots: {', '.join(str(p) for p in plots.values())}; table: {out / 'summary.csv'}; "
        f"record: {out / 'demo.json'}"
    )
    if checks:
        print("the science holds in this run" if verdict else "NOT every claim holds in this run: see FAIL lines above")
    return exit_code(checks, args.quick)


if __name__ == "__main__":
    sys.exit(main())
