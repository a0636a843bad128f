"""analysis=selection: which entries hold a record, which the query attended, and the analysis on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ckv import Transformer
from ckv.analysis import run_analysis
from ckv.analysis.selection import chosen_entries, selection, target_entries
from ckv.config import ConfigError
from ckv.eval import load_ckv_model
from tests.helpers import small_config

from ..eval.helpers import make_run, png_ok
from .conftest import SPEC, context, options

W8S4 = dict(kind="compressed", window=8, stride=4, local_window=2, kv_heads=1)


def test_the_entries_holding_a_record_and_the_entries_a_query_attended():
    """W = 8, S = 4: entry j pools positions 4j - 4 .. 4j + 3. A record at 5, 6 lies in entries 1 and 2 (both
    tokens); one at 7, 8 straddles: 7 in entries 1, 2 and 8 in entries 2, 3."""
    layer = Transformer(small_config(W8S4, n_layers=1)).layers[0].self_attn
    holds = target_entries(layer, 5, torch.tensor([5, 7]), 2)  # (B=2, E=5, R=2)
    assert holds[0].T.tolist() == [[False, True, True, False, False]] * 2
    assert holds[1].T.tolist() == [[False, True, True, False, False], [False, False, True, True, False]]
    # the query at grid position 15 sees entries 0..3 (entry s closes at 4s + 3)
    assert chosen_entries(None, 5, 15, 4, 2).tolist() == [[True, True, True, True, False]] * 2
    chosen = chosen_entries(torch.tensor([[1, -1], [3, 4]]), 5, 15, 4, 2)  # entry 4 is not visible: not attended
    assert chosen.tolist() == [[False, True, False, False, False], [False, False, False, True, False]]
    hit = (holds.any(-1) & chosen).any(-1)
    covered = (holds & chosen[..., None]).any(1).all(-1)
    assert hit.tolist() == [True, True] and covered.tolist() == [True, False]  # 7 is in neither 3 nor 4


@pytest.mark.parametrize(
    "select, always",
    [(None, True), (dict(topk=64, by="oracle"), True), (dict(topk=1, by="oracle"), False)],
)
def test_selection_rates_on_tiny_models(tmp_path: Path, select, always):
    """Without selection, or with a top-k above the entries, the record is always covered; top-1 misses it in
    some prompts. The rates sit beside the accuracy of the task's own scoring, per phase."""
    model = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=select)), device="cpu")
    ctx = context(model, tmp_path, limit=8)
    result = selection(ctx)
    plain = ctx.evaluate()
    assert result["mean_accuracy"] == pytest.approx(float(np.mean(plain.correct)))
    assert len(result["phases"]) == 4 and sum(p["n"] for p in result["phases"]) == len(plain.correct)
    for p in result["phases"]:
        assert all(c <= h for c, h in zip(p["covered"], p["hit"]))
    covered = [layer["covered"] for layer in result["layers"]]
    assert all(c == 1.0 for c in covered) if always else all(c < 1.0 for c in covered)


def test_run_analysis_writes_the_record_and_the_plot(tmp_path: Path):
    model = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=dict(topk=2, by="oracle"))))
    env = run_analysis({"name": "selection"}, model, SPEC, options(tmp_path, limit=4, plots=True))
    out = Path(env["analysis"]["results"]["plots"][0])
    written = next(tmp_path.rglob("selection.json"))
    assert json.loads(written.read_text())["analysis"]["results"]["topk"] == 2
    assert png_ok(written.parent / out.name)


def test_oracle_selection_imposed_on_a_dense_model(tmp_path: Path):
    """``oracle_topk`` evaluates the same weights with oracle top-k: the accuracy is that of an oracle model loaded
    with them, the covered rate drops below 1, and the task's statistics come along."""
    dense = load_ckv_model(make_run(tmp_path, attention=W8S4), device="cpu")
    oracle = load_ckv_model(make_run(tmp_path, attention=dict(W8S4, selection=dict(topk=1, by="oracle")), name="o"))
    oracle.module.load_state_dict(dense.module.state_dict())  # strict: the same parameters
    want = context(oracle, tmp_path).evaluate()
    imposed = selection(context(dense, tmp_path, params={"oracle_topk": 1}))
    assert imposed["mean_accuracy"] == pytest.approx(float(np.mean(want.correct)))
    assert imposed["by"] == "oracle" and imposed["topk"] == 1 and all(x["covered"] < 1 for x in imposed["layers"])
    assert imposed["report"]["headline"]["mean"] == pytest.approx(imposed["mean_accuracy"])
    assert dense.module.config.attention.selection is None  # the loaded model itself is untouched
    with pytest.raises(ConfigError, match="already selects"):
        selection(context(oracle, tmp_path, params={"oracle_topk": 1}))


def test_models_without_compressed_layers_and_parameters_fail_with_one_line(tmp_path: Path):
    full = load_ckv_model(make_run(tmp_path, attention=dict(kind="full"), name="full"), device="cpu")
    with pytest.raises(ConfigError, match="no compressed attention layer"):
        selection(context(full, tmp_path, params={}))
    model = load_ckv_model(make_run(tmp_path, attention=W8S4, name="w8s4"), device="cpu")
    with pytest.raises(ConfigError, match="unknown analysis=selection parameter"):
        selection(context(model, tmp_path, params={"layers": [0]}))
    with pytest.raises(ConfigError, match="analysis.oracle_topk=0 must be an integer >= 1"):
        selection(context(model, tmp_path, params={"oracle_topk": 0}))
