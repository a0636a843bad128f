"""``make selection``: does DeepSeek-V4's top-k selection create weak phases beyond the compressor's own geometry?
(docs/selection.md)

One CPU task where V4's selection is not degenerate (``conf/experiment/select_wide.yaml``: make demo's model and
split records, 16 of them from 64 keys and 16 queries, behind a 207-token pad budget, so the final query of a
273-token evaluation prompt sees 68 compressed entries at S = 4, of which top-``TOPK`` keeps 2 and the sparse
stage's indexer KL is not zero) and three models, ``SEEDS`` each, with the SAME query path (V4's low-rank latent,
rank 32) wherever attention is compressed:

- ``dense``: V4's dense CSA (``deepseek_v4_csa``), trained dense, then SERVED on the same prompts by every
  selector of ``eval.py analysis=selection`` at top-``TOPK``: ``dense`` (every visible entry, the reference),
  ``oracle`` (the top-k of the layer's own dense attention mass: a perfect selector imposed at inference, not a
  training regime), ``random`` (k visible entries uniformly, seeded), ``recency`` (the k most recent) and the
  positive control ``oracle_drop`` (the oracle dropping the straddling record with probability ``DROP``: the
  miss odds ratio must find it);
- ``sparse``: the same layer with V4's lightning indexer (``deepseek_v4_csa_sparse``), trained by
  ``trainer.indexer.recipe=v32`` (its stages: ``ckv.train.indexer.RECIPES``; what is DeepSeek-V3.2's:
  docs/selection.md, "Recipe, sourced"), served by its trained
  indexer (``model``), by the same five selectors on its own weights (the oracle on the indexer's schedule) and by
  its indexer fake-quantised to FP8 and FP4 (``QUANTISED``: how many selections change against fp32, and at which
  phase);
- ``full``: the full-attention control, which must learn the task (mean >= ``CONTROL_FLOOR`` in every seed).

The runs, seeds, top-k, selectors and the criteria's numbers are ``conf/study/selection.yaml``; the study runner
(``ckv.apps.study``) trains each with ``train.py`` and evaluates it with ``eval.py``'s fixed-query position-matched
lookup, then this module analyses it with ``eval.py analysis=selection`` on the same prompts. Printed: the per-run
table (mean, per-phase accuracy, phase gap with interval, noise floor, verdict), the per-selector
table (paired accuracy difference against dense serving of the same weights, covered rate at the straddling phase
and at the others, their ratio beside the geometric expectation of a random top-k, the miss odds ratio with
interval beside its coverage-matched null (``ckv.analysis.selection_stats.miss_odds_ratio``: the statistic that is
fair at any coverage, which the criteria judge), and the accuracy when the record was covered vs missed at the
straddling phase) and the criteria of docs/selection.md (``criteria``, committed before any result of this
design); one plot, everything under ``outputs/selection/``.

    python -m ckv.apps.selection            # make selection (9 runs; time in the Makefile and docs/selection.md)
    python -m ckv.apps.selection --quick    # the first seed, a few steps per model: checks the pipeline only

The criteria are reported, not enforced: the run exits 0 when every command succeeded and non-zero when one failed.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from ckv.analysis import selection_hooks
from ckv.analysis.plots import plot_selection_study
from ckv.apps.study import study_arguments
from ckv.apps.study_config import TASK, Run, load_study
from ckv.apps.study_results import (
    COMPACT_PHASE_COLUMNS,
    Check,
    Column,
    check_lines,
    pp,
    result_row,
    write_study_record,
    write_table,
)
from ckv.apps.study_run import Timer, eval_commands, run_plan, run_unless_current, start
from ckv.eval.flatness import se_from_interval
from ckv.eval.stats import Z95
from ckv.io.layout import analysis_file, eval_dir
from ckv.io.results import read_json
from ckv.train.metrics import read_metrics

STUDY = load_study("selection")  # conf/study/selection.yaml: the runs, seeds and the criteria's numbers
SEEDS = STUDY.seeds
STRIDE, TOPK, LAYER, DROP = (STUDY.params[k] for k in ("stride", "topk", "layer", "drop"))
CONTROL_FLOOR, DENSE_LEARNED, ODDS_MARGIN, EQUIVALENCE = (
    STUDY.criteria[k] for k in ("control_learned", "dense_learned", "odds_margin", "equivalence")
)
PRIMARY = tuple(tuple(pair) for pair in STUDY.params["primary"])
SELECTORS = {name: tuple(names) for name, names in STUDY.params["selectors"].items()}  # per model; control: none
MODELS = tuple(dict.fromkeys(r.name for r in STUDY.runs))  # the model names in plan order
IMPOSED = SELECTORS["dense"]  # the selectors every compressed run is served by
QUANTISED = tuple(s for s in SELECTORS["sparse"] if s in selection_hooks.QUANTISED)  # reported, not judged


QUICK_DROPS = ("task.n_base=", "task.modulus=")  # quick: QUICK_EVAL's base examples at the task's 8 shifts


def plan(seeds: tuple[int, ...], quick: bool = False) -> tuple[Run, ...]:
    """The study's runs of ``seeds``, named after the model (``<out>/runs/<model>/seed=<seed>``), evaluated on
    ``params.n_base`` base examples at the study's modulus (quick: ``QUICK_EVAL``'s base examples at the task's own
    modulus, 8 shifts each: shorter prompts, the pipeline only)."""
    return tuple(
        dataclasses.replace(
            r, eval_overrides=tuple(o for o in r.eval_overrides if not (quick and o.startswith(QUICK_DROPS)))
        )
        for r in STUDY.runs
        if r.seed in seeds
    )


def analyse(done: list[dict], out: Path, quick: bool, workers: int, env: dict, clock: Timer) -> dict[str, dict]:
    """``eval.py analysis=selection`` on the same prompts as the evaluation, every compressed run served by its
    model's selectors at top-``TOPK`` (an analysis still current for its command is reused: ``run_unless_current``).
    Returns the results by run label."""
    todo = [d for d in done if SELECTORS.get(d["run"].name)]

    def one(d: dict) -> tuple[str, dict]:
        run = d["run"]
        selectors = ",".join(SELECTORS[run.name])
        _, cmd = eval_commands(run, out, quick)[TASK]  # the evaluation's own command: the same prompts
        path = analysis_file(eval_dir(Path(d["dir"]), TASK), "selection")
        cmd = [
            *cmd,
            "analysis=selection",
            f"analysis.selectors=[{selectors}]",
            f"analysis.topk={TOPK}",
            f"analysis.drop={DROP}",
        ]
        run_unless_current(cmd, out / "logs" / f"selection_{run.name}_seed{run.seed}.log", env, Path(d["dir"]), path)
        res = read_json(path)["analysis"]["results"]
        print(f"[{clock}] {run.label}: selection analysis done", flush=True)
        return run.label, res

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, todo))


def final_recall(run_dir: Path) -> Optional[float]:
    """The indexer's recall at the last step that logged it (``metrics.jsonl``), None without an indexer."""
    logged = [r["indexer_recall"] for r in read_metrics(run_dir) if r.get("indexer_recall") is not None]
    return logged[-1] if logged else None


