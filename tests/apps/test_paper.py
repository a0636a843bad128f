"""make paper's study (conf/study/paper.yaml): every variant of the paper's table on one recipe at either scale (the
dry run's jobs), the side-by-side table and the rank agreement with the paper on constructed results, and CI's quick
run of the real study on two of its runs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from ckv.apps import paper
from ckv.apps.study import main
from ckv.apps.study_config import ROOT, Run, load_study, select_runs
from ckv.apps.study_run import eval_names, run_dir
from ckv.config import PRESETS
from ckv.eval.summary import results_file
from ckv.io.results import read_json

from .helpers import run_quick

PNG = b"\x89PNG\r\n\x1a\n"
# the variant list (issue 39, item 1) as conf/attention options; the baseline W8/S8 once per seed
VARIANTS = [
    "full_kv1",
    "full_kv4",
    "full_kv8",
    "w4s4",
    "w8s4",
    "w8s6",
    "w12s12",
    "w8s8_kv2",
    "w8s8_kv4",
    "w8s8_kv8",
    "w8s8_tied_kv",
    "w8s8_mean",
    "w8s8_mean_tied_postnorm",
    "w8s8_vector_gate",
    "w8s8_no_qk_norm",
    "w8s8_no_gate_bias",
    "w8s8_no_rope",
    "w8s8_rope16",
    "w8s8_tail",
    "w8s8_tail_kv8",
    "deepseek_w8s4",
    "deepseek_w8s4_scalar",
]


def dry_run_lines(capsys, *args: str) -> list[str]:
    assert main(["paper", "--dry-run", *args]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("scale, experiment, rope_dims", [("", "paper_cpu", 4), ("paper", "paper_base", 16)])
def test_the_dry_run_lists_every_variant_and_seed_with_its_overrides(capsys, scale, experiment, rope_dims):
    lines = dry_run_lines(capsys, *(["--scale", scale] if scale else []))
    study = load_study("paper", scale)
    trains = {m.group(1): m.group(2) for m in (re.match(r"train (\S+): (.*)", x) for x in lines) if m}
    evals = [x for x in lines if x.startswith("eval ")]
    analyses = [re.match(r"analyse (\S+) \[(\w+)\]: (.*)", x).groups() for x in lines if x.startswith("analyse ")]
    expected = {f"{v}/seed=42" for v in VARIANTS} | {f"w8s8/seed={s}" for s in (42, 43, 44, 45)}
    assert set(trains) == expected == {r.label for r in study.runs} == set(study.params["paper_ids"])
    assert len(evals) == 2 * len(expected) and lines[-1] == f"{len(expected)} runs, {len(lines) - 1} jobs"
    # the baseline seeds' analyses (docs/paper.md, "Figures"), on the prefix evaluation
    assert sorted((label, name) for label, name, _ in analyses) == sorted(
        (f"w8s8/seed={s}", a) for s in (42, 43, 44, 45) for a in ("knockout", "gates", "gate_cycling")
    )
    assert all("task.padding=prefix" in cmd.split() and f"analysis={a}" in cmd.split() for _, a, cmd in analyses)
    for label, cmd in trains.items():
        name, seed = label.split("/seed=")
        assert f"experiment={experiment}" in cmd.split() and f"seed={seed}" in cmd.split()
        assert f"attention={name}" in cmd.split(), cmd  # only the attention changes
        assert ("hydra/launcher=slurm" in cmd) == (scale == "paper")
        if "rope16" in name or "deepseek" in name:
            assert f"attention.rope.dims={rope_dims}" in cmd.split()
    for pad in paper.PADDINGS:
        on_pad = [x for x in evals if f"[{pad}]" in x]
        assert len(on_pad) == len(expected)
        assert all(f"task.padding={pad}" in x and "task.n_demos=8" in x and "task=lookup" in x for x in on_pad)
    assert all("task.stride=8" in x for x in evals if x.startswith("eval  full_"))


@pytest.mark.smoke
def test_quick_paper_on_a_control_and_a_baseline_seed_writes_what_a_reader_looks_at(tmp_path):
    """``python -m ckv.apps.study paper --quick --runs 'full_kv1/*,w8s8/seed=42'``: the real study, 12 steps per
    model, on a full-attention control and one baseline seed. Both paddings are evaluated for both runs, the
    side-by-side table carries the paper's column (the shipped CSV), every claim is printed, the three figures are
    written and the baseline seed's analyses ran."""
    out = tmp_path / "paper"
    proc = run_quick("ckv.apps.study", out, "paper", "--runs", "full_kv1/*,w8s8/seed=42", "--workers", "2")
    study = select_runs(load_study("paper"), "full_kv1/*,w8s8/seed=42")
    labels = [r.label for r in study.runs]
    assert labels == ["full_kv1/seed=42", "w8s8/seed=42"]
    record = read_json(out / "paper.json")
    assert record["quick"] is True and record["failed"] == [] and [r["label"] for r in record["runs"]] == labels
    rows, why = paper.read_paper(paper.paper_path(study))
    assert why == ""
    text = proc.stdout.splitlines()
    for run in study.runs:
        vid = study.params["paper_ids"][run.label]
        for pad, task_name in eval_names(study.task, study.evals).items():  # one evaluation per padding
            results = read_json(results_file(run_dir(out, run), task_name))["results"]
            assert results["name"] == task_name and len(results["residue"]["groups"]) == results["modulus"]
            line = next(x for x in text if x.split()[:2] == [run.label, pad])  # the side-by-side table's row
            assert paper._cell(paper.measured(results)["gap"]) in line, line  # ckv's gap ...
            if (vid, pad) in rows:  # ... beside the paper's (its controls are prefix only)
                assert paper._cell(rows[(vid, pad)]["gap"]) in line, line
    for check in record["checks"]:
        word = "PASS" if check["passed"] else "FAIL" if check["decided"] else "undecided"
        assert f"  [{word}] {check['claim']}: {check['detail']}" in text
    assert record["checks"][0]["claim"].startswith("precondition")
    assert {Path(p).name for p in record["figures"].values()} == {
        "paper_curves.png",
        "paper_heatmap.png",
        "paper_mechanisms.png",
    }
    assert all(Path(p).parent == out and Path(p).read_bytes()[:8] == PNG for p in record["figures"].values())
    analysed = {(a["label"], a["analysis"]) for a in record["analyses"] if Path(a.get("file", "")).is_file()}
    assert analysed == {("w8s8/seed=42", a.name) for a in study.analyses}  # the baseline seed's, and no other
    assert len(record["analyses"]) == len(study.analyses)


