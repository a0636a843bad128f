"""``conf/study/csa2.yaml``'s report (docs/csa2.md): which of DeepSeek-V4.1's three choices (its ratio-2 compressor,
shared compressed KV, the full-resolution decoder) shrinks the weak spots. Every run's mod-24 numbers with its
costs, the questions' paired differences seed by seed, the claims, and the figures.

Not an app: the generic command (``python -m ckv.apps.study csa2``) calls ``report`` after the runs;
``python -m ckv.apps.csa2 --costs`` prints every variant's costs (Q4) without training. The numbers are make
paper's (``ckv.apps.paper``: its learned bar, its verdict rule, its period check); two runs of one seed are scored
on the same prompts (one evaluation design, one vocabulary), so their per-prompt outcomes pair: each difference's
interval is a cluster bootstrap over the mappings that resamples both at once (``ckv.apps.pretrain.paired``). The
questions' two rules (``shrinks``, ``changes``) and ``closes`` are written in conf/study/csa2.yaml's comments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from ckv.apps.paper import (
    NO_RESULT,
    PADDINGS,
    claim_row,
    control_flat_checks,
    curve_panels,
    learned_runs,
    mean_precondition,
    measured,
    outcome,
    period_check,
    verdict,
    verdict_text,
)
from ckv.apps.pretrain import outcomes, paired
from ckv.apps.study_config import Study, load_study
from ckv.apps.study_results import Check, Column, check_lines, pp, write_table
from ckv.apps.study_run import eval_names
from ckv.attention import model_phase_stride
from ckv.data import lookup_format_for
from ckv.eval.plots import plot_phase_grid, plot_residue_curves
from ckv.flops import flops_per_token, kv_bytes_per_token
from ckv.train.plan import compose_train_config, model_config

Diff = dict  # one paired difference: {"value", "lower", "upper"} (fractions; None where undefined)


def label(name: str, seed: int) -> str:
    """A run's label (``ckv.apps.study_config.Run.label``) from its name and seed."""
    return f"{name}/seed={seed}"


def seeds_of(study: Study) -> dict[str, list[int]]:
    """Run name -> its seeds, in the study's order."""
    out: dict[str, list[int]] = {}
    for r in study.runs:
        out.setdefault(r.name or r.experiment, []).append(r.seed)
    return out


def costs(study: Study) -> dict[str, dict]:
    """Q4, per variant (run name; no weights, no training): the config train.py composes for its first run, and by
    ckv's accounting (``ckv.flops``) its KV-cache bytes per token at bf16 (a shared cache counted once) and its
    forward FLOPs per token, at the recipe's sequence length (``seq_len``: the prompts') and at
    ``params.long_context``; with its layer schedule in short (``layers``) and its phase stride."""
    long = int(study.params["long_context"])
    out: dict[str, dict] = {}
    for run in study.runs:
        name = run.name or run.experiment
        if name in out:
            continue
        train = compose_train_config([f"experiment={run.experiment}", *run.train_overrides])
        config = model_config(train, lookup_format_for(train.data).vocab_size)
        t = train.data.seq_len
        out[name] = {
            "name": name,
            "layers": config.layer_kinds,
            "stride": model_phase_stride(config),
            "seq_len": t,
            "long_context": long,
            "kv_prompt": kv_bytes_per_token(config, t),
            "kv_long": kv_bytes_per_token(config, long),
            "flops_prompt": flops_per_token(config, t).forward,
            "flops_long": flops_per_token(config, long).forward,
        }
    return out


def pairs_of(study: Study) -> list[tuple[str, str]]:
    """Every pair [a, b] the questions and the comparisons name, once each, in the YAML's order."""
    found = [tuple(p) for q in study.params["questions"].values() for p in q["pairs"]]
    found += [tuple(p) for ps in (study.params.get("comparisons") or {}).values() for p in ps]
    return list(dict.fromkeys(found))


def differences(study: Study, done: list[dict]) -> dict[tuple[str, str, int, str], Optional[dict[str, Diff]]]:
    """``(a, b, seed, padding)`` -> the paired differences a - b (mean, worst group, gap over the mod-24 groups;
    ``ckv.apps.pretrain.paired``) for every pair of ``pairs_of`` and every seed both runs have; ``None`` where
    either did not finish that evaluation or the prompts do not pair."""
    names = eval_names(study.task, study.evals)
    by_label = {d["run"].label: d for d in done}
    seeds = seeds_of(study)
    out = {}
    for a, b in pairs_of(study):
        for s in [x for x in seeds.get(a, []) if x in seeds.get(b, [])]:
            da, db = by_label.get(label(a, s)), by_label.get(label(b, s))
            for pad, task_name in names.items():
                diff = None
                if da is not None and db is not None and pad in da["evaluations"] and pad in db["evaluations"]:
                    oa, ob = outcomes(da, task_name), outcomes(db, task_name)
                    modulus = da["evaluations"][pad]["headline"]["modulus"]
                    diff = None if oa is None or ob is None else paired(oa, ob, modulus)
                out[(a, b, s, pad)] = diff
    return out


