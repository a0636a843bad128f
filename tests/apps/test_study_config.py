"""``ckv.apps.study_config.select_runs``: the generic command's ``--runs`` filter, on the paper's study (its labels
and patterns), with its one-line error and its dry run."""

import pytest

from ckv.apps.study import main
from ckv.apps.study_config import load_study, select_runs
from ckv.checks import ConfigError


def test_runs_keep_the_labels_a_pattern_matches_in_the_studys_order():
    study = load_study("paper")
    picked = select_runs(study, "w8s8/seed=4[34], full_kv*/*")
    assert [r.label for r in picked.runs] == [
        r.label for r in study.runs if r.label.startswith("full_kv") or r.label in ("w8s8/seed=43", "w8s8/seed=44")
    ]
    assert len(picked.runs) == 5 and picked.analyses == study.analyses
    assert [r.label for r in select_runs(study, "w8s8/*").runs] == [f"w8s8/seed={s}" for s in (42, 43, 44, 45)]


@pytest.mark.parametrize("patterns", ["w8s8/seed=42,nothing/*", "w8s8", ","])
def test_a_pattern_that_matches_no_run_is_a_one_line_error_naming_the_labels(patterns):
    study = load_study("paper")
    with pytest.raises(ConfigError) as e:
        select_runs(study, patterns)
    message = str(e.value)
    assert "\n" not in message and all(r.label in message for r in study.runs)
    assert "w8s8/seed=42," not in message.split("--runs")[1].split(";")[0]  # names the unmatched pattern only


def test_the_dry_run_honours_runs_and_refuses_an_unmatched_pattern(capsys):
    assert main(["paper", "--dry-run", "--runs", "full_kv1/*,w8s8/seed=42"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted({x.split()[1] for x in lines if x.startswith("train ")}) == ["full_kv1/seed=42:", "w8s8/seed=42:"]
    assert lines[-1] == f"2 runs, {len(lines) - 1} jobs"
    assert main(["paper", "--dry-run", "--runs", "w9s9/*"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "w9s9/*" in err[0] and "full_kv1/seed=42" in err[0]
