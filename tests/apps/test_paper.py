"""make paper's study (conf/study/paper.yaml): every variant of the paper's table on one recipe at either scale (the
dry run's jobs), the side-by-side table, the rank agreement with the paper (its interval's coverage on simulated
data), every claim at the boundaries of its rule on constructed rows (the criteria read from the study), the
figures' content, and CI's quick run of the real study on two of its runs."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from ckv.analysis import plots as analysis_plots
from ckv.apps import paper
from ckv.apps.study import main
from ckv.apps.study_config import ROOT, STUDY_DIR, Run, load_study, select_runs
from ckv.apps.study_run import eval_commands, eval_names, run_dir
from ckv.config import PRESETS
from ckv.eval import plots as eval_plots
from ckv.eval.summary import results_file
from ckv.io.results import read_json
from tests.helpers import kept_figures

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
    roles = {"a/seed=42": "baseline", "b/seed=42": "baseline", "c/seed=42": "variant", "d/seed=42": "variant"}
    ours = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4}
    write_csv(tmp_path / "same.csv", {"pa": 10, "pb": 20, "pc": 30, "pd": 40})  # the same order
    write_csv(tmp_path / "reversed.csv", {"pa": 40, "pb": 30, "pc": 20, "pd": 10})
    rows = paper.run_rows(constructed(ours))
    same, why = paper.read_paper(tmp_path / "same.csv")
    assert why == "" and same[("pb", "in_sequence")]["gap"] == (0.2, 0.19, 0.21)
    text = paper.side_by_side(rows, ids, same)
    line = next(x for x in text.splitlines() if x.startswith("b/seed=42") and "in_sequence" in x)
    assert "20.0 [19.0, 21.0]" in line and line.count("20.0 [19.0, 21.0]") == 2  # ckv's gap and the paper's
    everyone = {(lab, pad) for lab in ids for pad in paper.PADDINGS}
    for csv_name, rho in (("same.csv", 1.0), ("reversed.csv", -1.0)):
        lines = paper.rank_lines(rows, ids, roles, paper.read_paper(tmp_path / csv_name)[0], everyone)
        assert [(x.metric, x.padding, x.n, x.seeds) for x in lines] == [
            (m, p, 4, 2)
            for p in paper.PADDINGS
            for m in ("gap", "worst")  # each baseline seed one pair
        ]
        assert all(x.rho == pytest.approx(rho) and x.why == "" for x in lines)
        # a variant that did not learn in one padding joins no rank there
        fewer = paper.rank_lines(
            rows, ids, roles, paper.read_paper(tmp_path / csv_name)[0], everyone - {("a/seed=42", "prefix")}
        )
        assert [(x.n, x.seeds) for x in fewer] == [(3, 1), (3, 1), (4, 2), (4, 2)]
    missing, why = paper.read_paper(tmp_path / "absent.csv")
    assert missing == {} and "n/a" in why and "absent" in why
    assert "n/a" in paper.side_by_side(rows, ids, missing).splitlines()[1]


def test_spearman_handles_ties():
    assert paper.spearman(np.array([1.0, 2, 2, 4]), np.array([1.0, 2, 3, 4])) == pytest.approx(
        np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1]
    )
    # many resamples at once, each ranked on its own: the tie-sharing ranks of every row
    x = np.array([[3.0, 1, 3, 2], [5.0, 5, 5, 5]])
    assert paper._ranks(x).tolist() == [[3.5, 1.0, 3.5, 2.0], [2.5, 2.5, 2.5, 2.5]]
    rho = paper.rank_agreement([1, 2, 3, 4, 5, 6, 7, 8], [2, 1, 3, 4, 6, 5, 7, 8])[0]
    assert rho == pytest.approx(1 - 6 * 4 / (8 * 63))  # 1 - 6 sum(d^2) / (n (n^2 - 1)), two swaps: sum(d^2) = 4


def test_the_rank_interval_resamples_whole_pairs_and_drops_constant_resamples():
    """Each resample draws (ckv, paper) pairs whole: with both sides in the same order every resample that can be
    ranked agrees perfectly, so the interval is [1, 1] (resampling each side on its own would spread it around 0).
    Three pairs give a constant resample (one pair drawn three times) in 3 of 27 draws, more than 2.5%: counted as
    rho = 0 they would pull the lower end to 0, dropped they leave it at 1."""
    assert paper.rank_agreement([1, 2, 3], [10, 20, 30]) == pytest.approx((1.0, 1.0, 1.0))
    assert paper.rank_agreement([1, 2, 3], [30, 20, 10]) == pytest.approx((-1.0, -1.0, -1.0))
    # fewer than MIN_RANK_PAIRS pairs: no interval; fewer than 2, or a constant side: no rho either
    assert paper.MIN_RANK_PAIRS == 3 and paper.rank_agreement([1, 2], [2, 1]) == (pytest.approx(-1.0), None, None)
    assert paper.rank_agreement([1], [1]) == (None, None, None)
    assert paper.rank_agreement([1, 1, 1, 1], [1, 2, 3, 4]) == (None, None, None)


def test_the_rank_interval_covers_a_known_rho_95_percent_of_the_time():
    """Coverage where the sampling distribution is known: pairs from a bivariate normal with correlation
    2 sin(pi rho / 6), whose Spearman correlation is exactly rho (Pearson's identity), at the study's size (20 pairs)
    and a rho like its (0.4). 300 datasets: were the coverage 95%, the share covering would have a binomial standard
    deviation of 1.26 points, so it must lie within 3 of them (91.2-98.8%), and each end must miss at most
    2.5% + 3 x 0.9 points (5.2%): an interval shifted to one side fails there. (Measured on 3,000 such datasets:
    96.4%, 1.8% / 1.9% missed low / high; the percentile interval is slightly conservative at 20 pairs.)"""
    n, rho, datasets = 20, 0.4, 300
    r = 2 * math.sin(math.pi * rho / 6)
    rng = np.random.default_rng(0)
    low = high = 0
    for d in range(datasets):
        x, e = rng.standard_normal((2, n))
        _, lo, hi = paper.rank_agreement(list(x), list(r * x + math.sqrt(1 - r * r) * e), n_bootstrap=1000, seed=d)
        low, high = low + (rho < lo), high + (rho > hi)
    covered = 1 - (low + high) / datasets
    sd = math.sqrt(0.95 * 0.05 / datasets)
    assert abs(covered - 0.95) <= 3 * sd, covered
    assert max(low, high) / datasets <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / datasets), (low, high)


# the committed criteria (conf/study/paper.yaml), read, never copied
CRITERIA = load_study("paper").criteria
MARGIN, BAR, CONTROL_MEAN = CRITERIA["flat_margin"], CRITERIA["learned_best"], CRITERIA["control_mean"]
ALPHA = 0.05  # the criteria's significance level (permutation p < 0.05): the default of gap_is_real


def row(
    mean: float = CONTROL_MEAN + 0.1,
    gap: float = MARGIN / 4,
    p: float = 0.5,
    floor: float = MARGIN / 2,
    period: Optional[int] = None,
    stride: int = 8,
    worst: float = BAR,
    **fields: float,
) -> dict:
    """A constructed ``claim_row``: by default a learned (best group at least ``BAR``), not significant gap whose
    one-sided upper bound (the larger of the gap and half the margin) is under the margin: flat; intervals +- 2 pp
    around the gap and the worst group; ``fields`` set any field (e.g. ``residue_upper_one_sided``)."""
    return {
        "mean": mean,
        "mean_lower": mean - 0.02,
        "mean_upper": mean + 0.02,
        "residue_gap": gap,
        "residue_gap_lower": gap - 0.02,
        "residue_gap_upper": gap + 0.02,
        "residue_p_value": p,
        "residue_noise_floor": floor,
        "residue_upper_one_sided": max(gap, MARGIN / 2),
        "residue_mde": 0.03,
        "residue_mde_power": 0.8,
        "dominant_period": period,
        "stride": stride,
        "worst_residue_accuracy": worst,
        "worst_residue_lower": worst - 0.02,
        "worst_residue_upper": worst + 0.02,
        **fields,
    }


# a significant gap at period 8: p under alpha, its interval (38-42 pp) above the floor, upper bound over the margin
GAP = dict(gap=0.4, p=ALPHA / 50, floor=0.03, period=8, worst=0.3, residue_upper_one_sided=0.42)


def learned(rows: dict) -> set:
    """The constructed rows' learned evaluations (every role but the controls'), by the study's bar."""
    return paper.learned_runs({k: v for k, v in rows.items() if not k.startswith("ctrl")}, BAR)


