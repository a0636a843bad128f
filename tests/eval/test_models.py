"""Loading ckv checkpoints for evaluation: run folders, checkpoints, mismatches, and a full evaluate() call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ckv import ModelConfig, Transformer
from ckv.config import ConfigError
from ckv.data.lookup import LookupFormat
from ckv.eval import LookupSpec, RunOptions, StatsOptions, evaluate, load_ckv_model
from ckv.eval.models import CheckpointMismatchError, find_weights
from ckv.io.weights import save_weights
from tests.io.helpers import poison

from .helpers import SPLIT_LOOKUP, make_run, png_ok

FAST = StatsOptions(n_bootstrap=50, n_permutations=50)
GATE = dict(kind="compressed", window=4, stride=4, local_window=4)


def test_run_folder_gives_weights_format_stride_and_out_dir(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=GATE)
    m = load_ckv_model(run, device="cpu")
    assert m.stride == 4 and m.max_len == 128
    assert m.lookup_format == LookupFormat(record="split", n_keys=16, n_values=16, n_filler=1)
    assert m.lookup.n_records == 16 and m.out_dir == run / "eval"
    assert m.info["attention"] == {"kind": "compressed", "window": 4, "stride": 4, "pooling": "gate"}
    ids = torch.randint(0, m.vocab_size, (2, 10))
    torch.testing.assert_close(m.logits(ids), m.module(ids)[:, -1])  # last-position logits only


def test_checkpoint_selection(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=dict(kind="full"))
    for step in (10, 20):
        d = run / "checkpoints" / f"step_{step:08d}"
        save_weights(load_ckv_model(run, device="cpu").module, d / "weights")
        (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    assert find_weights(run) == (run / "model", run)
    assert find_weights(run, "latest")[0] == run / "checkpoints" / "step_00000020" / "weights"
    assert find_weights(run, 10)[0] == run / "checkpoints" / "step_00000010" / "weights"
    m = load_ckv_model(run, step=10, device="cpu")
    assert m.out_dir == run / "checkpoints" / "step_00000010" / "eval" and m.info["trainer_state"] == {"step": 10}
    assert m.stride is None
    with pytest.raises(FileNotFoundError, match="checkpoints at steps"):
        find_weights(run, 15)
    # a weights folder inside the run still finds the run's config
    assert find_weights(run / "checkpoints" / "step_00000020" / "weights")[1] == run
    # an unfinished run (no model/ yet): its latest checkpoint, and results say which step (was model.step null)
    shutil.rmtree(run / "model")
    assert load_ckv_model(run, device="cpu").info["step"] == 20


def test_checkpoint_not_matching_its_run_is_a_clear_error(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=GATE)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["attention"]["stride"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CheckpointMismatchError, match="does not match its run's config.yaml: attention"):
        load_ckv_model(run, device="cpu")


def test_weights_not_matching_their_config_is_a_clear_error(tmp_path: Path) -> None:
    small = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=32)
    save_weights(Transformer(small), tmp_path / "w")
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    config["d_model"] = 48
    (tmp_path / "w" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatchError, match="cannot load"):
        load_ckv_model(tmp_path / "w", device="cpu")


def test_weights_with_nan_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=GATE)
    poison(run / "model" / "model.safetensors", "norm.weight")
    with pytest.raises(CheckpointMismatchError, match=r"cannot load .*model: .*tensor 'norm.weight' holds 32 NaN/inf"):
        load_ckv_model(run, device="cpu")


def test_format_larger_than_the_model_vocabulary(tmp_path: Path) -> None:
    small = ModelConfig(vocab_size=20, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=32)
    save_weights(Transformer(small), tmp_path / "w")
    spec = LookupSpec(n_records=8, modulus=4, n_base=4, vocab=dict(format=dict(record="kv", n_keys=16, n_values=16)))
    with pytest.raises(ConfigError, match="does not match this task's format"):
        evaluate(load_ckv_model(tmp_path / "w", device="cpu"), spec, RunOptions(out_dir=str(tmp_path / "o")))


def test_not_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a ckv run folder"):
        load_ckv_model(tmp_path, device="cpu")


def test_evaluate_writes_results_csv_and_plot(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=GATE)
    spec = LookupSpec(modulus=8, n_base=64)
    results, out = evaluate(load_ckv_model(run, device="cpu"), spec, RunOptions(progress=False, stats=FAST, limit=16))
    assert out == run / "eval" / "lookup"
    saved = json.loads((out / "results.json").read_text())
    r = saved["results"]
    assert r["n_prompts"] == 16 * 8 and r["spec"]["n_records"] == SPLIT_LOOKUP["n_records"]
    assert r["spec"]["n_demos"] == SPLIT_LOOKUP["n_queries"] - 1 and r["stride"] == 4
    assert len(r["phase"]["groups"]) == 4 and len(r["residue"]["groups"]) == 8
    for key in ("value", "lower", "upper", "p_value", "noise_floor"):
        assert key in r["phase"]["gap"]
    assert {"score", "chance", "dominant_period"} <= set(r["residue"]["periodicity"])
    assert saved["model"]["config"]["attention"]["stride"] == 4 and saved["eval"]["options"]["limit"] == 16
    lines = (out / "results.csv").read_text().splitlines()
    assert len(lines) == 1 + 128 and lines[0].startswith("base,shift,target_record,target_position,residue,phase")
    assert png_ok(out / "lookup.png")
    # every per-sample row agrees with the phase convention
    rows = np.genfromtxt(out / "results.csv", delimiter=",", names=True, dtype=np.int64, usecols=(3, 4, 5))
    np.testing.assert_array_equal(rows["phase"], rows["target_position"] % 4)
    np.testing.assert_array_equal(rows["residue"], rows["target_position"] % 8)