def _bounded(d: Optional[Diff]) -> bool:
    return d is not None and d.get("lower") is not None and d.get("upper") is not None


def shrinks(diffs: Sequence[Diff], margin: float) -> Optional[bool]:
    """Rule ``shrinks`` on the gap differences a - b of every seed: True when every seed's 95% interval lies under 0;
    False when in every seed it does not (upper bound >= 0) and its lower bound is above ``-margin`` (no seed's gap
    shrinks by ``margin`` or more); None otherwise, with no seed, or an interval not computed."""
    if not diffs or not all(_bounded(d) for d in diffs):
        return None
    if all(d["upper"] < 0 for d in diffs):
        return True
    if all(d["upper"] >= 0 and d["lower"] > -margin for d in diffs):
        return False
    return None


def changes(diffs: Sequence[Diff], margin: float) -> Optional[bool]:
    """Rule ``changes``: True when every seed's 95% interval lies under 0, or every one above 0 (significance
    first); False when every seed's interval lies inside ``(-margin, margin)``; None otherwise, with no seed, or an
    interval not computed."""
    if not diffs or not all(_bounded(d) for d in diffs):
        return None
    if all(d["upper"] < 0 for d in diffs) or all(d["lower"] > 0 for d in diffs):
        return True
    if all(d["lower"] > -margin and d["upper"] < margin for d in diffs):
        return False
    return None


RULES = {"shrinks": shrinks, "changes": changes}


def closes(rows: Sequence[dict], criteria: dict[str, float]) -> Optional[bool]:
    """``closes``: a's gap is closed in every seed (``rows``: a's ``claim_row`` of each seed): True when each is flat
    by make paper's rule (``verdict``), False when one has a significant gap, else None (also with no seed)."""
    found = [verdict(r, criteria) for r in rows]
    if "gap" in found:
        return False
    return True if found and all(v == "flat" for v in found) else None


def _diff_text(d: Optional[Diff]) -> str:
    if not _bounded(d) or d["value"] is None:
        return "n/a"
    return f"{pp(d['value'])} [{pp(d['lower'])}, {pp(d['upper'])}]"


COSTS = ("kv_prompt", "kv_long", "flops_prompt", "flops_long")  # each question's cost ratios a / b


def _ratio(cost: dict, a: str, b: str, key: str) -> str:
    """``cost[a][key] / cost[b][key]`` as ``1.50x`` (``n/a`` for a variant the costs lack)."""
    return f"{cost[a][key] / cost[b][key]:.2f}x" if a in cost and b in cost and cost[b][key] else "n/a"


def _seeded(
    a: str, b: str, pad: str, seeds: list[int], rows: dict, learned: set, diffs: dict
) -> tuple[list[Diff], list[str], bool]:
    """The gap differences of pair (a, b) under ``pad`` for every seed, each seed's detail, and whether every seed
    joins (both runs finished and learned there, the difference computed)."""
    found, parts, usable = [], [], bool(seeds)
    for s in seeds:
        la, lb = label(a, s), label(b, s)
        ra, rb = rows.get(la, {}).get(pad), rows.get(lb, {}).get(pad)
        d = (diffs.get((a, b, s, pad)) or {}).get("gap")
        if ra is None or rb is None:
            parts.append(f"seed {s}: {NO_RESULT}")
            usable = False
        elif (la, pad) not in learned or (lb, pad) not in learned:
            who = [x for x in (la, lb) if (x, pad) not in learned]
            parts.append(f"seed {s}: not learned: {', '.join(who)}")
            usable = False
        elif not _bounded(d):
            parts.append(f"seed {s}: no paired difference (the two evaluations' prompts do not pair)")
            usable = False
        else:
            found.append(d)
            parts.append(
                f"seed {s}: {pp(ra['residue_gap'])} - {pp(rb['residue_gap'])} = {_diff_text(d)} pp"
                + (
                    f" ({pp(-d['value'] / rb['residue_gap'])}% of {b}'s gap closed)"
                    if rb["residue_gap"] > 0 and d["value"] is not None
                    else ""
                )
            )
    return found, parts, usable