def outcome(checks, start: str) -> list[str]:
    """``PASS`` / ``FAIL`` / ``undecided`` of the checks whose claim starts with ``start``."""
    return [("PASS" if c.passed else "FAIL" if c.decided else "undecided") for c in checks if c.claim.startswith(start)]


def detail(checks, start: str) -> str:
    """The detail of the first check whose claim starts with ``start``."""
    return next(c.detail for c in checks if c.claim.startswith(start))


def both(r: dict) -> dict:
    return dict.fromkeys(paper.PADDINGS, r)


ROLES = {"ctrl": "control", "base": "baseline", "mean": "mean", "w8s4": "overlap", "tail": "tail", "w4s4": "geometry"}


def rank(lower: float, upper: float, rho: float = 0.3, n: int = 5) -> paper.RankLine:
    return paper.RankLine("gap", "prefix", rho, lower, upper, n, 1)


def test_each_claim_passes_fails_or_stays_undecided_on_constructed_rows():
    rows = {
        "ctrl": both(row()),
        "base": both(row(**GAP)),
        "mean": both(row(**{**GAP, "period": 4})),  # significant, but its period is not S = 8
        "w8s4": both(row(**{**GAP, "stride": 4, "period": 4, "worst": 0.5})),  # worst 48-52% > the baseline's 30%
        "tail": both(row(gap=0.05, p=0.2, worst=0.5)),  # learned, worst 48-52%: above the baseline's 30% too
        "w4s4": both(row(stride=4)),
    }
    ranks = [rank(0.3, 1.0, 0.8), rank(-0.5, 0.6, 0.1), rank(-1.0, -0.2, -0.7)]
    checks = paper.claims(rows, ROLES, CRITERIA, ranks, [0.37, 0.75], learned(rows))
    assert outcome(checks, "precondition") == ["PASS"]
    assert outcome(checks, "prefix: the dominant period") == ["FAIL"]  # mean's period 4 != 8
    assert "mean period 4 (S=8)" in detail(checks, "prefix: the dominant")
    assert outcome(checks, "ctrl ") == ["PASS", "PASS"] and detail(checks, "ctrl ").startswith("flat (not significant")
    assert outcome(checks, "mean ") == ["PASS", "PASS"] and detail(checks, "mean ").startswith("gap (significant")
    assert outcome(checks, "w8s4 ") == ["PASS", "PASS"] and outcome(checks, "tail ") == ["PASS", "PASS"]
    assert outcome(checks, "rank agreement") == ["PASS", "undecided", "FAIL"]
    assert outcome(checks, "prefix: every baseline seed") == ["PASS"]
    assert "37.0-75.0 pp" in detail(checks, "prefix: every baseline")

    # the opposite outcomes: a control with a gap, mean pooling flat, the tail's worst group under the baseline's
    tail = row(gap=0.45, worst=0.1)  # learned (best group 55%), its worst group 8-12% under the baseline's 50%
    rows |= {"ctrl": both(row(**{**GAP, "mean": CONTROL_MEAN + 0.05})), "mean": both(row()), "tail": both(tail)}
    rows["base"] = both(row())  # a baseline seed without a gap
    checks = paper.claims(rows, ROLES, CRITERIA, [], [], learned(rows))
    assert outcome(checks, "ctrl ") == ["FAIL", "FAIL"] and outcome(checks, "mean ") == ["FAIL", "FAIL"]
    assert outcome(checks, "tail ") == ["FAIL", "FAIL"] and outcome(checks, "rank agreement") == []
    assert outcome(checks, "prefix: the dominant period") == ["PASS"]  # w8s4, the one significant gap, is at its S
    assert outcome(checks, "prefix: every baseline seed") == ["FAIL"]

    # a compressed model that did not learn (best group under the bar): no phase conclusion, whatever its gap
    unlearned = {**rows, "mean": both(row(mean=0.1, gap=0.01, worst=0.08)), "base": both(row(**{**GAP, "worst": 0.05}))}
    checks = paper.claims(unlearned, ROLES, CRITERIA, [], [], learned(unlearned))
    assert outcome(checks, "mean ") == ["undecided"] * 2 and outcome(checks, "tail ") == ["undecided"] * 2
    assert f"not learned: best group 9.0% under {100 * BAR:.1f}%" in detail(checks, "mean ")
    assert outcome(checks, "prefix: every baseline seed") == ["undecided"]
    assert "not learned: base" in detail(checks, "prefix: the dominant")

    # the precondition: a control under its bar leaves every claim undecided
    rows["ctrl"] = both(row(mean=CONTROL_MEAN - 0.3))
    checks = paper.claims(rows, ROLES, CRITERIA, ranks, [], learned(rows))
    assert outcome(checks, "precondition") == ["FAIL"]
    assert all(not c.decided and "no verdict" in c.detail for c in checks[1:]) and len(checks) > 10
    # no significant gap anywhere: the period claim has nothing to judge
    rows = {"ctrl": both(row()), "w4s4": both(row(stride=4))}
    checks = paper.claims(rows, ROLES, CRITERIA, [], [], learned(rows))
    assert outcome(checks, "in_sequence: the dominant") == ["undecided"]
    assert "no result: base, mean, w8s4, tail" in detail(checks, "in_sequence: the dominant")


