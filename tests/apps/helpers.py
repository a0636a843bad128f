"""What the studies' tests share: the quick run every study's CI test starts with, a finished run's record built
from a few headline numbers, and a constructed claim row."""

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


def claim_row(
    margin: float, gap: float = 0.01, p: float = 0.5, floor: float = 0.02, worst: float = 0.6, stride: int = 8, **kw
) -> dict:
    """A constructed claim row (``ckv.apps.paper.claim_row``'s fields) for a study whose flat margin is ``margin``:
    learned (best group ``worst + gap``), not significant and flat (one-sided upper bound under the margin) by
    default; phase groups all at the best group's accuracy but ``phases``; ``mean``, ``lower``, ``upper``,
    ``one_sided``, ``period`` and any further field override."""
    phases = kw.pop("phases", [worst + gap] * stride)
    return {
        "mean": kw.pop("mean", worst + gap / 2),
        "mean_lower": 0.0,
        "mean_upper": 1.0,
        "residue_gap": gap,
        "residue_gap_lower": kw.pop("lower", max(gap - 0.02, 0.0)),
        "residue_gap_upper": kw.pop("upper", gap + 0.02),
        "residue_p_value": p,
        "residue_noise_floor": floor,
        "residue_upper_one_sided": kw.pop("one_sided", min(gap + 0.01, margin / 2)),
        "residue_mde": 0.03,
        "residue_mde_power": 0.8,
        "dominant_period": kw.pop("period", None),
        "stride": stride,
        "worst_residue_accuracy": worst,
        "worst_residue_lower": worst - 0.02,
        "worst_residue_upper": worst + 0.02,
        "phase_accuracy": phases,
        **kw,
    }
