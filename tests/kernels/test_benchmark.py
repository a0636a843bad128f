"""The attention benchmark runs end to end at a toy size (on CPU under the interpreter: every row type, top-k
included), and its selection is a valid one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from ckv.attention.reference import check_selected

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def _load():
    spec = importlib.util.spec_from_file_location("ckv_attention_benchmark", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_writes_a_table_and_json(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "bench.json"
    result = bench.main(
        [
            "--T",
            "16",
            "--layouts",
            "paper",
            "--geometries",
            "w8s4",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--topk",
            "2",
            "--no-check",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    impls = [row["impl"] for row in result["rows"]]
    assert impls[0].startswith("full") and "reference" in impls
    topk = {row["impl"] for row in result["rows"] if row.get("topk") == 2}
    assert "reference" in topk
    if result["meta"]["interpreter"] or result["meta"]["device"] != "cpu":
        assert {"triton", "pool(k+v)", "triton+pool"} <= set(impls) and "triton" in topk
    assert all(row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 for row in result["rows"])
    printed = capsys.readouterr().out
    assert "x full f+b" in printed
    assert "2 cases (T in [16]" in printed and "[2/2] done: T=16 paper w8s4 top-2 | elapsed" in printed  # progress


def test_spread_selection_is_a_valid_binding_selection():
    bench = _load()
    T, E, K, S = 200, 50, 8, 4
    selected = bench.spread_selection(2, T, E, K, S, torch.device("cpu"))
    visible = torch.clamp((torch.arange(T) + 1) // S, max=E)
    check_selected(selected, 2, T, E)  # in range, no index twice in a row
    assert ((selected < visible[None, :, None]) | (selected == -1)).all()  # only visible entries
    assert torch.equal((selected >= 0).sum(-1), visible.clamp(max=K).expand(2, T))  # min(K, visible) of them