def row(d: dict) -> dict:
    """One run's row: the studies' one results row (``ckv.apps.study_results.result_row``), its model and the indexer's
    final recall."""
    return {"model": d["run"].name, **result_row(d), "recall": final_recall(Path(d["dir"]))}


def selector_row(run: Run, name: str, analysis: dict, layer: int = LAYER) -> dict:
    """One (run, selector) row of ``analysis=selection``'s results at ``layer``: mean accuracy, the paired
    difference against the reference and its straddling excess, the covered rate at the straddling phases and at
    the others, the straddling ratio beside the geometric one, and the accuracy when covered / missed at the
    straddling phases (pooled counts), the miss odds ratio with its coverage-matched null (``miss_odds``); for a
    quantised indexer, per phase the share of final-query selections that
    differ from the fp32 indexer's (``changed``)."""
    res, straddling = analysis["selectors"][name], analysis["straddling_phases"]
    cells = [(p["phase"] in straddling, p["layers"][layer]) for p in res["phases"]]

    def pooled(key: str, at_straddle: bool) -> dict:
        n = sum(c[key]["n"] for s, c in cells if s == at_straddle)
        k = sum(c[key]["successes"] for s, c in cells if s == at_straddle)
        return {"n": n, "rate": k / n if n else None}

    geo = analysis["geometric"]
    quantised = (analysis.get("quantisation") or {}).get(name)  # per phase: selections changed against fp32
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
        "miss_odds": res["layers"][layer].get("miss_odds_ratio"),
        "accuracy_covered_straddle": pooled("accuracy_covered", True),
        "accuracy_missed_straddle": pooled("accuracy_missed", True),
        "changed": None if quantised is None else [p["layers"][layer] for p in quantised["phases"]],
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


