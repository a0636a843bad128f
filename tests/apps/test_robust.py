"""make robust: the plan's runs, the KV-memory figure against a real decoding cache, and the quick runs of make
robust, robust-confirm and robust-ablation."""

import json
from pathlib import Path

import pytest

from ckv.apps.robust import (
    ABLATION_SEEDS,
    CONFIRM_MODELS,
    CONFIRM_SEEDS,
    LADDER,
    MODEL_BY_RUN,
    MODELS,
    SEEDS,
    criteria,
    plan,
    resolve_seeds,
)
from ckv.apps.robust import main as robust_main
from ckv.apps.robust_confirm import confirm_verdicts
from ckv.apps.study_config import ROOT
from tests.apps.helpers import run_quick


def test_plan_runs_the_core_models_of_each_task_for_each_seed_with_one_attention_override():
    runs = plan(("split", "dense"), (0, 1))
    core = [(t, m) for t, models in MODELS.items() for m in models if m.core]
    assert len(runs) == 2 * len(core) == 12  # make robust's six runs of one seed fit its 30 minutes
    # the core set of each task: its baseline, V4's compressor and the control
    for models in MODELS.values():
        assert sorted(m.role for m in models if m.core) == ["baseline", "control", "fix"]
        assert [m.name for m in models if m.core and m.role == "fix"] == ["v4_csa_w8s4"]
    assert len(plan(("split", "dense"), (0, 1), everything=True)) == 2 * sum(len(m) for m in MODELS.values())
    assert len({(r.name, r.seed) for r in runs}) == len(runs)
    for r in runs:
        task, model = r.experiment.removeprefix("robust_"), MODEL_BY_RUN[r.name]
        assert r.name == f"{task}_{model.name}" and r.role == model.role
        assert r.train_overrides == tuple(model.option.split())
        # only the control, which has no stride, is told which phase period to report
        assert bool(r.eval_overrides) == (r.role == "control")
    # --models and --confirm: exactly the named models, in the order named (the confirmation's baseline and
    # control first)
    only = plan(("split", "dense"), (0,), only=("full", "heads_w8s8_kv2", "gate_w4s4"))
    assert [r.name for r in only] == ["split_full", "split_gate_w4s4", "dense_full", "dense_heads_w8s8_kv2"]
    for task, models in MODELS.items():
        names = [m.name for m in models]
        assert [m.role for m in models].count("control") == 1 and len(set(names)) == len(names)
        assert (ROOT / "conf" / "experiment" / f"robust_{task}.yaml").is_file()
        for m in models:
            attention = next(o for o in m.option.split() if o.startswith("attention="))
            assert (ROOT / "conf" / "attention" / f"{attention.removeprefix('attention=')}.yaml").is_file()
            # every fix names a baseline of its own task, and only fixes do
            assert (m.baseline is not None) == (m.role == "fix")
            if m.baseline is not None:
                assert next(b for b in models if b.name == m.baseline).role == "baseline"


def _row(
    model: str,
    role: str,
    seed: int,
    worst: float,
    gap_lower: float = 0.0,
    p: float = 0.5,
    baseline=None,
    verdict: str = "flat",
) -> dict:
    return {
        "task": "split",
        "model": model,
        "role": role,
        "baseline": baseline,
        "seed": seed,
        "mean": worst + 0.01,
        "worst_phase_accuracy": worst,
        "phase_gap": gap_lower + 0.02,
        "phase_gap_lower": gap_lower,
        "phase_gap_upper": gap_lower + 0.04,
        "phase_p_value": p,
        "phase_noise_floor": 0.05,
        "phase_upper_one_sided": gap_lower + 0.04,
        "phase_margin": 0.05,
        "phase_verdict": verdict,
        "phase_mde": 0.04,
    }


def test_seeds_default_to_the_commands_own_and_quick_takes_the_first():
    assert resolve_seeds(None, False, False, False) == SEEDS == (0,)
    assert resolve_seeds(None, False, True, False) == ABLATION_SEEDS == (0, 1)  # the ladder's two seeds
    assert resolve_seeds(None, True, False, False) == CONFIRM_SEEDS
    assert resolve_seeds(None, True, False, True) == CONFIRM_SEEDS[:1]
    assert resolve_seeds([3, 1], False, True, False) == (3, 1) and resolve_seeds([3, 1], False, False, True) == (3,)