def test_partial_rope_keeps_the_papers_fraction_at_both_scales():
    cpu = OmegaConf.load(ROOT / "conf" / "experiment" / "paper_cpu.yaml")
    rope16 = OmegaConf.load(ROOT / "conf" / "attention" / "w8s8_rope16.yaml")
    fraction = rope16.rope.dims / PRESETS["qwen3_0.6b"]["head_dim"]
    assert load_study("paper").params["rope16_dims"] / cpu.model.head_dim == fraction
    assert load_study("paper", "paper").params["rope16_dims"] / PRESETS["qwen3_0.6b"]["head_dim"] == fraction
    assert cpu.model.n_heads == 8  # so that the 8-KV-head rows exist


def report(mean: float, worst: float, gap: float) -> dict:
    """A lookup report's headline holding the mod-24 numbers the table reads (intervals +- 1 pp)."""
    h = {"mean": mean, "mean_lower": mean - 0.01, "mean_upper": mean + 0.01}
    h |= {"worst_residue_accuracy": worst, "worst_residue_lower": worst - 0.01, "worst_residue_upper": worst + 0.01}
    h |= {"residue_gap": gap, "residue_gap_lower": gap - 0.01, "residue_gap_upper": gap + 0.01}
    return {"headline": h}


def constructed(gaps: dict[str, float]) -> list[dict]:
    """Finished runs (both paddings) whose gaps are ``gaps`` and whose worst group is 0.5 - gap."""
    return [
        {
            "run": Run("paper_cpu", 42, "variant", name=name),
            "evaluations": dict.fromkeys(paper.PADDINGS, report(0.6, 0.5 - g, g)),
        }
        for name, g in gaps.items()
    ]


