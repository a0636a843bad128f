"""``conf/study/mitigate.yaml``'s report (``make mitigate``, docs/mitigation.md): every inference-time mitigation of
``ckv.eval.mitigation`` on every compressed model of make paper and on transformers' tiny DeepSeek-V4 of make demo-v4
(its lookup and the needle test), each against the same model unmitigated, with the criteria committed in the YAML.

The generic command (``python -m ckv.apps.study mitigate``) calls ``report`` after the runs; ``python -m
ckv.apps.mitigate --costs`` prints, before any training, what each mitigation costs each ckv model of the study by
ckv's accounting (``costs``: the numbers its evaluations record); ``--summary <mitigate.json>`` prints a finished
study as a Markdown table (``summary``, docs/mitigation.md's). Per model,
padding and mitigation it prints the unmitigated and the mitigated evaluation's worst group, mean and gap (mod the
task's modulus, cluster-bootstrap intervals), the paired differences of the worst group (95% interval) and of the
mean (one-sided 95% lower bound), from ``ckv.analysis.paired`` (the same prompts, one resample of the key->value
mappings per replicate for both), the prefill FLOPs and KV-cache ratios the evaluation recorded (ckv's accounting),
and the verdicts: a mitigation **works** on an evaluation when the worst group's paired difference is above 0 and the
mean falls by no more than ``criteria.mean_drop``; it is **useful** in a padding when it works on more than half of
the learned tuning models at no more than ``criteria.useful_flops`` times the prefill FLOPs. Candidate settings of
one mitigation (``params.tuning``) are chosen on the tuning runs (seed 42) by the committed rule (``choose``) and the
choice is confirmed on the other seeds (roles ``confirm``, ``fresh``). One figure: the worst-group gain against the
prefill FLOPs ratio, one point per model x mitigation x padding.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ckv.analysis.paired import interval, paired_replicates
from ckv.apps.paper import measured
from ckv.apps.study_config import ROOT, Study, load_study
from ckv.apps.study_results import Check, check_lines, pp
from ckv.attention import model_phase_stride
from ckv.data import lookup_format_for
from ckv.eval import ModelFacts, RunOptions, task_from_dict, task_type
from ckv.eval.mitigation import config_cost, plan_mitigation
from ckv.eval.plots import plot_gain_vs_cost
from ckv.eval.stats import StatsOptions
from ckv.eval.summary import results_file
from ckv.io.results import RESULTS_CSV, read_int_columns, read_json
from ckv.train.plan import compose_train_config, model_config

NONE = "none"
TUNE, CONFIRM, V4 = ("tune",), ("confirm", "fresh"), ("v4", "v4_needle")  # the roles of conf/study/mitigate.yaml
CLAIM_ROLES = TUNE + CONFIRM + V4


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of the study: the key of the eval.py run it reads (``prefix_shift_mean``), its padding, its
    mitigation's label (``none`` for the unmitigated ones, which carry the padding's name alone) and ``rule``: for a
    label scored from another evaluation's runs (``params.also``), the combine rule it reads from that run's
    ``also`` (``mitigation.also``), else ``None``."""

    key: str
    padding: str
    mitigation: str
    rule: Optional[str] = None

    @property
    def column(self) -> str:
        """Its per-prompt 0/1 column in the run's results.csv."""
        return "correct" if self.rule is None else f"correct_{self.rule}"

    def report(self, report: dict) -> dict:
        """Its statistics in the run's ``report``: the report itself, or the rule's from the same runs."""
        if self.rule is None:
            return report
        also = report.get("also") or {}
        if self.rule not in also:
            raise ValueError(
                f"evaluation {self.key} has no results of combine rule {self.rule} (its mitigation.also: "
                f"{sorted(also)}): params.also.{self.mitigation} reads them"
            )
        return also[self.rule]


