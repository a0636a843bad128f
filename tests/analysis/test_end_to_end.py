"""Every analysis end to end on the tiny trained checkpoint, from its shipped config file (and one through eval.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from ckv.analysis import run_analysis
from ckv.analysis.gates import phase_profile
from ckv.analysis.joint_view import correlation, joint_rows
from ckv.apps.cli import EXIT_NOT_APPLICABLE
from ckv.eval import load_ckv_model
from tests.helpers import run_script

from ..eval.helpers import make_run, png_ok
from .conftest import SPEC, options

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "eval" / "analysis"


def _run(name: str, run: Path, out: Path, **params) -> dict:
    config = {**yaml.safe_load((CONF / f"{name}.yaml").read_text()), **params}
    env = run_analysis(config, load_ckv_model(run, device="cpu"), SPEC, options(out, plots=True))
    assert (out / name / f"{name}.json").is_file()
    return env["analysis"]["results"]


def test_knockout_end_to_end(trained_run: Path, tmp_path: Path) -> None:
    r = _run("knockout", trained_run, tmp_path, calibration=4)
    assert [u["label"] for u in r["units"]] == ["L0", "L0 kv0", "L0 kv1", "L1", "L1 kv0", "L1 kv1"]
    assert r["calibration"]["n_prompts"] == 16 and r["clean"]["headline"]["mean"] > 0.5
    for u in r["units"]:
        assert [p["phase"] for p in u["phases"]] == [0, 1, 2, 3]
        assert u["effect_lower"] <= u["effect"] <= u["effect_upper"]
    assert all(png_ok(tmp_path / "knockout" / f) for f in ("knockout_layers.png", "knockout_heads.png"))
    assert len((tmp_path / "knockout" / "knockout.csv").read_text().splitlines()) == 1 + 6 * 4
    assert len((tmp_path / "knockout" / "knockout_prompts.csv").read_text().splitlines()) == 1 + 8 * 4


def test_gates_end_to_end_over_checkpoints(trained_run: Path, tmp_path: Path) -> None:
    r = _run("gates", trained_run, tmp_path)
    assert len(r["gates"]) == 2 * 2 * 2  # layers x branches x KV heads
    for g in r["gates"]:
        assert all(1 - 1e-9 <= g[k] <= 4 + 1e-9 for k in ("static", "per_window"))  # between one-hot and uniform
        assert sum(g["profile"]) == pytest.approx(4.0)  # W times a distribution over the W offsets
    assert [c["step"] for c in r["checkpoints"]] == [100, 200, 250]
    assert r["checkpoints"][-1]["gates"] == r["gates"]  # the final model is the last checkpoint
    assert png_ok(tmp_path / "gates" / "gate_profiles.png") and png_ok(tmp_path / "gates" / "gate_training.png")


def test_gate_cycling_end_to_end(trained_run: Path, tmp_path: Path) -> None:
    r = _run("gate_cycling", trained_run, tmp_path, deltas=[0, 1, 2, 4])
    d0 = r["deltas"][0]
    assert d0["identical_to_clean"] and d0["observed"] == r["clean"]["accuracy"]
    assert d0["corr2_excl_boundary"]["value"] is None and d0["accuracy_change_pp"]["value"] == 0.0  # no prediction
    assert r["deltas"][3]["identical_to_clean"]  # a shift by W is the identity
    assert r["deltas"][1]["predicted"] == [r["clean"]["accuracy"][(p - 1) % 4] for p in range(4)]
    # per-phase intervals resample the key->value mappings (several shifts of one mapping share a phase)
    assert r["clean"]["interval"] == "cluster_bootstrap" and {d["interval"] for d in r["deltas"]} == {
        "cluster_bootstrap"
    }
    assert all(lo <= a <= hi for lo, a, hi in zip(r["clean"]["lower"], r["clean"]["accuracy"], r["clean"]["upper"]))
    assert set(r["pooled"]) == {"r2_identity_excl_boundary", "corr2_excl_boundary"}
    d1 = r["deltas"][1]
    assert d1["boundary_phases"] == [0, 3] and d1["mae_all_phases_pp"]["value"] == pytest.approx(
        100 * np.mean(np.abs(np.array(d1["observed"]) - d1["predicted"]))
    )
    assert png_ok(tmp_path / "gate_cycling" / "gate_cycling.png")


def test_joint_view_end_to_end(trained_run: Path, tmp_path: Path) -> None:
    r = _run("joint", trained_run, tmp_path, calibration=4)
    assert [(x["layer"], x["kv_head"]) for x in r["rows"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for x in r["rows"]:
        assert len(x["knockout"]) == 4 and len(x["k_profile"]) == 4 and len(x["v_profile"]) == 4
        assert x["k_phase_profile"] == pytest.approx(x["k_profile"])  # W == S: offset i is phase i
        assert x["v_phase_profile"] == pytest.approx(np.roll(x["v_profile"], -1))  # the paper's value roll
    assert png_ok(tmp_path / "joint" / "joint.png")


def test_correlation_known_answers() -> None:
    assert correlation([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert correlation([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert correlation([1.0, None, 3.0], [1.0, 2.0, 3.0]) is None and correlation([1.0, 1.0], [1.0, 2.0]) is None


def test_joint_rows_fold_offsets_to_phases_when_w_exceeds_s() -> None:
    """W=8/S=4, K gate on offset 2 (phase 2), V gate on offset 3 (phase 3, rolled by -1 to phase 2: the record
    whose key sits at phase 2), a knock-out that hurts only phase 2: both correlations are +1; a V gate on offset
    2 rolls to phase 1, one-hot at another phase of 4: correlation -1/3."""
    one_hot = [[8.0 if i == j else 0.0 for i in range(8)] for j in range(8)]
    ko = [{"effect": e, "effect_lower": e, "effect_upper": e} for e in (0.0, 0.0, -60.0, 0.0)]
    unit = {"layer": 0, "kv_head": 0, "phases": [{**p, **{f"folded_{k}": v for k, v in p.items()}} for p in ko]}

    def gate(branch: str, offset: int, roll: int) -> dict:
        g = np.roll(phase_profile(np.array(one_hot[offset]), 4), roll).tolist()
        return {"layer": 0, "kv_head": 0, "branch": branch, "profile": one_hot[offset], "phase_profile": g}

    gates = [
        {**gate("K", 2, 0), "peak_offset": 2, "static": 1.0},
        {**gate("V", 3, -1), "peak_offset": 3, "static": 1.0},
    ]
    (row,) = joint_rows({"units": [unit]}, gates)
    assert row["k_phase_profile"] == [0.0, 0.0, 4.0, 0.0] and row["v_phase_profile"] == [0.0, 0.0, 4.0, 0.0]
    assert row["loss_vs_k"] == pytest.approx(1.0) and row["loss_vs_v"] == pytest.approx(1.0)
    gates[1] = {**gate("V", 2, -1), "peak_offset": 2, "static": 1.0}
    (row,) = joint_rows({"units": [unit]}, gates)
    assert row["loss_vs_v"] == pytest.approx(-1 / 3)


def _eval(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``python eval.py <args>`` with small statistics, in this process (``run_script``): exit code, stdout, stderr."""
    fixed = ["progress=false", "device=cpu", "stats.n_bootstrap=50", "stats.n_permutations=50", "task.modulus=4"]
    return run_script("eval.py", [*args, *fixed, "task.fixed_query=false", "limit=4"], monkeypatch, capsys)