def write_csv(path: Path, rows: dict[str, float]) -> None:
    head = "variant_id,padding,mean_acc,mean_acc_ci_lo,mean_acc_ci_hi,worst_acc,gap_pp,gap_ci_lo,gap_ci_hi\n"
    body = "".join(
        f"{vid},{pad},50.0,49.0,51.0,{50 - g},{g},{g - 1},{g + 1}\n"
        for vid, g in rows.items()
        for pad in ("prefix", "in-sequence")
    )
    path.write_text(head + body)


def test_the_table_sits_beside_the_papers_rows_and_ranks_agree_as_constructed(tmp_path):
    ids = {"a/seed=42": "pa", "b/seed=42": "pb", "c/seed=42": "pc", "d/seed=42": "pd"}
    ours = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4}
    write_csv(tmp_path / "same.csv", {"pa": 10, "pb": 20, "pc": 30, "pd": 40})  # the same order
    write_csv(tmp_path / "reversed.csv", {"pa": 40, "pb": 30, "pc": 20, "pd": 10})
    rows = paper.run_rows(constructed(ours))
    same, why = paper.read_paper(tmp_path / "same.csv")
    assert why == "" and same[("pb", "in_sequence")]["gap"] == (0.2, 0.19, 0.21)
    text = paper.side_by_side(rows, ids, same)
    line = next(x for x in text.splitlines() if x.startswith("b/seed=42") and "in_sequence" in x)
    assert "20.0 [19.0, 21.0]" in line and line.count("20.0 [19.0, 21.0]") == 2  # ckv's gap and the paper's
    for csv_name, rho in (("same.csv", 1.0), ("reversed.csv", -1.0)):
        everyone = {(lab, pad) for lab in ids for pad in paper.PADDINGS}
        lines = paper.rank_lines(rows, ids, paper.read_paper(tmp_path / csv_name)[0], list(ids), everyone)
        assert [(w, n) for w, _, n in lines] == [
            (f"Spearman of {m} ({p})", 4) for p in paper.PADDINGS for m in ("gap", "worst")
        ]
        assert all(r[0] == pytest.approx(rho) for _, r, _ in lines)
        # a variant that did not learn in one padding joins no rank there
        fewer = paper.rank_lines(
            rows, ids, paper.read_paper(tmp_path / csv_name)[0], list(ids), everyone - {("a/seed=42", "prefix")}
        )
        assert [n for _, _, n in fewer] == [3, 3, 4, 4]
    missing, why = paper.read_paper(tmp_path / "absent.csv")
    assert missing == {} and "n/a" in why and "absent" in why
    assert "n/a" in paper.side_by_side(rows, ids, missing).splitlines()[1]


def test_spearman_handles_ties_and_the_bootstrap_brackets_rho():
    assert paper.spearman(np.array([1.0, 2, 2, 4]), np.array([1.0, 2, 3, 4])) == pytest.approx(
        np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1]
    )
    rho, lo, hi = paper.rank_agreement([1, 2, 3, 4, 5, 6, 7, 8], [2, 1, 3, 4, 6, 5, 7, 8])
    assert lo <= rho <= hi and rho == pytest.approx(1 - 6 * 4 / (8 * 63))
    assert paper.rank_agreement([1, 2], [2, 1])[1:] == (None, None)