def evaluations(study: Study) -> list[Evaluation]:
    """The study's evaluations by padding (``params.paddings``) and mitigation label (the key's rest), each followed
    by the labels scored from its runs (``params.also``: label -> [that evaluation's label, its rule])."""
    paddings, out = study.params["paddings"], []
    also = study.params.get("also") or {}
    for label, (source, _) in also.items():
        missing = [f"{p}_{source}" for p in paddings if f"{p}_{source}" not in study.evals]
        if missing:
            raise ValueError(f"params.also.{label} reads evaluation(s) {missing}, which the study lacks")
    for key in study.evals:
        padding = next(p for p in paddings if key == p or key.startswith(p + "_"))
        own = key[len(padding) + 1 :] or NONE
        out.append(Evaluation(key, padding, own))
        out += [Evaluation(key, padding, label, rule) for label, (source, rule) in also.items() if source == own]
    return out


def paired(
    base_csv: Path,
    other_csv: Path,
    modulus: int,
    options: StatsOptions,
    level: float,
    mean_drop: float,
    column: str = "correct",
) -> dict:
    """The paired worst-group and mean differences (fractions) of two evaluations of the same prompts (their
    ``results.csv``; the other's 0/1 ``column``): the observed values, the worst group's two-sided ``level``
    interval and the mean's one-sided lower bound, from the same bootstrap replicates (``paired_replicates``), and
    whether the mitigated one works."""
    cols = ("base", "shift", "target_position", "residue")
    base, other = read_int_columns(base_csv, (*cols, "correct")), read_int_columns(other_csv, (*cols, column))
    if any(not np.array_equal(base[c], other[c]) for c in cols):
        raise ValueError(f"{other_csv} does not score the prompts of {base_csv}: no paired difference")
    groups, clusters = base["residue"], base["base"]
    correct = [base["correct"], other[column]]
    boot = paired_replicates(correct, groups, modulus, clusters, options)  # (n_bootstrap, 2, groups)
    observed = np.stack([[c[groups == g].mean() for g in range(modulus)] for c in correct])  # (2, groups)
    worst = boot.min(-1)[:, 1] - boot.min(-1)[:, 0]
    mean = boot.mean(-1)[:, 1] - boot.mean(-1)[:, 0]
    d_worst = interval(worst, observed[1].min() - observed[0].min(), level)
    d_mean = float(observed[1].mean() - observed[0].mean())
    mean_lower = float(np.percentile(mean, 100 * (1 - level)))  # one-sided lower bound
    works = d_worst["lower"] is not None and d_worst["lower"] > 0 and mean_lower >= -mean_drop
    return {"worst_diff": d_worst, "mean_diff": d_mean, "mean_diff_lower": mean_lower, "works": bool(works)}


def rows(study: Study, done: list[dict], quick: bool) -> list[dict]:
    """One row per finished run, padding and mitigation: the run, its role, the evaluation's mean, worst group and
    gap (``measured``), and for a mitigated one its paired differences against the padding's unmitigated
    evaluation, its verdict and its cost ratios."""
    c, evals = study.criteria, evaluations(study)
    options = StatsOptions(n_bootstrap=200 if quick else StatsOptions().n_bootstrap)
    out = []
    for d in done:
        run, task = d["run"], d["run"].task or study.task
        csvs = {e.key: results_file(d["dir"], f"{task}_{e.key}").with_name(RESULTS_CSV) for e in evals}
        for e in evals:
            run_report = d["evaluations"][e.key]
            report = e.report(run_report)
            row = {"label": run.label, "role": run.role, "task": task, "padding": e.padding,
                   "mitigation": e.mitigation, **measured(report)}  # fmt: skip
            best = report["headline"]["worst_residue_accuracy"] + report["headline"]["residue_gap"]
            row["learned"] = best >= c["learned_best"]
            if e.mitigation != NONE:
                cost = (run_report.get("mitigation") or {}).get("cost") or {}
                row.update(flops_ratio=cost.get("flops_ratio"), kv_ratio=cost.get("kv_ratio"))
                args = (report["modulus"], options, c["level"], c["mean_drop"], e.column)
                row.update(paired(csvs[e.padding], csvs[e.key], *args))
            out.append(row)
    return out


def _cell(v: tuple) -> str:
    value, lo, hi = v
    return "n/a" if value is None else f"{pp(value)} [{pp(lo)}, {pp(hi)}]"


def _paired_cells(r: dict) -> tuple[str, str]:
    """A mitigated row's paired differences as printed: the worst group's ``gain [lower, upper]`` and the mean's
    ``change (one-sided lower bound)``, in pp."""
    w = r["worst_diff"]
    return (
        f"{pp(w['value'])} [{pp(w['lower'])}, {pp(w['upper'])}]",
        f"{pp(r['mean_diff'])} ({pp(r['mean_diff_lower'])})",
    )


