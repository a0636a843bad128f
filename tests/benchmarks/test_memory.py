"""benchmarks/memory.py: both variants train the same step (same loss and gradient norm); the lean one peaks lower."""

from __future__ import annotations

import pytest

from .helpers import load_script


@pytest.fixture(scope="module")
def memory():
    return load_script("memory")


@pytest.mark.parametrize("attention", ["full", "compressed"])
def test_variants_compute_the_same_step(memory, attention):
    today, lean = (
        memory.child(v, attention, vocab=512, seq_len=64, batch=2, chunk=48, threads=1) for v in memory.VARIANTS
    )
    assert abs(today["loss"] - lean["loss"]) < 1e-5
    assert abs(today["grad_norm"] - lean["grad_norm"]) < 1e-5 * today["grad_norm"]
    assert today["parameters"] == lean["parameters"]


@pytest.mark.slow
def test_lean_step_peaks_lower_in_fresh_processes(memory, capsys):
    (row,) = memory.main(
        ["--attention", "full", "--vocab", "8192", "--seq-len", "512", "--batch", "1", "--chunk", "256"]
    )
    assert row["today"]["measurable"] and row["lean"]["measurable"]
    assert row["ratio"] < 0.8 and row["loss_diff"] < 1e-5
    assert "lean/today" in capsys.readouterr().out