def row(mean=0.9, gap=0.02, p=0.5, floor=0.03, verdict="flat", period=None, stride=8, worst=0.5) -> dict:
    """A constructed ``claim_row``: intervals +- 2 pp around gap and worst group."""
    return {
        "mean": mean,
        "mean_lower": mean - 0.02,
        "mean_upper": mean + 0.02,
        "residue_gap": gap,
        "residue_gap_lower": gap - 0.02,
        "residue_gap_upper": gap + 0.02,
        "residue_p_value": p,
        "residue_noise_floor": floor,
        "residue_verdict": verdict,
        "residue_margin": 0.05,
        "residue_upper_one_sided": gap + 0.015,
        "residue_mde": 0.03,
        "residue_mde_power": 0.8,
        "dominant_period": period,
        "stride": stride,
        "worst_residue_accuracy": worst,
        "worst_residue_lower": worst - 0.02,
        "worst_residue_upper": worst + 0.02,
    }


GAP = dict(gap=0.4, p=0.001, verdict="gap", period=8, worst=0.3)
CRITERIA = {"control_mean": 0.8, "flat_margin": 0.05, "learned_best": 0.5}


def learned(rows: dict) -> set:
    """The constructed rows' learned evaluations (every role but the control's), by the study's bar."""
    return paper.learned_runs({k: v for k, v in rows.items() if k != "ctrl"}, CRITERIA["learned_best"])


def outcome(checks, start: str) -> list[str]:
    """``PASS`` / ``FAIL`` / ``undecided`` of the checks whose claim starts with ``start``."""
    return [("PASS" if c.passed else "FAIL" if c.decided else "undecided") for c in checks if c.claim.startswith(start)]


def both(r: dict) -> dict:
    return dict.fromkeys(paper.PADDINGS, r)


def test_each_claim_passes_fails_or_stays_undecided_on_constructed_rows():
    roles = {
        "ctrl": "control",
        "base": "baseline",
        "mean": "mean",
        "w8s4": "overlap",
        "tail": "tail",
        "w4s4": "geometry",
    }
    rows = {
        "ctrl": both(row()),
        "base": both(row(**GAP)),
        "mean": both(row(**{**GAP, "period": 4})),  # significant, but its period is not S = 8
        "w8s4": both(row(**{**GAP, "stride": 4, "period": 4, "worst": 0.5})),  # worst 48-52% > the baseline's 30%
        "tail": both(row(gap=0.05, p=0.2, verdict="undecided", worst=0.31)),  # worst 29-33%: neither
        "w4s4": both(row(gap=0.01, verdict="flat", stride=4)),
    }
    ranks = [
        ("Spearman of gap (prefix)", (0.8, 0.3, 1.0), 5),
        ("Spearman of worst (prefix)", (0.1, -0.5, 0.6), 5),
        ("Spearman of gap (in_sequence)", (-0.7, -1.0, -0.2), 5),
    ]
    checks = paper.claims(rows, roles, CRITERIA, ranks, [0.37, 0.75], learned(rows))
    assert outcome(checks, "precondition") == ["PASS"]
    assert outcome(checks, "prefix: the dominant period") == ["FAIL"]  # mean's period 4 != 8
    assert "mean period 4 (S=8)" in next(c.detail for c in checks if c.claim.startswith("prefix: the dominant"))
    assert outcome(checks, "ctrl ") == ["PASS", "PASS"]
    assert outcome(checks, "mean ") == ["PASS", "PASS"]
    assert outcome(checks, "w8s4 ") == ["PASS", "PASS"] and outcome(checks, "tail ") == ["undecided"] * 2
    assert outcome(checks, "rank agreement") == ["PASS", "undecided", "FAIL"]
    assert outcome(checks, "prefix: every baseline seed") == ["PASS"]
    assert "37.0-75.0 pp" in next(c.detail for c in checks if c.claim.startswith("prefix: every baseline"))

    # the opposite outcomes: a control with a gap, mean pooling flat, the tail's worst group under the baseline's
    tail = row(gap=0.45, worst=0.1)  # learned (best group 55%), its worst group 8-12% under the baseline's 50%
    rows |= {"ctrl": both(row(**{**GAP, "mean": 0.85})), "mean": both(row()), "tail": both(tail)}
    rows["base"] = both(row())  # a baseline seed without a gap
    checks = paper.claims(rows, roles, CRITERIA, [], [], learned(rows))
    assert outcome(checks, "ctrl ") == ["FAIL", "FAIL"] and outcome(checks, "mean ") == ["FAIL", "FAIL"]
    assert outcome(checks, "tail ") == ["FAIL", "FAIL"] and outcome(checks, "rank agreement") == ["undecided"]
    assert outcome(checks, "prefix: the dominant period") == ["PASS"]  # w8s4, the one significant gap, is at its S
    assert outcome(checks, "prefix: every baseline seed") == ["FAIL"]

    # the precondition: a control under 80% leaves every claim undecided
    # a compressed model that did not learn (best group under 50%): no phase conclusion, whatever its gap
    unlearned = {**rows, "mean": both(row(mean=0.1, gap=0.01, worst=0.08)), "base": both(row(**{**GAP, "worst": 0.05}))}
    checks = paper.claims(unlearned, roles, CRITERIA, [], [], learned(unlearned))
    assert outcome(checks, "mean ") == ["undecided"] * 2 and outcome(checks, "tail ") == ["undecided"] * 2
    assert "not learned: best group 9.0% under 50.0%" in next(c.detail for c in checks if c.claim.startswith("mean "))
    assert outcome(checks, "prefix: every baseline seed") == ["undecided"]
    assert "not learned: base" in next(c.detail for c in checks if c.claim.startswith("prefix: the dominant"))

    rows["ctrl"] = both(row(mean=0.5))
    checks = paper.claims(rows, roles, CRITERIA, ranks, [], learned(rows))
    assert outcome(checks, "precondition") == ["FAIL"]
    assert all(not c.decided and "no verdict" in c.detail for c in checks[1:]) and len(checks) > 10
    # no significant gap anywhere: the period claim has nothing to judge
    rows = {"ctrl": both(row()), "w4s4": both(row(stride=4))}
    assert outcome(paper.claims(rows, roles, CRITERIA, [], [], learned(rows)), "in_sequence: the dominant") == [
        "undecided"
    ]