def _odds(x: Optional[dict]) -> str:
    """``value [lower, upper] / null`` of a miss odds ratio, ``-`` when missing (``inf`` where no prompt at the
    other phases was missed or every straddling one was)."""
    if not x or x.get("null") is None:
        return "-"
    return f"{_ratio(x) if x.get('value') is not None else 'inf'} / {x['null']:.2f}"


COLUMNS = (
    Column("model/seed", lambda r: f"{r['model']}/{r['seed']}", 12, "<", ""),
    Column("steps", lambda r: f"{r['steps']:d}", 5),
    Column("train s", lambda r: f"{r['train_seconds']:.0f}", 7),
    Column("mean %", lambda r: f"{100 * r['mean']:.1f}", 6),
    Column(
        "per-phase accuracy % (phase = pos mod 4)",
        lambda r: " / ".join(f"{100 * a:.1f}" for a in r["per_phase"]),
        41,
        "<",
        "  ",
    ),
    *COMPACT_PHASE_COLUMNS,
    Column("recall", lambda r: "-" if r["recall"] is None else f"{r['recall']:.2f}", 6),
)


def table(rows: list[dict]) -> str:
    """The per-run table (``ckv.apps.study_results.write_table``): accuracy (mean, per phase), the phase gap with its
    interval, noise floor, permutation p, one-sided 95% upper bound (``<=``), minimum detectable gap (``MDE``),
    verdict, the indexer's final recall."""
    return write_table(rows, COLUMNS)


def selector_table(rows: list[dict]) -> str:
    """The per-selector table at layer ``LAYER``: mean accuracy, paired difference against dense serving of the
    same weights (pp, 95% interval) and its excess at the straddling phase, covered % at the straddling phase and
    at the others, the straddling ratio with interval beside the geometric expectation of a random top-k, the miss
    odds ratio with interval and its coverage-matched null, and the accuracy when covered / missed at the
    straddling phase (with counts)."""
    lines = [
        f"{'model/seed':10s} {'selector':11s} {'mean %':>6s} {'vs dense pp [95%]':>20s} {'straddle excess pp':>20s} "
        f"{'cov% str/oth':>12s} {'ratio [95%]':>18s} {'geom':>5s} {'miss OR [95%] / null':>25s}  "
        "acc% covered/missed at straddle (n)"
    ]
    for r in rows:
        pr = r["paired"] or {}
        yes, no = r["accuracy_covered_straddle"], r["accuracy_missed_straddle"]
        geo = _number(r["geometric_ratio"])
        lines.append(
            f"{r['model'] + '/' + str(r['seed']):10s} {r['selector']:11s} {100 * r['mean']:6.1f} "
            f"{_iv(pr.get('mean')):>20s} {_iv(pr.get('straddle_excess')):>20s} "
            f"{pp(r['covered_straddle']):>5s}/{pp(r['covered_others']):<6s} {_ratio(r['ratio']):>18s} {geo:>5s} "
            f"{_odds(r.get('miss_odds')):>25s}  "
            f"{pp(yes['rate'])}/{pp(no['rate'])} ({yes['n']}/{no['n']})"
        )
    return "\n".join(lines)


def quantisation_table(rows: list[dict]) -> str:
    """Per run served by a quantised indexer: the share of final-query selections (layer ``LAYER``) that differ
    from the fp32 indexer's, per phase, with Wilson intervals."""
    lines = [f"{'model/seed':10s} {'selector':11s}  selections changed against fp32, % [95%], per phase"]
    for r in (r for r in rows if r["changed"] is not None):
        cells = "  ".join(
            f"{i}: {pp(c['rate'])} [{pp(c['lower'])}, {pp(c['upper'])}]" for i, c in enumerate(r["changed"])
        )
        lines.append(f"{r['model'] + '/' + str(r['seed']):10s} {r['selector']:11s}  {cells}")
    return "\n".join(lines)


