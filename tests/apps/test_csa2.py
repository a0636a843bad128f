"""make csa2's study (conf/study/csa2.yaml): its runs (the dry run), every variant's config (phase stride, the costs
by ckv's accounting, a shared cache counted once), the questions' rules at their boundaries and every claim of its
report on constructed rows (the criteria read from the study, as tests/apps/test_pretrain.py does), and the quick
run end to end."""

from __future__ import annotations

import pytest

from ckv.apps import csa2
from ckv.apps.study import main
from ckv.apps.study_config import load_study

from .helpers import claim_row, run_quick

STUDY = load_study("csa2")
CRITERIA = STUDY.criteria
BAR, MARGIN, DIFF, CONTROL = (
    CRITERIA["learned_best"],
    CRITERIA["flat_margin"],
    CRITERIA["diff_margin"],
    CRITERIA["control_mean"],
)
QUESTIONS = STUDY.params["questions"]
SEEDS = (42, 43, 44)


def test_the_dry_run_lists_every_variant_with_three_seeds_and_both_paddings(capsys) -> None:
    assert main(["csa2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "21 runs, 63 jobs"
    seeds = csa2.seeds_of(STUDY)
    assert all(s == list(SEEDS) for s in seeds.values())  # three seeds on every row a claim reads
    named = {x for a, b in csa2.pairs_of(STUDY) for x in (a, b)} | set(STUDY.params["figure"])
    assert named <= set(seeds)  # every question, comparison and figure names runs of the study
    assert {r.experiment for r in STUDY.runs} == {"csa2_cpu"}  # one recipe for every run
    control = [x for x in lines if x.startswith("eval  full_kv1/seed=42 [prefix]")]
    assert control and "task.stride=4" in control[0]  # read mod V4's stride (phase_of: deepseek_w8s4)
    assert sum("task.padding=in_sequence" in x for x in lines) == 21


def test_every_variant_composes_with_its_stride_and_its_costs() -> None:
    """The configs train.py composes (4 layers each): the model's phase stride is the compressor's ratio, V4's
    stride, or a schedule's compressed layers' stride; a shared cache is counted once (ckv.flops)."""
    cost = csa2.costs(STUDY)
    assert {n: c["stride"] for n, c in cost.items()} == {
        "full_kv1": None,
        "deepseek_w8s4": 4,
        "v41_r2": 2,
        "v41_r4": 4,
        "v41_r2_shared": 2,
        "schedule_r1": 2,
        "schedule_r2": 2,
    }
    kv = {n: c["kv_long"] for n, c in cost.items()}
    assert kv["v41_r2_shared"] == pytest.approx(kv["v41_r2"] / 2, rel=1e-3)  # two sources of four layers
    assert kv["v41_r4"] == pytest.approx(kv["v41_r2"] / 2, rel=1e-3)  # half the entries
    assert kv["schedule_r1"] == pytest.approx(kv["full_kv1"] / 4 + kv["v41_r2"] / 4, rel=1e-3)  # full src + one r2
    assert kv["schedule_r2"] == pytest.approx(kv["v41_r2"] / 2, rel=1e-3)
    assert cost["v41_r2_shared"]["layers"] == (
        "1x compressed kv=source + 1x sliding kv=shared + 1x compressed kv=source + 1x sliding kv=shared"
    )
    assert all(c["flops_long"] > c["flops_prompt"] for c in cost.values())


def d(value: float, lower: float, upper: float) -> dict:
    return {"value": value, "lower": lower, "upper": upper}


def test_the_shrinks_rule_at_its_boundaries() -> None:
    shrinks = csa2.shrinks
    assert shrinks([d(-0.1, -0.15, -0.05)] * 3, DIFF) is True
    assert shrinks([d(-0.1, -0.15, 0.0)] + [d(-0.1, -0.15, -0.05)] * 2, DIFF) is None  # an upper bound of 0 is not
    assert shrinks([d(0.0, -DIFF + 0.001, 0.02)] * 3, DIFF) is False  # no seed shrinks it by the margin
    assert shrinks([d(0.0, -DIFF, 0.02)] * 3, DIFF) is None  # a lower bound of exactly -margin is not above it
    assert shrinks([d(0.1, 0.05, 0.15)] * 3, DIFF) is False  # a larger gap: it does not shrink
    assert shrinks([d(-0.1, -0.15, -0.05), d(0.1, 0.05, 0.15)], DIFF) is None  # seeds disagree
    assert shrinks([], DIFF) is None and shrinks([d(0.0, None, None)], DIFF) is None


def test_the_changes_rule_at_its_boundaries() -> None:
    changes = csa2.changes
    assert changes([d(-0.1, -0.15, -0.05)] * 3, DIFF) is True
    assert changes([d(0.02, 0.001, 0.03)] * 3, DIFF) is True  # significance first: inside the margin but above 0
    assert changes([d(0.02, 0.0, 0.03)] * 3, DIFF) is False  # a lower bound of 0 is not above 0; inside the margin
    assert changes([d(0.0, -DIFF, 0.02)] * 3, DIFF) is None  # not inside (-margin, margin)
    assert changes([d(0.0, -0.02, DIFF)] * 3, DIFF) is None
    assert changes([d(-0.1, -0.15, -0.05), d(0.1, 0.05, 0.15)], DIFF) is None  # opposite directions
    assert changes([], DIFF) is None


def row(gap: float = 0.01, p: float = 0.5, floor: float = 0.02, worst: float = 0.9, stride: int = 2, **kw) -> dict:
    """A constructed claim row of this study (``helpers.claim_row`` at its flat margin)."""
    return claim_row(MARGIN, gap, p, floor, worst, stride, **kw)


def gap_row(gap: float = 0.3, stride: int = 2, period: int | None = None, **kw) -> dict:
    """A significant gap repeating at ``period`` (default: the stride)."""
    return row(
        gap=gap, p=0.001, floor=0.03, worst=0.6, stride=stride, period=period or stride, one_sided=gap + 0.02, **kw
    )


def both(r: dict) -> dict:
    return {"prefix": r, "in_sequence": r}


ROLES = {f"{n}/seed={s}": role for n, role in (("ctrl", "control"), ("a", "v41"), ("b", "v4")) for s in SEEDS}


class Study:
    """A stand-in for the study with one question [a, b] of ``rule`` (``closes`` optional), the real criteria."""

    def __init__(self, rule: str, closes: bool = False) -> None:
        self.criteria = CRITERIA
        self.runs = [
            type("R", (), {"name": n, "experiment": "e", "seed": s})() for n in ("ctrl", "a", "b") for s in SEEDS
        ]
        self.params = {
            "questions": {"Q": {"ask": "a shrinks it", "rule": rule, "closes": closes, "pairs": [["a", "b"]]}}
        }


def checks_of(rows: dict, diffs: dict, rule: str = "shrinks", closes: bool = False) -> list:
    return csa2.claims(Study(rule, closes), rows, ROLES, diffs, {})


def verdicts(checks, start: str) -> list[str]:
    return [("PASS" if c.passed else "FAIL" if c.decided else "undecided") for c in checks if c.claim.startswith(start)]


def rows_with(a: dict, b: dict, ctrl: dict | None = None) -> dict:
    rows = {f"ctrl/seed={s}": both(ctrl or row()) for s in SEEDS}
    rows |= {f"a/seed={s}": both(a) for s in SEEDS} | {f"b/seed={s}": both(b) for s in SEEDS}
    return rows


def diffs_of(gap: dict) -> dict:
    return {
        ("a", "b", s, pad): {"gap": gap, "worst": gap, "mean": gap} for s in SEEDS for pad in ("prefix", "in_sequence")
    }


def test_each_claim_passes_fails_or_stays_undecided_on_constructed_rows() -> None:
    rows = rows_with(row(), gap_row(stride=4))
    checks = checks_of(rows, diffs_of(d(-0.29, -0.33, -0.25)))
    assert verdicts(checks, "precondition") == ["PASS"]
    assert verdicts(checks, "ctrl/seed=42 prefix: flat") == ["PASS"] and "80.0% power" in checks[1].detail
    assert verdicts(checks, "prefix: the dominant period") == ["PASS"]  # b's gap repeats at its stride
    assert verdicts(checks, "Q prefix") == ["PASS"] and verdicts(checks, "Q in_sequence") == ["PASS"]
    assert "% of b's gap closed" in next(c for c in checks if c.claim.startswith("Q prefix")).detail
    # a control with a significant gap is not flat; a compressed run at another period fails the period claim
    rows = rows_with(row(), gap_row(stride=4, period=8), ctrl=gap_row(stride=4, mean=0.9))
    checks = checks_of(rows, diffs_of(d(0.0, -0.01, 0.01)))
    assert verdicts(checks, "ctrl/seed=43 in_sequence: flat") == ["FAIL"]
    assert verdicts(checks, "in_sequence: the dominant period") == ["FAIL"]
    assert verdicts(checks, "Q prefix") == ["FAIL"]  # no seed shrinks it by the margin


def test_the_precondition_and_the_learned_bar() -> None:
    below = row(mean=CONTROL - 0.001)
    checks = checks_of(rows_with(row(), gap_row(), ctrl=below), diffs_of(d(-0.29, -0.33, -0.25)))
    assert verdicts(checks, "precondition") == ["FAIL"]
    assert verdicts(checks, "Q prefix") == ["undecided"] and "no verdict" in checks[-1].detail
    at = row(mean=CONTROL)
    assert verdicts(checks_of(rows_with(row(), gap_row(), ctrl=at), {}), "precondition") == ["PASS"]
    # a compressed run whose best group (worst + gap) is under the bar joins no claim; exactly at the bar it does
    unlearned = row(worst=BAR - 0.02, gap=0.01)
    checks = checks_of(rows_with(unlearned, gap_row()), diffs_of(d(-0.29, -0.33, -0.25)))
    assert verdicts(checks, "Q prefix") == ["undecided"]
    assert "not learned: a/seed=42" in next(c for c in checks if c.claim.startswith("Q prefix")).detail
    learned = row(worst=BAR - 0.01, gap=0.01)
    checks = checks_of(rows_with(learned, gap_row()), diffs_of(d(-0.29, -0.33, -0.25)))
    assert verdicts(checks, "Q prefix") == ["PASS"]
    # a seed without a result, or without a paired difference, leaves the question undecided
    rows = rows_with(row(), gap_row())
    del rows["a/seed=44"]
    assert verdicts(checks_of(rows, diffs_of(d(-0.29, -0.33, -0.25))), "Q prefix") == ["undecided"]
    assert verdicts(checks_of(rows_with(row(), gap_row()), {}), "Q prefix") == ["undecided"]


def test_the_changes_question_says_its_direction_and_closes_reads_a_flat_in_every_seed() -> None:
    checks = checks_of(rows_with(gap_row(gap=0.6), gap_row()), diffs_of(d(0.3, 0.25, 0.35)), rule="changes")
    q = next(c for c in checks if c.claim.startswith("Q prefix"))
    assert q.passed and "larger in every seed" in q.detail
    checks = checks_of(rows_with(row(), gap_row()), diffs_of(d(-0.29, -0.33, -0.25)), closes=True)
    assert verdicts(checks, "Q prefix: a closes the gap") == ["PASS"]
    checks = checks_of(rows_with(gap_row(gap=0.1), gap_row()), diffs_of(d(-0.2, -0.25, -0.15)), closes=True)
    assert verdicts(checks, "Q prefix: a closes the gap") == ["FAIL"]
    assert csa2.closes([], CRITERIA) is None
    undecided = row(one_sided=MARGIN)  # not significant, its upper bound not under the margin
    assert csa2.closes([row(), undecided], CRITERIA) is None


def test_the_study_s_questions_are_the_issue_s() -> None:
    assert [q["rule"] for q in QUESTIONS.values()] == ["shrinks", "changes", "shrinks"]
    assert QUESTIONS["Q1"]["pairs"] == [["v41_r2", "deepseek_w8s4"]]
    assert QUESTIONS["Q2"]["pairs"] == [["v41_r2_shared", "v41_r2"]]
    assert QUESTIONS["Q3"]["pairs"] == [["schedule_r1", "schedule_r2"]] and QUESTIONS["Q3"]["closes"]
    assert set(csa2.RULES) >= {q["rule"] for q in QUESTIONS.values()}


@pytest.mark.slow
def test_quick_csa2_pairs_each_question_s_runs_on_the_same_prompts(tmp_path) -> None:
    """The real study on the control, Q1's pair and Q3's pair of one seed (a few steps each): both paddings
    evaluated, the paired differences computed (the prompts pair), the costs beside the gaps, the claims, and both
    figures written."""
    runs = "full_kv1/seed=42,v41_r2/seed=42,deepseek_w8s4/seed=42,schedule_r1/seed=42,schedule_r2/seed=42"
    proc = run_quick("ckv.apps.study", tmp_path, "csa2", "--runs", runs)
    out = proc.stdout.splitlines()
    for q, pair in (("Q1", "v41_r2 - deepseek_w8s4"), ("Q3", "schedule_r1 - schedule_r2")):
        diff = [x for x in out if x.startswith(q) and pair in x]
        assert len(diff) == 2 and not any("n/a" in x for x in diff), diff  # both paddings paired
    assert any(x.startswith("schedule_r1") and "1x sliding + 1x compressed + 1x full kv=source" in x for x in out)
    claims = [x for x in out if x.startswith("  [")]
    assert any("precondition: every full-attention control's mean" in x for x in claims)
    assert sum("Q3" in x for x in claims) == 4  # shrinks and closes, both paddings
    assert (tmp_path / "csa2_curves.png").is_file() and (tmp_path / "csa2_phases.png").is_file()
    assert (tmp_path / "csa2_table.txt").is_file()