def test_a_significant_gap_inside_the_margin_is_a_gap_in_every_claim():
    """The one rule (``ckv.eval.flatness.gap_verdict``, significance first): a gap that is significant (p under
    alpha, interval above the floor) but whose one-sided upper bound is under the margin is a gap, so a model with
    one keeps its gap (PASS) and a control with one is not flat (FAIL). Significance at its boundaries: p exactly
    alpha, or the interval's lower end exactly at the floor, is not significant, and such a bounded gap is flat."""
    small = dict(gap=MARGIN / 2, floor=MARGIN / 8, p=ALPHA / 10, residue_upper_one_sided=MARGIN * 3 / 4)
    small["residue_gap_lower"] = small["floor"] * 2  # above the floor: significant, and inside the margin
    at_floor = {**small, "residue_gap_lower": small["floor"]}
    at_alpha = {**small, "p": ALPHA}
    cases = [(small, "gap", "PASS", "FAIL"), (at_floor, "flat", "FAIL", "PASS"), (at_alpha, "flat", "FAIL", "PASS")]
    for numbers, word, kept, control in cases:  # the verdict, "keeps a significant gap", the control's "flat"
        rows = {"ctrl": both(row(**numbers)), "mean": both(row(**numbers))}
        assert paper.verdict(rows["mean"]["prefix"], CRITERIA) == word
        checks = paper.claims(rows, ROLES, CRITERIA, [], [], learned(rows))
        assert outcome(checks, "mean ") == [kept] * 2 and outcome(checks, "ctrl ") == [control] * 2
        assert detail(checks, "mean ").startswith(f"{word} (")