def _deficit(r: dict) -> Optional[bool]:
    """C1 of one (run, selector) row: True when the miss odds ratio's 95% lower bound lies above its
    coverage-matched null (the straddling record missed relatively more than by a phase-blind selector of the same
    coverage), False when its upper bound lies under ``ODDS_MARGIN`` times the null (no deficit that large), None
    (undecided) otherwise or without the statistic."""
    odds = r.get("miss_odds") or {}
    lo, hi, null = odds.get("lower"), odds.get("upper"), odds.get("null")
    if null is None or lo is None or hi is None:
        return None
    return True if lo > null else (False if hi < ODDS_MARGIN * null else None)


def pooled_excess(these: list[dict]) -> dict:
    """C2's statistic over the seeds of one (model, selector): the mean of the seeds' paired straddling excesses,
    ``{"value", "lower", "upper"}``, its 95% interval from their own (each interval read as a normal standard error,
    ``se_from_interval``; the seeds' models independent); None values when a seed has none."""
    cells = [(r["paired"] or {}).get("straddle_excess") or {} for r in these]
    if not cells or any(c.get(k) is None for c in cells for k in ("value", "lower", "upper")):
        return {"value": None, "lower": None, "upper": None}
    value = sum(c["value"] for c in cells) / len(cells)
    se = math.sqrt(sum(se_from_interval(c["lower"], c["upper"]) ** 2 for c in cells)) / len(cells)
    return {"value": value, "lower": value - Z95 * se, "upper": value + Z95 * se}


def _cost(excess: dict) -> Optional[bool]:
    """C2 of a straddling excess (``pooled_excess``): True when its 95% upper bound is under 0, False when its
    interval lies within +-``EQUIVALENCE`` (no cost beyond the margin), None otherwise."""
    lo, hi = excess.get("lower"), excess.get("upper")
    if lo is None or hi is None:
        return None
    return True if hi < 0 else (False if -EQUIVALENCE < lo and hi < EQUIVALENCE else None)


def verdict(these: list[dict]) -> str:
    """docs/selection.md's verdict over the seeds of one (model, selector): ``creates`` when C1 holds in every seed
    and C2 over the seeds (``pooled_excess``), ``does not create`` when C1 fails in every seed (the miss odds
    ratio's upper bound under ``ODDS_MARGIN`` times its null) and C2 fails (the pooled excess within the margin),
    else ``undecided``."""
    c1, c2 = [_deficit(r) for r in these], _cost(pooled_excess(these))
    if these and all(c is True for c in c1) and c2 is True:
        return "creates"
    if these and all(c is False for c in c1) and c2 is False:
        return "does not create"
    return "undecided"


def _odds_detail(rows: list[dict]) -> str:
    """``model/seed: OR [95%] / null`` of each row."""
    return "; ".join(f"{r['model']}/{r['seed']}: {_odds(r.get('miss_odds'))}" for r in rows)


def _on_null(r: dict) -> bool:
    """Whether a row's miss odds ratio interval contains its null."""
    odds = r.get("miss_odds") or {}
    lo, hi, null = odds.get("lower"), odds.get("upper"), odds.get("null")
    return None not in (lo, hi, null) and lo <= null <= hi


