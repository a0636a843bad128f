"""``make selection``: does DeepSeek-V4's top-k selection create weak phases beyond the compressor's own geometry?
(docs/selection.md)

One CPU task where selection binds like V4's (``conf/experiment/select_long.yaml``: make demo's model and split
records, 64 of them and 56 queries, so the final query of a prompt of up to 259 tokens sees up to 64 compressed
entries at S = 4, of which top-``TOPK`` keeps 1/16) and three models, ``SEEDS`` each, with the SAME query path (V4's
low-rank latent, rank 32) wherever attention is compressed:

- ``dense``: V4's dense CSA (``deepseek_v4_csa``), trained dense, then SERVED on the same prompts by every
  selector of ``eval.py analysis=selection`` at top-``TOPK``: ``dense`` (every visible entry, the reference),
  ``oracle`` (the top-k of the layer's own dense attention mass: a perfect selector imposed at inference, not a
  training regime), ``random`` (k visible entries uniformly, seeded) and ``recency`` (the k most recent);
- ``sparse``: the same layer with V4's lightning indexer (``deepseek_v4_csa_sparse``), trained by
  ``SPARSE_RECIPE`` (``trainer.indexer``, docs/training.md: dense training, the indexer's warm-up on the frozen
  model, sparse training), served by its trained indexer (``model``) and by the
  same four selectors on its own weights (the oracle on the indexer's schedule);
- ``full``: the full-attention control, which must learn the task (mean >= ``CONTROL_LEARNED`` in every seed).

Each run is trained with ``train.py`` and evaluated with ``eval.py``'s fixed-query position-matched lookup
(``ckv.apps.demo``'s machinery), then analysed with ``eval.py analysis=selection`` on the same prompts. Printed:
the per-run table (mean, per-phase accuracy, phase gap with interval, noise floor, verdict), the per-selector
table (paired accuracy difference against dense serving of the same weights, covered rate at the straddling phase
and at the others, its ratio with interval beside the geometric expectation of a random top-k, and the accuracy
when the record was covered vs missed at the straddling phase) and the criteria of docs/selection.md
(``criteria``); one plot, everything under ``outputs/selection/``.

    python -m ckv.apps.selection            # make selection (9 runs; time in the Makefile and docs/selection.md)
    python -m ckv.apps.selection --quick    # seed 0, a few steps per model: checks the pipeline only

The criteria are reported, not enforced: the run exits 0 when every command succeeded and non-zero when one failed.
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

EXPERIMENT = "select_long"
SEEDS = (0, 1, 2)
STRIDE = 4  # the compressed models' stride; full attention's phases are taken mod this
TOPK = 4  # entries each query keeps: 1/16 of the up to 64 visible at the final query
# base examples of the evaluation (x 8 shifts: 1,024 prompts, a multiple of 8**2): the MDE column states what
# that sample can resolve; the selection analysis scores them once per selector
N_BASE = 128
# the sparse model's three stages (trainer.indexer, docs/training.md) within select_long's 2,000 steps: dense training,
# the indexer's warm-up on the frozen model (DeepSeek-V3.2's dense warm-up), then sparse training; quick runs: of
# QUICK_TRAIN's 12 steps
SPARSE_RECIPE = ("trainer.indexer.dense_steps=1200", "trainer.indexer.warmup_steps=400")
QUICK_SPARSE_RECIPE = ("trainer.indexer.dense_steps=6", "trainer.indexer.warmup_steps=3")
LAYER = 0  # the criteria's layer: its entries pool the token embeddings, so "holds the record" is literal
CONTROL_LEARNED = 0.80  # the control must reach this mean in every seed for the comparison to mean anything
DENSE_LEARNED = 0.50  # and dense V4 this one: coverage cannot cost a model accuracy it never had
EQUIVALENCE = 0.05  # C2 fails (no cost) when the straddling excess's interval lies within +-5 pp (the flatness margin)
# the criteria's (model, selector) pairs: the trained indexer on its own weights (the claim), the oracle on the dense
# weights (does top-k itself, perfectly chosen, do it?)
PRIMARY = (("sparse", "model"), ("dense", "oracle"))
IMPOSED = ("dense", "oracle", "random", "recency")  # the selectors every compressed run is served by


@dataclass(frozen=True)
class Model:
    """One model of the study: its ``train.py`` overrides, its role (``dense``, ``indexer`` or ``control``) and
    the selectors ``analysis=selection`` serves it with (none for the control)."""

    name: str
    option: str
    role: str
    selectors: tuple[str, ...] = ()


MODELS = (
    Model("dense", "attention=deepseek_v4_csa", "dense", IMPOSED),
    Model(
        "sparse", f"attention=deepseek_v4_csa_sparse attention.selection.topk={TOPK}", "indexer", ("model", *IMPOSED)
    ),
    Model("full", "attention=full ~attention.local_window ~attention.query", "control"),
)
MODEL_BY_NAME = {m.name: m for m in MODELS}


def plan(seeds: tuple[int, ...], quick: bool = False) -> tuple[DemoRun, ...]:
    """Every (model, seed) run, named after the model (``<out>/runs/<model>/seed=<seed>``), evaluated on ``N_BASE``
    base examples (quick: ``QUICK_EVAL``'s)."""
    recipe = QUICK_SPARSE_RECIPE if quick else SPARSE_RECIPE
    return tuple(
        DemoRun(
            EXPERIMENT,
            seed,
            m.role,
            tuple(m.option.split()) + (recipe if m.role == "indexer" else ()),
            (() if quick else (f"task.n_base={N_BASE}",)) + ((f"task.stride={STRIDE}",) if m.role == "control" else ()),
            name=m.name,
        )
        for m in MODELS
        for seed in seeds
    )


def analyse(done: list[dict], out: Path, quick: bool, workers: int, env: dict, clock: Timer) -> dict[str, dict]:
    """``eval.py analysis=selection`` on the same prompts as the evaluation, every compressed run served by its
    model's selectors at top-``TOPK``. Returns the results by run label."""
    todo = [d for d in done if MODEL_BY_NAME[d["run"].name].selectors]

    def one(d: dict) -> tuple[str, dict]:
        run = d["run"]
        selectors = ",".join(MODEL_BY_NAME[run.name].selectors)
        cmd = [sys.executable, "eval.py", f"model.path='{d['dir']}'", f"task={TASK}", "analysis=selection"]
        run_command(
            [
                *cmd,
                f"analysis.selectors=[{selectors}]",
                f"analysis.topk={TOPK}",
                "progress=false",
                *(QUICK_EVAL if quick else (f"task.n_base={N_BASE}",)),
            ],
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


def row(d: dict) -> dict:
    """One run's row: its headline, per-phase accuracy and flatness, the indexer's final recall."""
    rep, run = d["results"], d["run"]
    h = rep["headline"]
    return {
        "model": run.name,
        "role": run.role,
        "seed": run.seed,
        "steps": d["steps"],
        "train_seconds": d["train_seconds"],
        "mean": h["mean"],
        "per_phase": [g["accuracy"] for g in rep["phase"]["groups"]],
        "worst_phase": h["worst_phase"],
        "phase_gap": h["phase_gap"],
        "phase_gap_lower": h["phase_gap_lower"],
        "phase_gap_upper": h["phase_gap_upper"],
        "phase_p_value": h["phase_p_value"],
        "phase_noise_floor": h["phase_noise_floor"],
        **flatness_fields(rep, "phase"),
        "recall": final_recall(Path(d["dir"])),
        "results": str(d["dir"]),
    }


def selector_row(run: DemoRun, name: str, analysis: dict, layer: int = LAYER) -> dict:
    """One (run, selector) row of ``analysis=selection``'s results at ``layer``: mean accuracy, the paired
    difference against the reference and its straddling excess, the covered rate at the straddling phases and at
    the others, the straddling ratio beside the geometric one, and the accuracy when covered / missed at the
    straddling phases (pooled counts)."""
    res, straddling = analysis["selectors"][name], analysis["straddling_phases"]
    cells = [(p["phase"] in straddling, p["layers"][layer]) for p in res["phases"]]

    def pooled(key: str, at_straddle: bool) -> dict:
        n = sum(c[key]["n"] for s, c in cells if s == at_straddle)
        k = sum(c[key]["successes"] for s, c in cells if s == at_straddle)
        return {"n": n, "rate": k / n if n else None}

    geo = analysis["geometric"]
    return {
        "model": run.name,
        "seed": run.seed,
        "selector": name,
        "mean": res["mean_accuracy"],
        "paired": analysis["paired"].get(name),  # None for the reference
        "covered_straddle": pooled("covered", True)["rate"],
        "covered_others": pooled("covered", False)["rate"],
        "ratio": res["layers"][layer]["straddle_ratio"],
        "geometric_ratio": None if geo is None else geo["layers"][layer]["straddle_ratio"]["value"],
        "accuracy_covered_straddle": pooled("accuracy_covered", True),
        "accuracy_missed_straddle": pooled("accuracy_missed", True),
    }


def selector_rows(done: list[dict], analyses: dict[str, dict]) -> list[dict]:
    """Every (run, selector) row, in plan order."""
    return [
        selector_row(d["run"], name, analyses[d["run"].label])
        for d in done
        if d["run"].label in analyses
        for name in analyses[d["run"].label]["selectors"]
    ]


def _iv(x: Optional[dict]) -> str:
    """``value [lower, upper]`` of an interval dict in percentage points, ``-`` when missing."""
    if not x or x.get("value") is None:
        return "-"
    return f"{100 * x['value']:+.1f} [{pp(x['lower'])}, {pp(x['upper'])}]"


def _number(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ratio(x: Optional[dict]) -> str:
    """``value [lower, upper]`` of a ratio's interval dict, ``-`` when missing."""
    if not x or x.get("value") is None:
        return "-"
    return f"{x['value']:.2f} [{_number(x['lower'])}, {_number(x['upper'])}]"


def table(rows: list[dict]) -> str:
    """The per-run table: accuracy (mean, per phase), the phase gap with its interval, noise floor, permutation p,
    one-sided 95% upper bound (``<=``), minimum detectable gap (``MDE``), verdict, the indexer's final recall."""
    lines = [
        f"{'model/seed':12s} {'steps':>5s} {'train s':>7s} {'mean %':>6s}  "
        f"{'per-phase accuracy % (phase = pos mod 4)':41s} {'phase gap pp [95%]':>19s} {'floor':>5s} {'p':>6s} "
        f"{'<= pp':>5s} {'MDE':>5s} {'verdict':>9s} {'recall':>6s}"
    ]
    for r in rows:
        per = " / ".join(f"{100 * a:.1f}" for a in r["per_phase"])
        gap = f"{100 * r['phase_gap']:.1f} [{100 * r['phase_gap_lower']:.1f}, {100 * r['phase_gap_upper']:.1f}]"
        recall = "-" if r["recall"] is None else f"{r['recall']:.2f}"
        lines.append(
            f"{r['model'] + '/' + str(r['seed']):12s} {r['steps']:5d} {r['train_seconds']:7.0f} "
            f"{100 * r['mean']:6.1f}  {per:41s} {gap:>19s} {100 * r['phase_noise_floor']:5.1f} "
            f"{r['phase_p_value']:6.4f} "
            f"{pp(r['phase_upper_one_sided']):>5s} {pp(r['phase_mde']):>5s} {str(r['phase_verdict']):>9s} {recall:>6s}"
        )
    return "\n".join(lines)


def selector_table(rows: list[dict]) -> str:
    """The per-selector table at layer ``LAYER``: mean accuracy, paired difference against dense serving of the
    same weights (pp, 95% interval) and its excess at the straddling phase, covered % at the straddling phase and
    at the others, the straddling ratio with interval beside the geometric expectation of a random top-k, and the
    accuracy when covered / missed at the straddling phase (with counts)."""
    lines = [
        f"{'model/seed':10s} {'selector':8s} {'mean %':>6s} {'vs dense pp [95%]':>20s} {'straddle excess pp':>20s} "
        f"{'cov% str/oth':>12s} {'ratio [95%]':>18s} {'geom':>5s}  acc% covered/missed at straddle (n)"
    ]
    for r in rows:
        pr = r["paired"] or {}
        yes, no = r["accuracy_covered_straddle"], r["accuracy_missed_straddle"]
        geo = _number(r["geometric_ratio"])
        lines.append(
            f"{r['model'] + '/' + str(r['seed']):10s} {r['selector']:8s} {100 * r['mean']:6.1f} "
            f"{_iv(pr.get('mean')):>20s} {_iv(pr.get('straddle_excess')):>20s} "
            f"{pp(r['covered_straddle']):>5s}/{pp(r['covered_others']):<6s} {_ratio(r['ratio']):>18s} {geo:>5s}  "
            f"{pp(yes['rate'])}/{pp(no['rate'])} ({yes['n']}/{no['n']})"
        )
    return "\n".join(lines)


def _deficit(r: dict) -> Optional[bool]:
    """C1 of one (run, selector) row: True when the straddling ratio's 95% upper bound lies under the geometric
    ratio, False when its lower bound reaches it, None (undecided) otherwise or without a ratio."""
    ratio, geo = r["ratio"], r["geometric_ratio"]
    if geo is None or ratio.get("upper") is None or ratio.get("lower") is None:
        return None
    return True if ratio["upper"] < geo else (False if ratio["lower"] >= geo else None)


def _cost(r: dict) -> Optional[bool]:
    """C2 of one row: True when the paired straddling excess's 95% upper bound is under 0, False when its interval
    lies within +-``EQUIVALENCE`` (no cost beyond the margin), None otherwise."""
    excess = (r["paired"] or {}).get("straddle_excess") or {}
    lo, hi = excess.get("lower"), excess.get("upper")
    if lo is None or hi is None:
        return None
    return True if hi < 0 else (False if -EQUIVALENCE < lo and hi < EQUIVALENCE else None)


def verdict(these: list[dict]) -> str:
    """docs/selection.md's verdict over the seeds of one (model, selector): ``creates`` when C1 and C2 hold in
    every seed, ``does not create`` when in every seed C1 fails (the ratio reaches the geometric one) and C2 fails
    (the excess lies within the margin), else ``undecided``."""
    c1, c2 = [_deficit(r) for r in these], [_cost(r) for r in these]
    if these and all(c is True for c in c1) and all(c is True for c in c2):
        return "creates"
    if these and all(c is False for c in c1) and all(c is False for c in c2):
        return "does not create"
    return "undecided"


def criteria(rows: list[dict], sel_rows: list[dict]) -> list[Check]:
    """docs/selection.md's criteria, as committed before the results: the preconditions (the control and the dense
    arm learned the task; the random selector's straddling ratio agrees with the geometric expectation), then per
    (model, selector) of ``PRIMARY`` C1 (the straddling phase covered relatively less than by a random top-k: the
    ratio's 95% upper bound under the geometric ratio) and C2 (the paired straddling excess against dense serving
    of the same weights: 95% upper bound under 0), each in every seed, and the verdict."""
    out = []
    for role, floor, what in (("control", CONTROL_LEARNED, "full attention"), ("dense", DENSE_LEARNED, "dense V4")):
        these = [r for r in rows if r["role"] == role]
        if these:
            out.append(
                Check(
                    f"P: {what} learned the task (mean >= {100 * floor:.0f}% in every seed)",
                    all(r["mean"] >= floor for r in these),
                    "; ".join(f"seed {r['seed']}: {100 * r['mean']:.1f}%" for r in these),
                )
            )
    randoms = [r for r in sel_rows if r["selector"] == "random" and r["geometric_ratio"] is not None]
    if randoms:
        out.append(
            Check(
                "P: the random selector's straddling ratio interval contains the geometric ratio (every run)",
                all(r["ratio"]["lower"] <= r["geometric_ratio"] <= r["ratio"]["upper"] for r in randoms),
                "; ".join(
                    f"{r['model']}/{r['seed']}: {_ratio(r['ratio'])} vs {_number(r['geometric_ratio'])}"
                    for r in randoms
                ),
            )
        )
    for model, selector in PRIMARY:
        these = [r for r in sel_rows if r["model"] == model and r["selector"] == selector]
        if not these:
            continue
        who = f"{model} served by {'its trained indexer' if selector == 'model' else selector}"
        out.append(
            Check(
                f"C1 {who}: covers the straddling phase relatively less than a random top-{TOPK} (L{LAYER} ratio's "
                "95% upper bound < the geometric ratio, every seed)",
                all(_deficit(r) is True for r in these),
                "; ".join(
                    f"seed {r['seed']}: {_ratio(r['ratio'])} vs geometric {_number(r['geometric_ratio'])}"
                    for r in these
                ),
            )
        )
        out.append(
            Check(
                f"C2 {who}: costs the straddling phase more accuracy than the others (paired excess against dense "
                "serving: 95% upper bound < 0, every seed)",
                all(_cost(r) is True for r in these),
                "; ".join(f"seed {r['seed']}: {_iv((r['paired'] or {}).get('straddle_excess'))} pp" for r in these),
            )
        )
        out.append(
            Check(
                f"verdict {who}: creates weak phases beyond the geometry", verdict(these) == "creates", verdict(these)
            )
        )
    return out


def plot(rows: list[dict], sel_rows: list[dict], analyses: dict[str, dict], path: Path) -> None:
    """Left: accuracy per phase, one line per run (colour per model, line style per seed). Right: per phase, the
    share of prompts whose target record layer ``LAYER``'s selection covers, per selector (colour) and model (line
    style), mean over seeds, beside the geometric expectation of a random top-k (black, dashed)."""
    import matplotlib.pyplot as plt

    fig, (acc, cov) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ("-", "--", ":", "-.")
    for r in rows:
        colour = plt.cm.tab10(list(MODEL_BY_NAME).index(r["model"]))
        ls = styles[SEEDS.index(r["seed"]) % len(styles)] if r["seed"] in SEEDS else "-"
        acc.plot(
            range(len(r["per_phase"])),
            [100 * a for a in r["per_phase"]],
            ls,
            color=colour,
            marker="o",
            label=f"{r['model']}/seed={r['seed']}",
        )
    names = sorted({(r["model"], r["selector"]) for r in sel_rows})
    selectors = sorted({s for _, s in names})
    for model, selector in names:
        labels = [lab for lab in analyses if lab.startswith(f"{model}/")]
        curves = [
            [p["layers"][LAYER]["covered"]["rate"] for p in analyses[lab]["selectors"][selector]["phases"]]
            for lab in labels
        ]
        mean = [100 * sum(c[i] for c in curves) / len(curves) for i in range(STRIDE)]
        cov.plot(
            range(STRIDE),
            mean,
            "-" if model == "sparse" else "--",
            marker="s",
            color=plt.cm.tab10(selectors.index(selector)),
            label=f"{model}: {selector}",
        )
    geo = [a["geometric"] for a in analyses.values() if a["geometric"] is not None]
    if geo:
        cov.plot(
            range(STRIDE),
            [100 * sum(g["phases"][i]["covered"][LAYER] for g in geo) / len(geo) for i in range(STRIDE)],
            "k--",
            label=f"random top-{TOPK} (geometry)",
        )
    for ax, what in ((acc, "accuracy (%)"), (cov, f"target record covered by L{LAYER}'s selection (%)")):
        ax.set_xlabel(f"phase of the target record (position mod {STRIDE})")
        ax.set_ylabel(what)
        ax.set_ylim(-2, 102)
        ax.set_xticks(range(STRIDE))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    acc.set_title("fixed-query lookup, per phase")
    cov.set_title(f"selection at the query, top-{TOPK} (analysis=selection; mean over seeds)")
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
    analyses = analyse(done, out, args.quick, args.workers, env, clock)
    rows = [row(d) for d in done]
    sel_rows = selector_rows(done, analyses)
    print("\n" + table(rows) + "\n")
    print(selector_table(sel_rows) + "\n")
    found = criteria(rows, sel_rows)
    for c in found:
        print(f"  [{'yes' if c.passed else 'no'}] {c.claim}: {c.detail}")
    png = out / "selection.png"
    plot(rows, sel_rows, analyses, png)
    write_study_record(
        out,
        "selection",
        args.quick,
        clock,
        png,
        {"rows": rows, "selectors": sel_rows, "criteria": [c.__dict__ for c in found]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