def test_eval_cli_runs_an_analysis(trained_run: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    args = [f"model.path={trained_run}", "analysis=gates", "analysis.checkpoints=[100]", f"out_dir={tmp_path}"]
    code, out, err = _eval(monkeypatch, capsys, *args)
    assert code == 0, err[-3000:]
    results = json.loads((tmp_path / "gates" / "gates.json").read_text())["analysis"]["results"]
    assert [c["step"] for c in results["checkpoints"]] == [100]
    lines = out.splitlines()  # a short report: each result in a line, then where the files went
    assert "analysis gates:" in lines and len(lines) <= len(results) + 3, out[-3000:]
    assert (
        lines[-1]
        == f"files -> {tmp_path / 'gates'}: {', '.join(sorted(f.name for f in (tmp_path / 'gates').iterdir()))}"
    )


@pytest.mark.slow
def test_eval_cli_says_when_an_analysis_does_not_apply(tmp_path: Path, monkeypatch, capsys) -> None:
    run = make_run(tmp_path, attention=dict(kind="compressed", window=4, stride=4, local_window=4, gate=None))
    code, _, err = _eval(monkeypatch, capsys, f"model.path={run}", "analysis=gate_cycling")
    assert code == EXIT_NOT_APPLICABLE and "attention.gate=null" in err  # a study skips it