def question_checks(
    key: str, spec: dict, pad: str, study: Study, rows: dict, learned: set, diffs: dict, cost: dict
) -> list[Check]:
    """One question under ``pad``: for each of its pairs [a, b], its rule's check (``RULES``) on the gap differences
    of every seed, and with ``closes`` the check that a's gap is closed; undecided unless every seed joins."""
    criteria, margin, out = study.criteria, study.criteria["diff_margin"], []
    seeds = seeds_of(study)
    for a, b in spec["pairs"]:
        common = [s for s in seeds.get(a, []) if s in seeds.get(b, [])]
        found, parts, usable = _seeded(a, b, pad, common, rows, learned, diffs)
        passed = RULES[spec["rule"]](found, margin) if usable else None
        if spec["rule"] == "changes" and passed:
            parts.append("a's gap " + ("smaller" if found[0]["upper"] < 0 else "larger") + " in every seed")
        costs_ = (
            f"{a}/{b}: KV bytes/token {_ratio(cost, a, b, 'kv_prompt')} at the prompts' length, "
            f"{_ratio(cost, a, b, 'kv_long')} at long_context; FLOPs/token {_ratio(cost, a, b, 'flops_prompt')}, "
            f"{_ratio(cost, a, b, 'flops_long')}"
        )
        out.append(
            outcome(
                f"{key} {pad}: {spec['ask']} ({a} - {b}, rule {spec['rule']}, gap pp)",
                passed,
                "; ".join(parts or ["no common seed"]) + f"; {costs_}",
            )
        )
        if spec.get("closes"):
            ra = [rows.get(label(a, s), {}).get(pad) for s in common]
            joins = [r is not None and (label(a, s), pad) in learned for s, r in zip(common, ra)]
            seen = [
                f"seed {s}: " + (verdict_text(r, criteria) if j else NO_RESULT if r is None else "not learned")
                for s, r, j in zip(common, ra, joins)
            ]
            claim = f"{key} {pad}: {a} closes the gap (flat in every seed, make paper's rule)"
            verdict_ = closes(ra, criteria) if common and all(joins) else None
            out.append(outcome(claim, verdict_, "; ".join(seen) or "no common seed"))
    return out


def claims(
    study: Study, rows: dict[str, dict[str, dict]], roles: dict[str, str], diffs: dict, cost: dict
) -> list[Check]:
    """The study's claims (conf/study/csa2.yaml, "The claims"), each PASS / FAIL / undecided. ``rows``: label ->
    padding -> ``claim_row`` of the runs that finished; ``roles``: label -> role of every run of the study;
    ``diffs``: ``differences``; ``cost``: ``costs``. Every claim but the precondition reads "no verdict" when the
    precondition fails."""
    criteria = study.criteria
    controls = [lab for lab in roles if roles[lab] == "control"]
    compressed = [lab for lab in roles if roles[lab] != "control"]
    learned = learned_runs({lab: rows[lab] for lab in compressed if lab in rows}, criteria["learned_best"])

    def result(lab: str, pad: str) -> Optional[dict]:
        return rows.get(lab, {}).get(pad)

    out = [mean_precondition(controls, result, criteria["control_mean"])]
    out += control_flat_checks(controls, result, criteria)
    for pad in PADDINGS:
        unlearned = [lab for lab in compressed if pad in rows.get(lab, {}) and (lab, pad) not in learned]
        missing = [lab for lab in compressed if rows.get(lab, {}).get(pad) is None]
        extra = (f"; not learned: {', '.join(unlearned)}" if unlearned else "") + (
            f"; no result: {', '.join(missing)}" if missing else ""
        )
        out.append(period_check(pad, compressed, rows, learned, criteria, "compressed run", extra))
    for key, spec in study.params["questions"].items():
        for pad in PADDINGS:
            out += question_checks(key, spec, pad, study, rows, learned, diffs, cost)
    if not out[0].passed:
        out = out[:1] + [
            Check(c.claim, False, "no verdict (precondition not met): " + c.detail, decided=False) for c in out[1:]
        ]
    return out


def _iv(v: tuple[Optional[float], Optional[float], Optional[float]]) -> str:
    value, lo, hi = v
    return "n/a" if value is None else f"{pp(value)} [{pp(lo)}, {pp(hi)}]"