def lookup_report(stride: int, dip: float, modulus: int = 24) -> dict:
    """A lookup report's per-residue groups: accuracy 0.9 but ``dip`` lower at phase S - 1 (intervals +- 5 pp)."""
    acc = [0.9 - (dip if r % stride == stride - 1 else 0.0) for r in range(modulus)]
    groups = [{"group": r, "accuracy": a, "lower": a - 0.05, "upper": a + 0.05} for r, a in enumerate(acc)]
    return {"modulus": modulus, "stride": stride, "residue": {"groups": groups}}


def analysis_envelope(path: Path, name: str, results: dict) -> str:
    """``path`` written as eval.py writes an analysis (``{"analysis": {"results": ...}}``); returns its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(__import__("json").dumps({"analysis": {"name": name, "results": results}}))
    return str(path)


def analyses_of_a_baseline_seed(folder: Path) -> dict:
    """A baseline seed's ``analyses`` records (``run_analyses``): knock-out, gates and gate cycling, constructed."""
    fit = {"value": 0.9, "lower": 0.8, "upper": 1.0}
    phases = [{"effect": -10.0 * (r == 7), "effect_lower": -12.0, "effect_upper": 1.0} for r in range(8)]
    results = {
        "knockout": {"stride": 8, "units": [{"label": f"L{i}", "kv_head": None, "phases": phases} for i in (0, 1)]},
        "gates": {
            "window": 8,
            "gates": [
                {"layer": i, "kv_head": 0, "branch": b, "profile": [1.0] * 7 + [1.5], "peak_offset": 7}
                for i in (0, 1)
                for b in "KV"
            ],
        },
        "gate_cycling": {
            "deltas": [{"delta": d, "corr2_excl_boundary": fit} for d in (-1, 1)],
            "pooled": {"corr2_excl_boundary": fit},
        },
    }
    return {
        name: {"label": "w8s8/seed=42", "analysis": name, "file": analysis_envelope(folder / f"{name}.json", name, r)}
        for name, r in results.items()
    }


