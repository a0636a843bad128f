"""The attention benchmark runs end to end at a toy size (on CPU under the interpreter: every row type)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def test_benchmark_writes_a_table_and_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ckv_attention_benchmark", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    result = bench.main(
        [
            "--T",
            "40",
            "--layouts",
            "paper",
            "--geometries",
            "w8s4",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-check",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    impls = [row["impl"] for row in result["rows"]]
    assert impls[0].startswith("full") and "reference" in impls
    if result["meta"]["interpreter"] or result["meta"]["device"] != "cpu":
        assert {"triton", "pool(k+v)", "triton+pool"} <= set(impls)
    assert all(row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 for row in result["rows"])
    assert "x full f+b" in capsys.readouterr().out