def _flops(x: float) -> str:
    return f"{x / 1e6:.2f}M"


RUN_COLUMNS = (
    Column("run", lambda r: r["label"], 22, "<", ""),
    Column("padding", lambda r: r["padding"], 11, "<"),
    Column("S", lambda r: str(r["cost"]["stride"] or "-"), 2),
    Column("mean %", lambda r: _iv(r["m"]["mean"]) if r["m"] else "n/a", 18),
    Column("worst %", lambda r: _iv(r["m"]["worst"]) if r["m"] else "n/a", 18),
    Column("gap pp", lambda r: _iv(r["m"]["gap"]) if r["m"] else "n/a", 18),
    Column("verdict", lambda r: r["verdict"], 11),
    Column("period", lambda r: str(r["row"]["dominant_period"]) if r["row"] else "n/a", 6),
    Column("KV B/token", lambda r: f"{r['cost']['kv_prompt']:.0f}", 10),
    Column("FLOPs/token", lambda r: _flops(r["cost"]["flops_prompt"]), 11),
)

DIFF_COLUMNS = (
    Column("question", lambda r: r["key"], 8, "<", ""),
    Column("padding", lambda r: r["padding"], 11, "<"),
    Column("a - b", lambda r: f"{r['a']} - {r['b']}", 30, "<"),
    Column("seed", lambda r: str(r["seed"]), 4),
    Column("gap a pp", lambda r: r["gap_a"], 9),
    Column("gap b pp", lambda r: r["gap_b"], 9),
    Column("gap a - b pp [95%]", lambda r: _diff_text(r["diff"] and r["diff"]["gap"]), 20),
    Column("worst a - b pp [95%]", lambda r: _diff_text(r["diff"] and r["diff"]["worst"]), 20),
    Column("KV a/b", lambda r: r["ratios"]["kv_prompt"], 7),
    Column("@long", lambda r: r["ratios"]["kv_long"], 6),
    Column("FLOPs a/b", lambda r: r["ratios"]["flops_prompt"], 9),
    Column("@long", lambda r: r["ratios"]["flops_long"], 6),
)


def cost_columns(seq_len: int, long: int) -> tuple[Column, ...]:
    """Q4's table: per variant, its phase stride, its costs at the prompts' length and at ``long``, its schedule."""
    return (
        Column("variant", lambda r: r["name"], 14, "<", ""),
        Column("S", lambda r: str(r["stride"] or "-"), 2),
        Column(f"KV B/token @{seq_len}", lambda r: f"{r['kv_prompt']:.1f}", 16),
        Column(f"KV B/token @{long}", lambda r: f"{r['kv_long']:.1f}", 19),
        Column(f"FLOPs/token @{seq_len}", lambda r: _flops(r["flops_prompt"]), 19),
        Column(f"FLOPs/token @{long}", lambda r: _flops(r["flops_long"]), 22),
        Column("layers", lambda r: r["layers"], 0, "<", "  "),
    )


def cost_table(cost: dict[str, dict]) -> str:
    """Q4 as a table (``costs``: one line per variant)."""
    first = next(iter(cost.values()))
    return write_table(list(cost.values()), cost_columns(first["seq_len"], first["long_context"]))


def difference_rows(study: Study, rows: dict, diffs: dict, cost: dict) -> list[dict]:
    """One row per question (and comparison), pair, padding and seed: both gaps and their paired difference."""
    named = [(k, p) for k, q in study.params["questions"].items() for p in q["pairs"]]
    named += [(k, p) for k, ps in (study.params.get("comparisons") or {}).items() for p in ps]
    out = []
    for key, (a, b) in named:
        for pad in PADDINGS:
            for s in [x for x in seeds_of(study).get(a, []) if x in seeds_of(study).get(b, [])]:
                ra, rb = (rows.get(label(x, s), {}).get(pad) for x in (a, b))
                out.append(
                    {
                        "key": key,
                        "padding": pad,
                        "a": a,
                        "b": b,
                        "seed": s,
                        "gap_a": "n/a" if ra is None else pp(ra["residue_gap"]),
                        "gap_b": "n/a" if rb is None else pp(rb["residue_gap"]),
                        "diff": diffs.get((a, b, s, pad)),
                        "ratios": {k: _ratio(cost, a, b, k) for k in COSTS},
                    }
                )
    return out


