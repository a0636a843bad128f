"""make robust: the plan's runs, the KV-memory figure against a real decoding cache, and CI's quick smoke run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckv import Transformer
from ckv.apps.demo import ROOT
from ckv.apps.robust import MODELS, kv_bytes_per_token, plan
from tests.foundation.helpers import small_config, variant


def test_plan_runs_every_model_of_each_task_for_each_seed_with_one_attention_override():
    runs = plan(("split", "dense"), (0, 1))
    assert len(runs) == 2 * sum(len(m) for m in MODELS.values())
    assert len({(r.name, r.seed) for r in runs}) == len(runs)
    for r in runs:
        assert r.train_overrides == (next(f"attention={o}" for m, o, _ in MODELS[r.experiment[7:]]
                                          if r.name.endswith("_" + m)),)
        # only the control, which has no stride, is told which phase period to report
        assert bool(r.eval_overrides) == (r.role == "control")
    for task, models in MODELS.items():
        assert [role for _, _, role in models].count("control") == 1
        assert (ROOT / "conf" / "experiment" / f"robust_{task}.yaml").is_file()
        for _, option, _ in models:
            assert (ROOT / "conf" / "attention" / f"{option}.yaml").is_file()


@pytest.mark.parametrize("name", ["w4s4", "w4s4_conv", "w8s4", "w8s8_tied_kv", "deepseek_v4_csa", "full_kv1"])
def test_kv_bytes_per_token_is_the_decoding_cache_growth(name):
    att = variant(name)
    if att["kind"] == "compressed":
        att["local_window"] = 4  # the benchmark's local window, shorter than both lengths below
    cfg = small_config(att, max_seq_len=256)
    model = Transformer(cfg).eval()
    if cfg.attention.compressed:  # grow by whole strides so the entry count grows by exactly n / S
        n1, n2 = 8 * cfg.attention.stride, 16 * cfg.attention.stride
    else:
        n1, n2 = 40, 80
    sizes = []
    for n in (n1, n2):
        cache = model.new_cache(1)
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab_size, (1, n)), cache)
        total = sum(sum(layer.nbytes().values()) for layer in cache.layers)  # fp32 cache: 4 bytes per element
        sizes.append(total)
    assert (sizes[1] - sizes[0]) / (n2 - n1) == pytest.approx(kv_bytes_per_token(cfg, bytes_per_element=4))


@pytest.mark.smoke
def test_quick_robust_writes_a_table_a_plot_and_a_record(tmp_path):
    out = tmp_path / "robust"
    proc = subprocess.run([sys.executable, "-m", "ckv.apps.robust", "--quick", "--task", "dense", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quick mode" in proc.stdout and "per-phase accuracy" in proc.stdout
    record = json.loads((out / "robust.json").read_text())
    rows = record["rows"]
    assert [r["model"] for r in rows] == [m for m, _, _ in MODELS["dense"]]
    for r in rows:
        assert len(r["per_phase"]) == r["stride"] and min(r["per_phase"]) == pytest.approx(r["worst_phase_accuracy"])
        assert 0.0 <= r["phase_gap_lower"] <= r["phase_gap"] <= r["phase_gap_upper"] <= 1.0
        assert r["steps"] == 12 and r["parameters"] > 0
    by_model = {r["model"]: r for r in rows}
    # equal memory within a geometry, the control stores one key and value per token
    assert by_model["conv_w8s8"]["kv_bytes_per_token"] == by_model["gate_w8s8"]["kv_bytes_per_token"]
    assert by_model["full"]["kv_bytes_per_token"] == 8 * by_model["gate_w8s8"]["kv_bytes_per_token"]
    assert by_model["conv_w8s8"]["parameters"] > by_model["gate_w8s8"]["parameters"]
    data = Path(record["plot"]).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