def criteria(rows: list[dict], sel_rows: list[dict]) -> list[Check]:
    """docs/selection.md's criteria, as committed before the results of this design (issue 40): the preconditions
    (P1 the control learned the task; P2 dense V4, and the sparse model served dense, learned it; P3 the random
    selector's miss odds ratio interval contains its null; P4 the positive control ``oracle_drop`` is detected, its
    interval above its null, in every run), then per (model, selector) of ``PRIMARY`` C1 (the miss odds ratio's
    95% lower bound above its coverage-matched null, in every seed) and C2 (the paired straddling excess against
    dense serving of the same weights, its mean over the seeds: 95% upper bound under 0), and the verdict: "no
    verdict" while any precondition is not met, whatever C1 and C2 read (both are still printed)."""
    out = []
    learned = [
        ("full attention", [r for r in rows if r["role"] == "control"], CONTROL_FLOOR),
        ("dense V4", [r for r in rows if r["role"] == "dense"], DENSE_LEARNED),
        ("sparse V4 served dense", [r for r in sel_rows if r["model"] == "sparse" and r["selector"] == "dense"],
         DENSE_LEARNED),
    ]  # fmt: skip
    for what, these, floor in learned:
        if these:
            out.append(
                Check(
                    f"P: {what} learned the task (mean >= {100 * floor:.0f}% in every seed)",
                    all(r["mean"] >= floor for r in these),
                    "; ".join(f"seed {r['seed']}: {100 * r['mean']:.1f}%" for r in these),
                )
            )
    randoms = [r for r in sel_rows if r["selector"] == "random"]
    if randoms:
        out.append(
            Check(
                "P: the random selector's miss odds ratio interval contains its null (every run)",
                all(_on_null(r) for r in randoms),
                _odds_detail(randoms),
            )
        )
    controls = [r for r in sel_rows if r["selector"] == selection_hooks.CONTROL]
    if controls:
        out.append(
            Check(
                f"P: the positive control ({selection_hooks.CONTROL}, drop {DROP}) is detected: its miss odds "
                "ratio's 95% lower bound above its null (every run)",
                all(_deficit(r) is True for r in controls),
                _odds_detail(controls),
            )
        )
    unmet = [c for c in out if not c.passed]  # the preconditions: no verdict without every one (docs/selection.md)
    for model, selector in PRIMARY:
        these = [r for r in sel_rows if r["model"] == model and r["selector"] == selector]
        if not these:
            continue
        who = f"{model} served by {'its trained indexer' if selector == 'model' else selector}"
        out.append(
            Check(
                f"C1 {who}: misses the straddling record relatively more than a phase-blind top-{TOPK} of its "
                f"coverage (L{LAYER} miss odds ratio's 95% lower bound > its null, every seed)",
                all(_deficit(r) is True for r in these),
                _odds_detail(these),
            )
        )
        seeds = "; ".join(f"seed {r['seed']}: {_iv((r['paired'] or {}).get('straddle_excess'))}" for r in these)
        out.append(
            Check(
                f"C2 {who}: costs the straddling phase more accuracy than the others (paired excess against dense "
                "serving, the mean over the seeds: 95% upper bound < 0)",
                _cost(pooled_excess(these)) is True,
                f"mean {_iv(pooled_excess(these))} pp ({seeds})",
            )
        )
        judged = (
            verdict(these)
            if not unmet
            else f"no verdict: a precondition is not met (C1 and C2 read {verdict(these)!r})"
        )
        out.append(Check(f"verdict {who}: creates weak phases beyond the geometry", judged == "creates", judged))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = study_arguments(__doc__, STUDY.out, "the first seed only, a few steps per model: pipeline check only")
    args = args.parse_args(argv)
    out = Path(args.out).resolve()
    runs = plan(SEEDS[:1] if args.quick else SEEDS, args.quick)
    clock, env = start(STUDY, runs, out, args.quick, args.workers)
    done = run_plan(runs, out, args.quick, args.workers, env, clock)
    analyses = analyse(done, out, args.quick, args.workers, env, clock)
    rows = [row(d) for d in done]
    sel_rows = selector_rows(done, analyses)
    print("\n" + table(rows) + "\n")
    print(selector_table(sel_rows) + "\n")
    print(quantisation_table(sel_rows) + "\n")
    found = criteria(rows, sel_rows)
    print("\n".join(check_lines(found, ("yes", "no"))))
    png = out / "selection.png"
    plot_selection_study(
        rows, sel_rows, analyses, png, models=MODELS, seeds=SEEDS, layer=LAYER, stride=STRIDE, topk=TOPK, solid="sparse"
    )
    write_study_record(
        out,
        STUDY.record,
        args.quick,
        clock,
        png,
        {"rows": rows, "selectors": sel_rows, "criteria": [c.__dict__ for c in found]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
