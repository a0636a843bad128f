"""benchmarks/gpu_check.py: the dry run plans every section on CPU (meta models, shapes), needs no hydra, and the
budget logic skips with a recorded reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ckv.flops import parameter_count

from .helpers import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_dry_run_plans_every_section(gpu_check, tmp_path):
    report = gpu_check.main(["--out", str(tmp_path), "--dry-run"])
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "report.md").read_text().startswith("# GPU check: dry run")
    p = report["plan"]
    assert sum(p["budgets_s"].values()) <= p["total_budget_s"] <= 480
    for kind, m in p["models"].items():
        assert m["parameters"] == parameter_count(gpu_check.model_config(kind))
        assert m["train_logits"] == [1, 4096, 151936]
    assert p["models"]["compressed"]["training_flops_per_token"] < p["models"]["full"]["training_flops_per_token"]
    Ts = sorted({row["T"] for row in p["attention"]})
    assert Ts[0] == 8192 and Ts[-1] == 131072
    for row in p["attention"]:
        assert row["kc_vc"][1] == row["T"] // row["stride"]
        if row["topk"] is None:
            assert row["pool_payload"][2] == row["window"]
        else:
            assert row["selected"] == [1, row["T"], row["topk"]]
    sparse = [row for row in p["attention"] if row["topk"] is not None]
    assert {row["T"] for row in sparse} == set(Ts) and {(r["stride"], r["topk"]) for r in sparse} == {(4, 512)}
    assert "test_attention.py" in p["kernels"]["test_files"]


def test_sections_skip_with_a_reason(gpu_check):
    s = gpu_check.Section("x", budget_s=1.0)
    assert s.run("too long", lambda: 1, first_estimate_s=5) is None
    assert s.run("quick", lambda: 2) == 2
    assert s.run("broken", lambda: 1 / 0) is None
    s.last_s = 10.0
    assert s.run("grows", lambda: 3, growth=4.0) is None
    reasons = {x["item"]: x["reason"] for x in s.skipped}
    assert "budget" in reasons["too long"] and "budget" in reasons["grows"]
    assert reasons["broken"].startswith("ZeroDivisionError")
    assert s.report()["budget_s"] == 1.0


def test_markdown_of_a_report(gpu_check):
    row = {
        "T": 8192,
        "layout": "paper",
        "H": 16,
        "KV": 1,
        "D": 128,
        "impl": "triton",
        "window": 8,
        "stride": 8,
        "fwd_ms": 1.0,
        "fwd_bwd_ms": 3.0,
        "fwd_tflops": 100.0,
        "fwd_bwd_tflops": 90.0,
        "peak_mib": 10.0,
        "x_full_fwd_bwd": 5.0,
    }
    report = {
        "meta": {"device": "NVIDIA H200"},
        "sections": {
            "attention": {
                "budget_s": 170,
                "used_s": 3.0,
                "items": [row],
                "skipped": [{"item": "T=131072 qwen3", "reason": "r"}],
            },
            "decode": {
                "budget_s": 60,
                "used_s": 1.0,
                "items": [{"attention": "full", "decode_tokens_per_s": 50.0}],
                "skipped": [],
            },
        },
    }
    md = gpu_check.markdown(report)
    assert gpu_check.bench.table([row]) in md  # the attention benchmark's own table
    assert "skipped T=131072 qwen3: r" in md and "decode_tokens_per_s=50" in md


def test_needs_no_hydra(tmp_path):
    code = (
        f"import runpy, sys; sys.argv = ['gpu_check', '--out', {str(tmp_path)!r}, '--dry-run']; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__'); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('hydra', 'deepspeed', 'datasets')], 'heavy import'"
    )
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert (tmp_path / "report.json").exists() and time.monotonic() - t0 < 60


def test_dry_run_plans_the_long_context_rows_and_writes_under_outputs(gpu_check):
    """The long-context section's rows (the op at 16K and 64K by every implementation, the six options' training
    steps), and the default --out under outputs/ (git-ignored: a run leaves no untracked folder)."""
    report = gpu_check.main(["--dry-run"])
    p = report["plan"]["long_context"]
    assert p["T"] == [16384, 65536] and set(p["ops"]) == {"sdpa", "triton", "fast", "reference", "flex"}
    assert p["train"] == list(gpu_check.lc.ATTENTIONS)
    assert p["op_inputs"]["q"] == [1, 16384, 4, 64] and p["op_inputs"]["kc"] == [1, 16384 // 8, 1, 64]
    out = gpu_check.ROOT / "outputs" / "gpu_check"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    assert "outputs/" in (gpu_check.ROOT / ".gitignore").read_text().splitlines()