def test_the_8_kv_row_fails_for_the_reason_the_paper_page_gives():
    """docs/paper.md's 8-KV-head row under prefix padding (gap 0.9 [0.2, 1.7] pp, p = 0.0005, noise floor 0.5 pp):
    p is under alpha but the interval's lower end is not above the floor, so the gap is not significant; its upper
    bound is under the margin, so it is flat, and "keeps a significant gap" FAILs."""
    kv8 = row(gap=0.009, p=0.0005, floor=0.005, residue_gap_lower=0.002, residue_gap_upper=0.017, worst=0.991)
    kv8["residue_upper_one_sided"] = 0.015
    rows, roles = {"ctrl": both(row()), "kv8": {"prefix": kv8}}, {"ctrl": "control", "kv8": "kv_heads"}
    checks = paper.claims(rows, roles, CRITERIA, [], [], learned(rows))
    assert outcome(checks, "kv8 ") == ["FAIL", "undecided"]  # in-sequence: no result
    reason = f"flat (not significant, one-sided upper bound 1.5 pp under {100 * MARGIN:.1f} pp)"
    assert detail(checks, "kv8 prefix").startswith(reason)
    assert detail(checks, "kv8 in_sequence") == paper.NO_RESULT


def test_learned_is_judged_at_the_bar_itself():
    """``criteria.learned_best``: a best group exactly at the bar learned (its claims are decided), one a hair under
    it did not (undecided, named)."""
    at_bar = row(**{**GAP, "gap": BAR / 2, "worst": BAR / 2})  # best group = worst + gap = the bar, exactly
    under = row(**{**GAP, "gap": np.nextafter(BAR, 0.0), "worst": 0.0})  # the largest number under the bar
    assert paper.best_group(at_bar) == BAR and paper.best_group(under) < BAR
    rows = {"ctrl": both(row()), "mean": both(at_bar), "no_rope": both(under)}
    roles = {"ctrl": "control", "mean": "mean", "no_rope": "no_rope"}
    assert learned(rows) == {("mean", pad) for pad in paper.PADDINGS}
    checks = paper.claims(rows, roles, CRITERIA, [], [], learned(rows))
    assert outcome(checks, "mean ") == ["PASS", "PASS"] and outcome(checks, "no_rope ") == ["undecided"] * 2
    assert detail(checks, "no_rope ").startswith("not learned: best group")


