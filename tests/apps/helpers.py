"""The quick run every demo-style app's CI test starts with."""

import subprocess
import sys
from pathlib import Path

from ckv.apps.demo import ROOT


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