def test_the_figures_show_every_run_in_the_papers_order_and_the_baseline_analyses(tmp_path):
    """Constructed runs (no training): a control, a baseline seed with its three analyses, a mean-pooled run whose
    gate analyses were skipped, and a run that did not finish. Every figure is written and named in the report's
    lines, and a skipped analysis is one line with its reason."""
    study = load_study("paper")
    ids = {"full_kv1/seed=42": "full_attn_1kv", "w8s8/seed=42": "kvc_w8s8_1kv_baseline"}
    ids |= {"w8s8_mean/seed=42": "kvc_w8s8_1kv_meanpool", "w4s4/seed=42": "kvc_w4s4_1kv"}
    roles = {r.label: r.role for r in study.runs}
    skip = "ckv: error: analysis=gates needs learned gates, but w8s8_mean pools by uniform averaging"
    done = [
        {"run": Run("paper_cpu", 42, "control", name="full_kv1"), "evaluations": both(lookup_report(8, 0.0))},
        {
            "run": Run("paper_cpu", 42, "baseline", name="w8s8"),
            "evaluations": both(lookup_report(8, 0.5)),
            "analyses": analyses_of_a_baseline_seed(tmp_path / "w8s8"),
        },
        {
            "run": Run("paper_cpu", 42, "mean", name="w8s8_mean"),
            "evaluations": {"prefix": lookup_report(8, 0.3)},  # the in-sequence evaluation missing: a grey row
            "analyses": {"gates": {"label": "w8s8_mean/seed=42", "analysis": "gates", "skipped": skip}},
        },
    ]
    paper_rows = {("kvc_w8s8_1kv_baseline", "prefix"): {"mean": (0.7, None, None)}}
    paths, lines = paper.figures(done, ids, roles, paper_rows, tmp_path)
    assert set(paths) == {"curves", "heatmap", "mechanisms"}
    assert all(Path(p).is_file() and Path(p).stat().st_size > 10_000 for p in paths.values())
    assert [f"  {name}: {p}" for name, p in paths.items()] == lines[1 : 1 + len(paths)]
    assert f"  w8s8_mean/seed=42 gates: skipped ({skip})" in lines
    assert sum("w8s8_mean" in x for x in lines) == 1  # one line, not an error
    panels = paper.curve_panels(done, ids, roles, paper_rows)
    assert [p.label for p in panels] == list(ids)  # the paper's order, the unfinished run included
    assert [p.stride for p in panels] == [None, 8, 8, None]  # no stride lines for full attention
    assert panels[1].reference == {"prefix": 0.7} and panels[3].reports == {}


def test_the_papers_table_ships_with_ckv_and_names_every_run():
    """The side-by-side column reads a copy of the paper's table inside the checkout (a clone anywhere has it): every
    run's paper id has its rows, prefix for all and in-sequence for the compressed ones (the paper's controls are
    prefix only); where the shared reference folder sits beside the checkout, the copy is byte-identical to it."""
    study = load_study("paper")
    rows, why = paper.read_paper(paper.paper_path(study))
    assert why == "" and paper.paper_path(study).is_relative_to(ROOT)
    controls = {r.label for r in study.runs if r.role == "control"}
    for label, pid in study.params["paper_ids"].items():
        pads = ("prefix",) if label in controls else paper.PADDINGS
        assert all((pid, pad) in rows for pad in pads), (label, pid)
    shared = ROOT.parent / "shared" / "paper" / "controlled_table.csv"
    if shared.is_file():
        assert paper.paper_path(study).read_bytes() == shared.read_bytes()
