"""What the studies' tests share: the quick run every study's CI test starts with, and a finished run's record
built from a few headline numbers."""

import subprocess
import sys
from pathlib import Path

from ckv.apps.study_config import ROOT, Run


def run_quick(module: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m <module> --quick --out <out> <args>`` in the checkout: it must exit 0 and print its table
    (``per-phase accuracy``) and the quick-mode disclaimer."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--quick", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quick mode" in proc.stdout and "per-phase accuracy" in proc.stdout
    return proc


def finished(run: Run, stride: int = 4, **headline: float) -> dict:
    """``train_and_evaluate``'s record of ``run`` with a lookup report holding ``headline`` (mean 0.6 and an
    uninformative gap unless given), ``stride`` equal phases at the mean, and no residue gap."""
    h = {
        "mean": 0.6,
        "phase_gap": 0.0,
        "phase_gap_lower": 0.0,
        "phase_gap_upper": 0.0,
        "phase_p_value": 1.0,
        "phase_noise_floor": 0.05,
        "worst_phase": 0,
        "dominant_period": None,
        "periodicity_score": None,
        **headline,
    }
    h.setdefault("worst_phase_accuracy", h["mean"])
    phase = {"accuracy": h["mean"], "lower": h["mean"] - 0.01, "upper": h["mean"] + 0.01}
    report = {
        "stride": stride,
        "headline": h,
        "phase": {"groups": [phase] * stride, "mean": phase},
        "residue": {"gap": {"value": 0.0, "lower": 0.0, "upper": 0.0, "noise_floor": 0.05}},
    }
    return {"run": run, "dir": Path("unused"), "steps": 12, "train_seconds": 1.0, "results": report}
