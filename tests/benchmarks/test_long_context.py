"""benchmarks/long_context.py: every op it times matches ckv's reference first; a tiny run gives the report's rows
and columns (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from .helpers import load_script


@pytest.fixture(scope="module")
def lc():
    return load_script("long_context")


def test_eager_ops_match_the_reference_forward_and_backward(lc):
    ops = ["sdpa", "reference"] + (["fast"] if lc.fast_op() is not None else [])
    for op in ops:
        for grad in (False, True):
            assert lc.op_error(op, lc.build_op(op, 64), grad, seq_len=64) <= lc.MATCH_TOL, (op, grad)


def test_a_wrong_op_is_caught(lc):
    def shifted(x):  # the reference with a window one token too short: not the same attention
        return lc.reference_op(x, local_window=lc.OP_LOCAL_WINDOW - 1)

    assert lc.op_error("reference", shifted, grad=False, seq_len=64) > lc.MATCH_TOL


@pytest.mark.slow
def test_flex_attention_matches_the_reference_forward(lc):
    assert lc.op_error("flex", lc.build_op("flex", 128), grad=False, seq_len=128) <= lc.MATCH_TOL


@pytest.mark.slow
def test_tiny_run_writes_every_row_and_column(lc, tmp_path, capsys):
    argv = ["--attention", "full", "w8s8", "--train-T", "128", "--forward-T", "256", "--op-T", "256"]
    rows = lc.main([*argv, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "ETA" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rows"] == json.loads(json.dumps(rows))
    train = [r for r in rows if r["table"] == "train"]
    assert [(r["attention"], r["T"], r["mode"]) for r in train] == [
        ("full", 128, "train"), ("w8s8", 128, "train"), ("full", 256, "forward"), ("w8s8", 256, "forward")
    ]  # fmt: skip
    for r in train:
        assert r["status"] == "ok" and r["finite"] and r["peak_rss"] > 0 and r["tokens_per_s"] > 0
        assert "speed_vs_base" in r and "rss_vs_base" in r
    ops = [r for r in rows if r["table"] == "op"]
    assert {(r["op"], r["pass"]) for r in ops} == {(o, p) for o in lc.OPS for p in lc.PASSES}
    for r in ops:
        if r["status"] == "ok":  # timed only after matching the reference at a small size
            assert r["error"] <= lc.MATCH_TOL and r["seconds"] > 0 and "speed_vs_base" in r
        else:
            assert r["status"].startswith("n/a"), r
    timed = {(r["op"], r["pass"]) for r in ops if r["status"] == "ok"}
    assert {("sdpa", "forward"), ("sdpa", "forward+backward"), ("reference", "forward"), ("flex", "forward")} <= timed
    md = (tmp_path / "report.md").read_text()
    assert "| attention | impl | T | mode | tokens/s | vs full | peak RSS MiB |" in md
    assert "| op | T | pass | ms | vs SDPA |" in md and "n/a (no CPU backward)" in md
    table_lines = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table_lines) == 2 * 2 + len(train) + len(ops)  # a header and a separator per table, then the rows