def test_the_worst_group_rule_at_its_boundaries_against_the_learned_baseline_seeds():
    """Criterion 5: PASS when the worst group's interval lies above every learned baseline seed's worst group, FAIL
    when its upper bound is under their mean, else undecided, also for a run that learned. The learned seeds'
    worst groups are 25% and 37.5% (highest 37.5%, mean 31.25%); a third seed that did not learn (worst 45%) is
    not compared with, and the detail names the seeds that are."""
    highest, mean = 0.375, 0.3125
    rows = {
        "ctrl": both(row()),
        "base42": both(row(**{**GAP, "worst": 0.25})),
        "base43": both(row(**{**GAP, "worst": highest})),
        "base44": both(row(**{**GAP, "gap": 0.02, "worst": 0.45})),  # best group 47%: not learned
    }
    roles = {"ctrl": "control", "base42": "baseline", "base43": "baseline", "base44": "baseline", "tail": "tail"}
    cases = {  # the tail's worst-group interval (a learned tail: best group at least the bar) -> outcome
        (highest, 0.5): "undecided",  # its lower end at the highest seed's, not above it; its upper end over the mean
        (np.nextafter(highest, 1.0), 0.5): "PASS",
        (0.2, mean): "undecided",  # its upper end at the seeds' mean, not under it
        (0.2, np.nextafter(mean, 0.0)): "FAIL",
        (0.3, 0.4): "undecided",  # learned, neither above every seed nor under their mean
    }
    for (lo, hi), word in cases.items():
        tail = row(gap=BAR, worst=(lo + hi) / 2, worst_residue_lower=lo, worst_residue_upper=hi)
        everything = {**rows, "tail": both(tail)}
        checks = paper.claims(everything, roles, CRITERIA, [], [], learned(everything))
        assert outcome(checks, "tail ") == [word] * 2, (lo, hi)
        text = detail(checks, "tail ")
        assert "base42 25.0%, base43 37.5%; highest 37.5%, mean 31.2%" in text and "base44" not in text
        assert "not learned" not in text


def test_the_rank_claim_at_zero():
    """Criterion 6: PASS when the interval's lower end is above 0, FAIL when its upper end is at or under 0."""
    cases = {
        (-0.4, 0.0): "FAIL",  # the upper end at 0
        (-0.4, np.nextafter(0.0, 1.0)): "undecided",
        (0.0, 0.5): "undecided",  # the lower end at 0, not above it
        (np.nextafter(0.0, 1.0), 0.5): "PASS",
    }
    rows = {"ctrl": both(row())}
    for (lo, hi), word in cases.items():
        checks = paper.claims(rows, ROLES, CRITERIA, [rank(lo, hi)], [], learned(rows))
        assert outcome(checks, "rank agreement") == [word], (lo, hi)