def run_table(study: Study, done: list[dict], rows: dict, learned: set, cost: dict) -> str:
    """One line per run (finished or not) and padding: mean, worst group, gap (95% intervals), the gap's verdict
    (make paper's rule; ``not learned`` for a compressed run under the learned bar), the dominant period, and the
    variant's costs at the prompts' length."""
    reports = {d["run"].label: d["evaluations"] for d in done}
    lines = []
    for run in study.runs:
        for pad in PADDINGS:
            rep, row = reports.get(run.label, {}).get(pad), rows.get(run.label, {}).get(pad)
            known = run.role == "control" or (run.label, pad) in learned
            lines.append(
                {
                    "label": run.label,
                    "padding": pad,
                    "m": measured(rep) if rep else None,
                    "row": row,
                    "verdict": "n/a" if row is None else verdict(row, study.criteria) if known else "not learned",
                    "cost": cost[run.name or run.experiment],
                }
            )
    return write_table(lines, RUN_COLUMNS)


def figures(study: Study, done: list[dict], out: Path) -> dict[str, str]:
    """``csa2_curves.png``: every run's accuracy per target position mod 24, both paddings; ``csa2_phases.png``:
    per-phase accuracy of ``params.figure``'s variants (one column each, its seeds as lines), prefix and
    in-sequence padding."""
    roles = {r.label: r.role for r in study.runs}
    panels = curve_panels(done, roles, roles)
    reports = {d["run"].label: d["evaluations"] for d in done}
    seeds = seeds_of(study)

    def lines(name: str, pad: str) -> list[tuple[str, dict]]:
        found = [(s, reports.get(label(name, s), {}).get(pad)) for s in seeds[name]]
        return [(f"seed {s}", rep) for s, rep in found if rep is not None]

    columns = [(name, {pad: lines(name, pad) for pad in PADDINGS}) for name in study.params["figure"] if name in seeds]
    paths = {"curves": plot_residue_curves(panels, out / "csa2_curves.png")}
    if any(found for _, by_pad in columns for found in by_pad.values()):
        paths["phases"] = plot_phase_grid(columns, out / "csa2_phases.png")
    return {k: str(v) for k, v in paths.items()}


def report(study: Study, done: list[dict], out: Path, quick: bool) -> tuple[list[Check], dict]:
    """Print and write (``<out>/csa2_table.txt``) the runs' table with their costs, Q4's cost table, the paired
    differences, the claims and the figures' paths; return the claims as checks and, for the record, the costs,
    the differences and the figures."""
    roles = {r.label: r.role for r in study.runs}
    rows = {d["run"].label: {k: claim_row(v) for k, v in d["evaluations"].items()} for d in done}
    cost = costs(study)
    diffs = differences(study, done)
    checks = claims(study, rows, roles, diffs, cost)
    compressed = {lab: r for lab, r in rows.items() if roles[lab] != "control"}
    learned = learned_runs(compressed, study.criteria["learned_best"])
    diff_rows = difference_rows(study, rows, diffs, cost)
    paths = figures(study, done, out)
    text = [
        run_table(study, done, rows, learned, cost),
        "",
        "Q4: costs by ckv's accounting (ckv.flops: KV-cache bytes per token at bf16, a shared cache counted once; "
        "forward FLOPs per token; the runs' table prints them beside each gap):",
        cost_table(cost),
        "",
        "paired differences a - b (the same prompts; 95% cluster bootstrap over the mappings), with the cost ratios "
        f"a / b at the prompts' length and @long = {study.params['long_context']} tokens:",
        write_table(diff_rows, DIFF_COLUMNS),
        "",
        *check_lines(checks, ("PASS", "FAIL", "undecided")),
        "figures:",
        *(f"  {name}: {p}" for name, p in paths.items()),
    ]
    print("\n" + "\n".join(text) + "\n")
    (out / "csa2_table.txt").write_text("\n".join(text) + "\n")
    record = [{k: v for k, v in r.items() if k != "ratios"} for r in diff_rows]
    return checks, {"figures": paths, "costs": cost, "differences": record}


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ckv.apps.csa2 --costs``: print Q4's cost table of conf/study/csa2.yaml's variants (no training)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--costs", action="store_true", help="print every variant's KV bytes and FLOPs per token")
    args = ap.parse_args(argv)
    if not args.costs:
        ap.error("nothing to do: give --costs (the study itself runs with python -m ckv.apps.study csa2)")
    print(cost_table(costs(load_study("csa2"))))
    print("counted by ckv.flops: kv_bytes_per_token (bf16) and flops_per_token (forward) of each variant's config")
    return 0


if __name__ == "__main__":
    sys.exit(main())