def test_an_added_fix_brings_its_baseline_and_models_stays_exact():
    added = plan(("dense",), (0,), add=("conv_w8s8",))
    assert [r.name for r in added if r.role != "control"] == [
        "dense_gate_w8s4",
        "dense_v4_csa_w8s4",
        "dense_gate_w8s8",
        "dense_conv_w8s8",
    ]
    assert [r.name for r in plan(("dense",), (0,), only=("conv_w8s8",))] == ["dense_conv_w8s8"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--confirm", "--seeds", "7"], "--confirm trains the seeds its committed criteria name"),
        (["--seeds", "0", "0"], "distinct seeds >= 0"),
        (["--seeds", "-1"], "distinct seeds >= 0"),
    ],
)
def test_bad_seeds_are_one_line_errors_before_anything_trains(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        robust_main([*argv, "--out", str(tmp_path / "robust")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "robust").exists()


def test_criteria_need_every_seed():
    rows = [_row("gate_w4s4", "baseline", s, 0.10, gap_lower=0.7, p=0.0005, verdict="gap") for s in (0, 1)]
    rows += [_row("full", "control", s, 0.88) for s in (0, 1)]
    # seed 0 clears both bars, seed 1 only the minimum: the goal is not met
    rows += [
        _row("conv_w4s4", "fix", 0, 0.86, baseline="gate_w4s4"),
        _row("conv_w4s4", "fix", 1, 0.50, gap_lower=0.3, p=0.001, baseline="gate_w4s4", verdict="gap"),
    ]
    # near full attention in both seeds, but one seed's gap is undecided (neither real nor bounded under the
    # margin): not flat, so the goal is not met
    rows += [
        _row("entropy_w4s4", "fix", 0, 0.86, baseline="gate_w4s4"),
        _row("entropy_w4s4", "fix", 1, 0.86, baseline="gate_w4s4", verdict="undecided"),
    ]
    # +29 pp in one seed is below the minimum
    rows += [
        _row("stagger_w4s4", "fix", 0, 0.39, baseline="gate_w4s4"),
        _row("stagger_w4s4", "fix", 1, 0.90, baseline="gate_w4s4"),
    ]
    # both seeds flat and within 5 pp of full attention's worst phase (0.88): both bars cleared
    rows += [_row("overlap_w8s4", "fix", s, 0.85, baseline="gate_w4s4") for s in (0, 1)]
    got = {c.claim.split(":")[0] + (" goal" if "within" in c.claim else " min"): c.passed for c in criteria(rows)}
    assert got == {
        "split/conv_w4s4 min": True,
        "split/conv_w4s4 goal": False,
        "split/entropy_w4s4 min": True,
        "split/entropy_w4s4 goal": False,
        "split/stagger_w4s4 min": False,
        "split/stagger_w4s4 goal": False,
        "split/overlap_w8s4 min": True,
        "split/overlap_w8s4 goal": True,
    }
    # a fix whose baseline or control did not run in every seed is not judged, and says which is missing
    for gone, seeds in (("gate_w4s4", (0, 1)), ("full", (1,))):
        unjudged = criteria([r for r in rows if not (r["model"] == gone and r["seed"] in seeds)])
        assert len(unjudged) == 4 and not any(c.passed for c in unjudged)
        assert all(
            c.claim.endswith(f"not judged: {gone} not among this command's runs in every seed") for c in unjudged
        )
    # nor is the goal against a control that has not learned the task (the earlier kv dense task's control: 13-14%)
    weak = [dict(r, mean=0.13, worst_phase_accuracy=0.12) if r["role"] == "control" else r for r in rows]
    goal = [c for c in criteria(weak) if "goal" in c.claim]
    assert len(goal) == 4 and not any(c.passed for c in goal) and "not learned" in goal[0].claim


def _confirm_row(model: str, seed: int, phases: list[float], half: float = 0.02, verdict: str = "flat") -> dict:
    row = _row(model, "fix", seed, min(phases), verdict=verdict)
    mean = sum(phases) / len(phases)
    return dict(
        row,
        mean=mean,
        mean_lower=mean - half / 2,
        mean_upper=mean + half / 2,
        per_phase=phases,
        per_phase_lower=[a - half for a in phases],
        per_phase_upper=[a + half for a in phases],
    )


def test_confirm_verdicts_follow_the_committed_criteria():
    seeds = CONFIRM_SEEDS
    rows = [_confirm_row("gate_w4s4", s, [0.6, 0.9, 0.6, 0.1], verdict="gap") for s in seeds]
    rows += [_confirm_row("full", s, [0.88] * 4, half=0.01) for s in seeds]
    # flat and every phase within the margin in every seed: confirmed
    rows += [_confirm_row("v4_csa_w8s4", s, [0.87, 0.86, 0.87, 0.86], half=0.01) for s in seeds]
    # flat in every seed, but one seed 9 pp under the control: flat, not as good as full attention
    rows += [_confirm_row("v4_csa_conv_w8s4", s, [0.87] * 4, half=0.01) for s in seeds[:2]]
    rows += [_confirm_row("v4_csa_conv_w8s4", seeds[2], [0.79, 0.78, 0.79, 0.79], half=0.01)]
    got = {c.claim.split(":")[0]: c.passed for c in confirm_verdicts(rows)}
    assert got == {
        "validity": True,
        "C1 v4_csa_w8s4": True,
        "C2 v4_csa_w8s4": True,
        "verdict v4_csa_w8s4": True,
        "C1 v4_csa_conv_w8s4": True,
        "C2 v4_csa_conv_w8s4": False,
        "verdict v4_csa_conv_w8s4": False,
    }
    claims = [c.claim for c in confirm_verdicts(rows)]
    assert "verdict v4_csa_conv_w8s4: flat, not as good as full attention" in claims
    # within 5 pp on the point estimate but not with its uncertainty: a wide interval fails C2
    wide = [
        dict(r, per_phase_lower=[a - 0.2 for a in r["per_phase"]]) if r["model"] == "v4_csa_w8s4" else r for r in rows
    ]
    assert not next(c for c in confirm_verdicts(wide) if c.claim.startswith("C2 v4_csa_w8s4")).passed
    # one seed undecided: not flat, not confirmed
    undecided = [
        dict(r, phase_verdict="undecided") if (r["model"], r["seed"]) == ("v4_csa_w8s4", seeds[0]) else r for r in rows
    ]
    assert "verdict v4_csa_w8s4: not confirmed" in [c.claim for c in confirm_verdicts(undecided)]
    # a baseline without a real gap voids the confirmation: only the validity checks are printed
    void = [dict(r, phase_verdict="flat") if r["model"] == "gate_w4s4" else r for r in rows]
    assert [c.passed for c in confirm_verdicts(void)] == [True, False]
    # a missing seed of the control: nothing is judged
    assert confirm_verdicts([r for r in rows if (r["model"], r["seed"]) != ("full", seeds[1])]) == []


@pytest.mark.slow  # make robust shares make demo's pipeline (ckv.apps.study.run_plan), whose quick run CI keeps
def test_quick_robust_writes_a_table_a_plot_and_a_record(tmp_path):
    out = tmp_path / "robust"
    proc = run_quick("ckv.apps.robust", out, "--task", "dense", "--add", "entropy_w8s4", "gate_w8s8")
    record = json.loads((out / "robust.json").read_text())
    rows = record["rows"]
    added = ("entropy_w8s4", "gate_w8s8")
    assert [r["model"] for r in rows] == [m.name for m in MODELS["dense"] if m.core or m.name in added]
    for r in rows:
        assert len(r["per_phase"]) == r["stride"] and min(r["per_phase"]) == pytest.approx(r["worst_phase_accuracy"])
        assert 0.0 <= r["phase_gap_lower"] <= r["phase_gap"] <= r["phase_gap_upper"] <= 1.0
        assert r["steps"] == 12 and r["parameters"] > 0
    by_model = {r["model"]: r for r in rows}
    # equal memory within a geometry, the control stores one key and value per token
    assert by_model["entropy_w8s4"]["kv_bytes_per_token"] == by_model["gate_w8s4"]["kv_bytes_per_token"]
    assert by_model["full"]["kv_bytes_per_token"] == 8 * by_model["gate_w8s8"]["kv_bytes_per_token"]
    assert by_model["entropy_w8s4"]["parameters"] == by_model["gate_w8s4"]["parameters"]  # a loss term only
    assert 2 * by_model["v4_csa_w8s4"]["kv_bytes_per_token"] == by_model["gate_w8s4"]["kv_bytes_per_token"]  # K = V
    # the crowding analysis ran on every compressed model of the dense task and names its gates' concentration
    analysed = {a["label"] for a in record["crowding"]}
    assert analysed == {f"dense_{m}/seed=0" for m in ("gate_w8s4", "entropy_w8s4", "v4_csa_w8s4", "gate_w8s8")}
    for a in record["crowding"]:
        assert all(1.0 <= u["k_static"] <= a["window"] + 1e-6 for u in a["layers"])
    assert "crowding analysis" in proc.stdout
    data = Path(record["plot"]).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    Path(record["plot"]).unlink()  # --replot redraws it from robust.json alone
    assert robust_main(["--out", str(out), "--replot"]) == 0 and Path(record["plot"]).read_bytes()[:8] == data[:8]


@pytest.mark.slow  # make robust shares make demo's pipeline (ckv.apps.study.run_plan), whose quick run CI keeps
@pytest.mark.parametrize(
    "flag, models, seed, heading",
    [
        ("--confirm", CONFIRM_MODELS, CONFIRM_SEEDS[0], None),  # one seed: no verdict is judged
        ("--ablation", LADDER, ABLATION_SEEDS[0], "ablation ladder"),
    ],
)
def test_quick_confirm_and_ablation_end_with_their_table_plot_and_record(flag, models, seed, heading, tmp_path):
    out = tmp_path / flag.removeprefix("--")
    proc = run_quick("ckv.apps.robust", out, flag)
    record = json.loads((out / "robust.json").read_text())
    assert [(r["task"], r["model"], r["seed"], r["steps"]) for r in record["rows"]] == [
        ("split", m, seed, 12) for m in models
    ]
    assert record["confirmation"] == [] and record["crowding"] == []  # one seed; the split task is not analysed
    assert heading is None or f"{heading} (split task" in proc.stdout
    data = Path(record["plot"]).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