def test_a_control_without_a_result_fails_the_precondition():
    """A control whose run (or one of its evaluations) failed has no mean of at least ``control_mean``: the
    precondition is not met (FAIL, naming it) and no other claim gets a verdict, as for a control under the bar."""
    roles = {**ROLES, "ctrl_failed": "control"}
    rows = {"ctrl": both(row()), "base": both(row(**GAP)), "mean": both(row(**GAP))}
    for missing in ({}, {"prefix": row()}):  # the whole run, or its in-sequence evaluation
        checks = paper.claims({**rows, "ctrl_failed": missing}, roles, CRITERIA, [], [], learned(rows))
        assert outcome(checks, "precondition") == ["FAIL"]
        assert f"ctrl_failed in_sequence {paper.NO_RESULT}" in checks[0].detail
        assert all(not c.decided and c.detail.startswith("no verdict") for c in checks[1:])
    assert outcome(paper.claims(rows, roles, CRITERIA, [], [], learned(rows)), "precondition") == ["FAIL"]
    assert outcome(paper.claims(rows, ROLES, CRITERIA, [], [], learned(rows)), "precondition") == ["PASS"]


def test_a_padding_with_fewer_than_three_learned_variants_keeps_its_rank_line_undecided(tmp_path):
    """Every padding and metric keeps its Spearman line: with one learned variant (prefix) it reads undecided and
    says why (how many compressed runs finished, learned, and have the paper's row); the other padding, with three,
    has its interval. Without the paper's rows the cause is named the same way."""
    ids = {f"{v}/seed=42": f"p{v}" for v in "abc"}
    roles = dict.fromkeys(ids, "variant")
    rows = paper.run_rows(constructed({"a": 0.1, "b": 0.2, "c": 0.3}))
    write_csv(tmp_path / "paper.csv", {"pa": 10, "pb": 20, "pc": 30})  # ranks as ckv's: rho 1 where judged
    theirs = paper.read_paper(tmp_path / "paper.csv")[0]
    learned_ = {(lab, "in_sequence") for lab in ids} | {("a/seed=42", "prefix")}
    lines = paper.rank_lines(rows, ids, roles, theirs, learned_)
    assert [(x.padding, x.n, x.rho, x.lower) for x in lines][:2] == [("prefix", 1, None, None)] * 2
    counts = "3 of 3 compressed runs finished, 1 of them learned, 1 of those have the paper's row"
    assert lines[0].why == f"no interval under {paper.MIN_RANK_PAIRS} pairs: {counts}"
    assert all(x.n == 3 and x.lower is not None and x.why == "" for x in lines[2:])
    checks = paper.claims({"ctrl": both(row())}, {"ctrl": "control"}, CRITERIA, lines, [], set())
    assert outcome(checks, "rank agreement") == ["undecided", "undecided", "PASS", "PASS"]
    assert lines[0].why in detail(checks, "rank agreement")
    none = paper.rank_lines(rows, ids, roles, {}, learned_)
    assert [x.n for x in none] == [0] * 4 and none[2].why.endswith("3 of them learned, 0 of those have the paper's row")


def test_every_study_passes_its_flat_margin_to_its_evaluations():
    """A study's ``criteria.flat_margin`` is the margin its evaluations' verdicts use: every eval.py command of every
    run, at every scale, quick or not, ends up with ``stats.equivalence_margin`` at that number (the last override
    wins), a key eval.py's config has."""
    assert OmegaConf.select(OmegaConf.load(ROOT / "conf" / "eval" / "config.yaml"), "stats.equivalence_margin")
    checked = []
    for name in sorted(p.stem for p in STUDY_DIR.glob("*.yaml")):
        base = load_study(name)
        for study in [base, *(load_study(name, s) for s in base.scales)]:
            if "flat_margin" not in study.criteria:
                continue
            checked.append(name)
            for run, quick in itertools.product(study.runs, (False, True)):
                for _, cmd in eval_commands(run, Path("out"), quick, study.task, study.evals).values():
                    margins = [x.split("=", 1)[1] for x in cmd if x.startswith("stats.equivalence_margin=")]
                    assert margins and float(margins[-1]) == study.criteria["flat_margin"], (name, run.label, cmd)
    assert "paper" in checked