def _ratio(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def table(rows_: list[dict]) -> str:
    """The table: per run and padding the unmitigated row, then one row per mitigation with its paired
    differences, cost ratios and verdict."""
    head = (
        f"{'run':24s} {'padding':11s} {'mitigation':11s} {'worst %':>18s} {'mean %':>18s} {'gap pp':>18s} "
        f"{'d worst pp [95%]':>22s} {'d mean pp (>=)':>15s} {'FLOPs x':>8s} {'KV x':>6s}  verdict"
    )
    lines = [head]
    for r in rows_:
        cells = f"{r['label']:24s} {r['padding']:11s} {r['mitigation']:11s} {_cell(r['worst']):>18s} "
        cells += f"{_cell(r['mean']):>18s} {_cell(r['gap']):>18s}"
        if r["mitigation"] == NONE:
            lines.append(cells + ("" if r["learned"] else f" {'':>22s} {'':>15s} {'':>8s} {'':>6s}  not learned"))
            continue
        diff, mean = _paired_cells(r)
        verdict = "works" if r["works"] else "does not work"
        lines.append(
            cells + f" {diff:>22s} {mean:>15s} {_ratio(r['flops_ratio']):>8s} {_ratio(r['kv_ratio']):>6s}  {verdict}"
        )
    return "\n".join(lines)


def _mitigated(rows_: list[dict], roles: tuple[str, ...]) -> list[dict]:
    """The mitigated rows of learned unmitigated models of ``roles``."""
    learned = {(r["label"], r["padding"]) for r in rows_ if r["mitigation"] == NONE and r["learned"]}
    return [
        r for r in rows_ if r["mitigation"] != NONE and r["role"] in roles and (r["label"], r["padding"]) in learned
    ]


def choose(rows_: list[dict], candidates: list[str], roles: tuple[str, ...]) -> tuple[str, str, bool]:
    """The committed tuning rule: among a mitigation's ``candidates`` (labels), the one that works on the most
    learned evaluations of the tuning ``roles`` (both paddings together), ties to the lower median prefill FLOPs
    ratio, then to the order of ``candidates``; returns it, one line saying why, and whether any learned tuning
    evaluation decided it (else it is the first listed)."""
    scored = []
    for i, name in enumerate(candidates):
        own = [r for r in _mitigated(rows_, roles) if r["mitigation"] == name]
        ratios = [r["flops_ratio"] for r in own if r["flops_ratio"] is not None]
        scored.append(
            (-sum(r["works"] for r in own), float(np.median(ratios)) if ratios else np.inf, i, name, len(own))
        )
    best = min(scored)
    why = "; ".join(f"{n}: works on {-w} of {k}" for w, _, _, n, k in scored)
    return best[3], why, any(k for *_, k in scored)


def checks(study: Study, rows_: list[dict]) -> tuple[list[Check], dict[str, str]]:
    """The verdicts by the committed criteria: per mitigation (its chosen candidate) and padding, useful on the
    tuning runs and confirmed on the confirmation runs; per DeepSeek-V4 evaluation, whether it works. Returns the
    checks and the chosen candidate of each tuned mitigation."""
    c, p = study.criteria, study.params
    chosen = {m: choose(rows_, list(cands), TUNE) for m, cands in (p.get("tuning") or {}).items()}
    tuned = {name for cands in (p.get("tuning") or {}).values() for name in cands}
    labels = sorted({r["mitigation"] for r in rows_ if r["mitigation"] != NONE} - tuned) + [
        name for name, _, _ in chosen.values()
    ]
    out = [  # a choice; undecided when no learned tuning model made it
        Check(f"tuning ({m}): chosen {name}", decided, why, decided=decided)
        for m, (name, why, decided) in chosen.items()
    ]
    for name in labels:
        for padding in p["paddings"]:
            own = [r for r in _mitigated(rows_, TUNE) if r["mitigation"] == name and r["padding"] == padding]
            good = [
                r for r in own if r["works"] and r["flops_ratio"] is not None and r["flops_ratio"] <= c["useful_flops"]
            ]
            out.append(
                Check(
                    f"{name} {padding}: useful (works on more than half of the learned tuning models at <= "
                    f"{c['useful_flops']:g}x prefill FLOPs)",
                    len(good) * 2 > len(own),
                    f"works at that cost on {len(good)} of {len(own)}: {', '.join(r['label'] for r in good) or '-'}",
                    decided=bool(own),
                )
            )
            conf = [r for r in _mitigated(rows_, CONFIRM) if r["mitigation"] == name and r["padding"] == padding]
            out.append(
                Check(
                    f"{name} {padding}: confirmed on the confirmation seeds (works on more than half)",
                    sum(r["works"] for r in conf) * 2 > len(conf),
                    f"works on {sum(r['works'] for r in conf)} of {len(conf)} learned: "
                    + ", ".join(f"{r['label']} {'yes' if r['works'] else 'no'}" for r in conf),
                    decided=bool(conf),
                )
            )
    learned = {(r["label"], r["padding"]) for r in rows_ if r["mitigation"] == NONE and r["learned"]}
    for r in rows_:
        if r["mitigation"] != NONE and r["role"] in V4:
            w, ok = r["worst_diff"], (r["label"], r["padding"]) in learned
            out.append(
                Check(
                    f"{r['label']} {r['task']} {r['padding']}: {r['mitigation']} works",
                    r["works"] and ok,
                    ("" if ok else "not learned (unmitigated best group under learned_best): ")
                    + f"worst group {pp(w['value'])} pp [{pp(w['lower'])}, {pp(w['upper'])}], mean "
                    f"{pp(r['mean_diff'])} pp (one-sided lower bound {pp(r['mean_diff_lower'])})",
                    decided=ok,
                )
            )
    return out, {m: name for m, (name, _, _) in chosen.items()}


def report(study: Study, done: list[dict], out: Path, quick: bool) -> tuple[list[Check], dict]:
    """Print and write (``<out>/mitigate_table.txt``) the table, the verdicts and the figure
    (``<out>/mitigate_gain_cost.png``); return the verdicts as checks and, for the record, the rows and the figure."""
    rows_ = rows(study, done, quick)
    found, chosen = checks(study, rows_)
    points = [
        {**r, "gain": r["worst_diff"]["value"], "gain_lower": r["worst_diff"]["lower"],
         "gain_upper": r["worst_diff"]["upper"]}
        for r in rows_
        if r["mitigation"] != NONE and r["flops_ratio"] is not None and r["worst_diff"]["value"] is not None
    ]  # fmt: skip
    figure = plot_gain_vs_cost(points, out / "mitigate_gain_cost.png")
    text = [table(rows_), *check_lines(found, ("PASS", "FAIL", "undecided")), f"figure: {figure}"]
    print("\n" + "\n".join(text) + "\n")
    (out / "mitigate_table.txt").write_text("\n".join(text) + "\n")
    return found, {"mitigation_rows": rows_, "chosen": chosen, "figures": {"gain_cost": str(figure)}}


def costs(study: Study) -> list[dict]:
    """What each mitigation of the study costs each of its ckv models (no weights, no training): the run's config as
    train.py composes it, the evaluation as eval.py composes it (its task, overrides and mitigation), the prompts
    built from the run's lookup layout, and ``ckv.eval.mitigation.config_cost``: one row per run and mitigated
    evaluation with the prompt length and the prefill FLOPs and KV-cache ratios. transformers models (``model=hf``)
    are left out: their FLOPs are counted when they run."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    out = []
    for run in study.runs:
        if "model=hf" in run.eval_overrides:
            continue
        train = compose_train_config([f"experiment={run.experiment}", *run.train_overrides])
        fmt = lookup_format_for(train.data)
        config = model_config(train, fmt.vocab_size)
        facts = ModelFacts(
            name=run.label,
            vocab_size=config.vocab_size,
            max_len=config.max_seq_len,
            stride=model_phase_stride(config),
            lookup=train.data.lookup,
            lookup_format=fmt,
            config=config,
        )
        by_key: dict[str, dict] = {}  # a label read from another evaluation's runs (params.also) costs what it costs
        for e in evaluations(study):
            if e.mitigation == NONE:
                continue
            if e.key not in by_key:
                overrides = [f"task={run.task or study.task}", *run.eval_overrides, *study.evals[e.key]]
                with initialize_config_dir(config_dir=str(ROOT / "conf" / "eval"), version_base="1.3"):
                    c = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
                spec, options = task_from_dict(c["task"]), RunOptions(mitigation=c["mitigation"])
                kind = task_type(spec)
                built = kind.build(spec, facts, 1)
                by_key[e.key] = config_cost(plan_mitigation(options.mitigation, kind, facts, built), config) or {}
            cost = by_key[e.key]
            out.append(
                {"label": run.label, "stride": facts.stride, "evaluation": f"{e.padding}_{e.mitigation}", **cost}
            )
    return out


def summary(rows_: list[dict], mitigations: tuple[str, ...]) -> str:
    """A Markdown table of a study's rows (``mitigate.json``'s ``mitigation_rows``), one line per model x padding:
    the unmitigated worst group (% , "not learned" under the bar), then per mitigation its worst group, the paired
    worst-group gain [95%] and mean change (one-sided lower bound), in pp, "no" where it does not work; then the
    prefill FLOPs / KV ratios of the last mitigation. The table docs/mitigation.md shows."""
    by = {(r["label"], r["padding"], r["mitigation"]): r for r in rows_}
    head = ["model", "padding", "worst, unmitigated %"]
    head += [f"{m}: worst %, gain pp [95%], mean pp (>=)" for m in mitigations] + [f"{mitigations[-1]}: FLOPs x / KV x"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for base in (r for r in rows_ if r["mitigation"] == NONE):
        key = (base["label"], base["padding"])
        cells = [*key, pp(base["worst"][0]) + ("" if base["learned"] else " (not learned)")]
        for m in mitigations:
            r = by[(*key, m)]
            cells.append(f"{pp(r['worst'][0])}, " + ", ".join(_paired_cells(r)) + ("" if r["works"] else " no"))
        cells.append(f"{_ratio(r['flops_ratio'])} / {_ratio(r['kv_ratio'])}")  # the last mitigation's
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ckv.apps.mitigate --costs [--study NAME]``: print ``costs`` of a study (default mitigate);
    ``--summary RECORD [--mitigations A,B]``: print a finished study's record (``mitigate.json``) as ``summary``'s
    Markdown table."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--costs", action="store_true", help="print each mitigation's cost for each ckv model")
    ap.add_argument("--study", default="mitigate", help="the study (conf/study/<name>.yaml)")
    ap.add_argument("--summary", type=Path, help="a finished study's record (outputs/paper/mitigate.json)")
    ap.add_argument(
        "--mitigations", default="shift_mean,dual", help="the summary's mitigations (its evaluation labels)"
    )
    args = ap.parse_args(argv)
    if args.summary is not None:
        rows_ = read_json(args.summary).get("mitigation_rows")
        wanted = tuple(m for m in args.mitigations.split(",") if m)
        have = {r["mitigation"] for r in rows_ or []}
        if not rows_ or not wanted or not set(wanted) <= have:
            ap.error(
                f"--summary {args.summary}: the record has mitigations {sorted(have - {NONE}) or 'none'}; "
                f"--mitigations={args.mitigations} asks for {sorted(set(wanted) - have) or 'nothing'}"
            )
        print(summary(rows_, wanted))
        return 0
    if not args.costs:
        ap.error(
            "nothing to do: give --costs or --summary (the study itself runs with python -m ckv.apps.study mitigate)"
        )
    lines = [f"{'run':32s} {'S':>3s} {'evaluation':24s} {'tokens':>6s} {'prefill FLOPs x':>15s} {'KV cache x':>10s}"]
    for r in costs(load_study(args.study)):
        lines.append(
            f"{r['label']:32s} {r['stride']:>3d} {r['evaluation']:24s} {r['tokens']:>6d} {r['flops_ratio']:>15.3f} "
            f"{r['kv_ratio']:>10.3f}"
        )
    print("\n".join(lines))
    print("counted by ckv.flops (flops_per_token, kv_bytes_per_token at bf16), per prompt of the evaluation's length")
    return 0


if __name__ == "__main__":
    sys.exit(main())