def test_every_role_a_studys_claims_read_is_a_role_of_its_runs():
    """Every role a study's claims read (its report module's ``CLAIM_ROLES``; make paper's: the controls, the
    baseline and the roles of criteria 4 and 5) is the role of some run of the study, at every scale, so that no
    claim silently has nothing to read. A study's report module must import (the report runs after hours of
    training)."""
    checked = []
    for name in sorted(p.stem for p in STUDY_DIR.glob("*.yaml")):
        base = load_study(name)
        if not base.report:
            continue
        module = importlib.import_module(base.report.split(":")[0])
        for study in [base, *(load_study(name, s) for s in base.scales)]:
            if hasattr(module, "CLAIM_ROLES"):
                checked.append(name)
                assert set(module.CLAIM_ROLES) <= {r.role for r in study.runs}, name
    assert "paper" in checked


def lookup_report(stride: int, dip: float, modulus: int = 24) -> dict:
    """A lookup report's per-residue groups: accuracy 0.9 but ``dip`` lower at phase S - 1 (intervals +- 5 pp)."""
    acc = [0.9 - (dip if r % stride == stride - 1 else 0.0) for r in range(modulus)]
    groups = [{"group": r, "accuracy": a, "lower": a - 0.05, "upper": a + 0.05} for r, a in enumerate(acc)]
    return {"modulus": modulus, "stride": stride, "residue": {"groups": groups}}


def analysis_envelope(path: Path, name: str, results: dict) -> str:
    """``path`` written as eval.py writes an analysis (``{"analysis": {"results": ...}}``); returns its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"analysis": {"name": name, "results": results}}))
    return str(path)


def analyses_of_a_baseline_seed(folder: Path, label: str) -> dict:
    """A baseline seed's (``label``) ``analyses`` records (``run_analyses``): knock-out, gates and gate cycling,
    constructed."""
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
        name: {"label": label, "analysis": name, "file": analysis_envelope(folder / f"{name}.json", name, r)}
        for name, r in results.items()
    }


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """The figures the report draws, by file name, kept instead of written."""
    return kept_figures(monkeypatch, eval_plots, analysis_plots)


def test_the_figures_show_what_the_paper_page_promises(figures, tmp_path):
    """Constructed runs (no training): a control, two baseline seeds with their analyses, a mean-pooled run with
    one padding evaluated (its gate analyses skipped) and a run that did not finish. The curves: one panel per run
    in the paper's order, dotted lines between phase S - 1 and phase 0 on the compressed runs only, the paper's mean
    dashed in its padding's colour, "no results" on the missing run; the heatmap: a row per run in that order, on
    0-100%, grey where a run has no result; the mechanisms: a row per baseline seed. Each figure is named in the
    report's lines, and a skipped analysis is one line with its reason."""
    study = load_study("paper")
    ids = {"full_kv1/seed=42": "full_attn_1kv", "w8s8/seed=42": "kvc_w8s8_1kv_baseline"}
    ids |= {"w8s8/seed=43": "kvc_w8s8_1kv_baseline_seed43"}
    ids |= {"w8s8_mean/seed=42": "kvc_w8s8_1kv_meanpool", "w4s4/seed=42": "kvc_w4s4_1kv"}
    roles = {r.label: r.role for r in study.runs}
    skip = "ckv: error: analysis=gates needs learned gates, but w8s8_mean pools by uniform averaging"
    done = [
        {"run": Run("paper_cpu", 42, "control", name="full_kv1"), "evaluations": both(lookup_report(8, 0.0))},
        *(
            {
                "run": Run("paper_cpu", seed, "baseline", name="w8s8"),
                "evaluations": both(lookup_report(8, 0.5)),
                "analyses": analyses_of_a_baseline_seed(tmp_path / f"w8s8_{seed}", f"w8s8/seed={seed}"),
            }
            for seed in (42, 43)
        ),
        {
            "run": Run("paper_cpu", 42, "mean", name="w8s8_mean"),
            "evaluations": {"prefix": lookup_report(8, 0.3)},  # the in-sequence evaluation missing: a grey row
            "analyses": {"gates": {"label": "w8s8_mean/seed=42", "analysis": "gates", "skipped": skip}},
        },
    ]
    paper_rows = {("kvc_w8s8_1kv_baseline", "prefix"): {"mean": (0.7, None, None)}}
    paths, lines = paper.figures(done, ids, roles, paper_rows, tmp_path)
    assert {name: Path(p).name for name, p in paths.items()} == {
        "curves": "paper_curves.png",
        "heatmap": "paper_heatmap.png",
        "mechanisms": "paper_mechanisms.png",
    }
    assert [f"  {name}: {p}" for name, p in paths.items()] == lines[1 : 1 + len(paths)]
    assert f"  w8s8_mean/seed=42 gates: skipped ({skip})" in lines
    assert sum("w8s8_mean" in x for x in lines) == 1  # one line, not an error

    panels = [ax for ax in figures["paper_curves.png"].axes if ax.get_visible()]
    assert [ax.get_title().split(" (")[0] for ax in panels] == list(ids)  # the paper's order, missing run included
    modulus = lookup_report(8, 0.0)["modulus"]
    legend = {
        t.get_text(): h.get_color()
        for t, h in zip(
            figures["paper_curves.png"].legends[0].get_texts(), figures["paper_curves.png"].legends[0].legend_handles
        )
    }
    for ax, label in zip(panels, ids):
        dotted = sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":")
        solid = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        stride = None if roles[label] == "control" or label not in {d["run"].label for d in done} else 8
        assert dotted == ([] if stride is None else [b - 0.5 for b in range(stride, modulus, stride)]), label
        assert [line.get_color() for line in solid] == [legend[pad] for pad in done_paddings(done, label)], label
        assert ax.get_ylim() == (0.0, 100.0)
        if label == "w8s8/seed=42":  # the paper's prefix mean, dashed in the prefix curve's colour
            assert [(line.get_ydata()[0], line.get_color()) for line in dashed] == [(70.0, legend["prefix"])]
        else:
            assert dashed == []
    assert panels[-1].get_title() == "w4s4/seed=42 (no results)" and panels[-1].get_lines() == []

    heat = [ax for ax in figures["paper_heatmap.png"].axes if ax.images]
    assert [ax.get_title() for ax in heat] == list(paper.PADDINGS)
    assert [t.get_text() for t in heat[0].get_yticklabels()] == list(ids)  # the rows, shared by both panels
    assert heat[0].get_shared_y_axes().joined(*heat)
    for ax, pad in zip(heat, paper.PADDINGS):
        image = ax.images[0]
        grey = np.ma.getmaskarray(image.get_array()).all(axis=1)  # a row drawn in the bad (grey) colour
        assert grey.tolist() == [pad not in done_paddings(done, label) for label in ids], pad
        assert image.get_clim() == (0, 100) and image.get_cmap().get_bad()[:3] == pytest.approx((0.85,) * 3)

    rows = [ax for ax in figures["paper_mechanisms.png"].axes if ax.get_ylabel().startswith("w8s8/seed=")]
    assert [ax.get_ylabel().split("\n")[0] for ax in rows] == ["w8s8/seed=42", "w8s8/seed=43"]  # a row per seed
    titles = [ax.get_title() for ax in figures["paper_mechanisms.png"].axes]
    assert sum(t.startswith("gate cycling; pooled") for t in titles) == 2
    assert sum(t.startswith("knock-out of each layer") for t in titles) == 2

    panels = paper.curve_panels(done, ids, roles, ids, paper_rows)
    assert [p.stride for p in panels] == [None, 8, 8, 8, None]  # no stride lines for full attention
    assert panels[1].reference == {"prefix": 0.7} and panels[-1].reports == {}


def done_paddings(done: list[dict], label: str) -> list[str]:
    """The paddings ``label`` was evaluated under, in the report's order (none for a run that did not finish)."""
    return next((list(d["evaluations"]) for d in done if d["run"].label == label), [])


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
