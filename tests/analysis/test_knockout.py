"""Knock-out: hooks at the final position, calibration, exact no-ops and total knock-outs, any attention kind."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch

from ckv.analysis import AnalysisContext, run_analysis
from ckv.analysis.hooks import attention_sites, replace_final_input
from ckv.analysis.knockout import (
    KnockoutSettings,
    calibration_means,
    effect_table,
    knockout_effects,
    run_knockout,
    table_from_prompts,
)
from ckv.config import ConfigError
from ckv.eval import LoadedModel, build_task, load_ckv_model

from ..eval.helpers import make_run
from .conftest import SPEC, context, options


def _silence_values(model: LoadedModel, layer: int) -> None:
    """Zero every value path of ``layer``: its attention output is exactly 0 at every position of every prompt."""
    attn = model.module.layers[layer].self_attn
    with torch.no_grad():
        attn.v_proj.weight.zero_()
        attn.compressors()["V"].payload.zero_()


def test_knocking_out_a_constant_layer_changes_nothing(trained: LoadedModel, tmp_path: Path) -> None:
    _silence_values(trained, 1)
    ctx = context(trained, tmp_path)
    result = run_knockout(ctx, KnockoutSettings(calibration=4))
    layer1 = [u for u in result["units"] if u["layer"] == 1]
    assert [u["label"] for u in layer1] == ["L1", "L1 kv0", "L1 kv1"]
    for u in layer1:
        assert u["knocked_mean"] == u["clean_mean"]
        for p in u["phases"]:  # paired: every bootstrap replicate sees the same prompts unchanged
            assert p["knocked"] == p["clean"] and (p["delta"], p["delta_lower"], p["delta_upper"]) == (0.0, 0.0, 0.0)
    # the logits themselves are identical, not only the top-1 ids
    sites = attention_sites(trained.module)
    means, _ = calibration_means(ctx, sites, KnockoutSettings(calibration=4))
    same_length = [p for p in ctx.task.prompts if len(p) == len(ctx.task.prompts[0])]
    ids = torch.as_tensor(np.stack(same_length))  # (B, T)
    clean = trained.logits(ids)
    with replace_final_input(sites[1], slice(None), means.mean(1)), torch.inference_mode():
        assert torch.equal(trained.logits(ids), clean)


def test_knocking_out_every_layer_leaves_only_the_last_token(trained: LoadedModel, tmp_path: Path) -> None:
    """With every attention output at the final position replaced by a constant, the final position sees nothing
    but its own token: the prediction is a function of the queried key, and accuracy falls to about chance."""
    ctx = context(trained, tmp_path, limit=32)
    sites = attention_sites(trained.module)
    means, info = calibration_means(ctx, sites, KnockoutSettings(calibration=8))
    assert info["n_prompts"] == 8 * 4 and info["dropped_as_scored"] == 0
    clean = ctx.evaluate()
    with ExitStack() as stack:
        for s in sites:
            stack.enter_context(replace_final_input(s, slice(None), means.mean(s.layer)))
        knocked = ctx.evaluate()
    last = np.array([p[-1] for p in ctx.task.prompts])
    for token in np.unique(last):
        assert len(set(knocked.predicted[last == token].tolist())) == 1
    assert clean.correct.mean() > 0.6, "the fixture model did not learn the lookup"
    assert knocked.correct.mean() < clean.correct.mean() - 0.3


def test_calibration_drops_prompts_that_are_scored(trained: LoadedModel, tmp_path: Path) -> None:
    ctx = context(trained, tmp_path, limit=8)
    sites = attention_sites(trained.module)
    # the scored task's own seed: its first 8 base examples (32 prompts) are the scored prompts themselves
    _, info = calibration_means(ctx, sites, KnockoutSettings(calibration=12, calibration_seed=SPEC.seed))
    assert (info["dropped_as_scored"], info["n_prompts"]) == (32, 16)
    with pytest.raises(ConfigError, match="every calibration prompt equals a scored prompt"):
        calibration_means(ctx, sites, KnockoutSettings(calibration=8, calibration_seed=SPEC.seed))


def test_knockout_runs_on_full_attention(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=dict(kind="full"), preset_overrides=dict(n_heads=4, n_kv_heads=2))
    model = load_ckv_model(run, device="cpu")
    with pytest.raises(ConfigError, match="set task.stride"):  # full attention has phases only at a given stride
        run_analysis({"name": "knockout", "calibration": 2}, model, SPEC, options(tmp_path / "out", limit=4))
    env = run_analysis(
        {"name": "knockout", "calibration": 2},
        model,
        dataclasses.replace(SPEC, stride=4),
        options(tmp_path / "out", limit=4),
    )
    units = env["analysis"]["results"]["units"]
    expected = [(0, None, [0, 1, 2, 3]), (0, 0, [0, 1]), (0, 1, [2, 3])]  # the layer, then its two KV groups
    assert [(u["layer"], u["kv_head"], u["heads"]) for u in units] == expected
    assert all(len(u["phases"]) == 4 for u in units)
    # each mapping is scored at 4 shifts but lands once per phase here (modulus = stride); still clustered
    assert {p["knocked_interval"] for u in units for p in u["phases"]} == {"cluster_bootstrap"}


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="analysis.units"):
        KnockoutSettings(units=("layer",))
    with pytest.raises(ConfigError, match="analysis.calibration"):
        KnockoutSettings(calibration=0)


@pytest.mark.slow
def test_knockout_finds_the_attention_outputs_of_a_transformers_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    sites = attention_sites(model)
    assert [(s.layer, s.n_heads, s.kv_heads, s.head_dim) for s in sites] == [(0, 4, 2, 8), (1, 4, 2, 8)]
    ids = torch.randint(0, 64, (3, 10))
    with torch.no_grad():
        clean = model(ids).logits
        with replace_final_input(sites[1], sites[1].group_columns(1), torch.zeros(16)):
            knocked = model(ids).logits
    assert torch.equal(knocked[:, :-1], clean[:, :-1]) and not torch.equal(knocked[:, -1], clean[:, -1])


RESIDUE_SPEC = dataclasses.replace(SPEC, modulus=8)  # residues mod 8 over phases mod 4: two residues per phase


def test_an_effect_confined_to_one_residue_is_reported_there_and_folded_the_papers_way(
    trained: LoadedModel, tmp_path: Path
) -> None:
    """Knocked outcome = clean, except every prompt of residue rho fails: that residue loses 100% of its accuracy,
    every other residue 0%; its phase rho mod 4 averages the relative changes of its two residues (-100 and 0). A
    residue the clean model never gets right has no relative change (None), nor has its phase's fold."""
    ctx = AnalysisContext(trained, build_task(RESIDUE_SPEC, trained, 8), options(tmp_path), {}, tmp_path)
    clean = ctx.evaluate()
    residue = clean.table["residue"]
    accuracy = [clean.correct[residue == r].mean() for r in range(8)]
    rho = int(np.argmax(accuracy))  # a residue the model gets right
    knocked = np.where(residue == rho, 0, clean.correct)
    (unit,) = knockout_effects(ctx, clean, [knocked])
    effects = [None if accuracy[r] == 0 else -100.0 if r == rho else 0.0 for r in range(8)]
    assert [r["effect"] for r in unit["residues"]] == effects
    folded = [None if None in effects[p::4] else float(np.mean(effects[p::4])) for p in range(4)]
    assert folded[rho % 4] in (-50.0, None) and [p["folded_effect"] for p in unit["phases"]] == folded
    residue_effects = np.array([[np.nan if r["effect"] is None else r["effect"] for r in unit["residues"]]])
    table = effect_table([{"layer": 0, "kv_head": 0}], residue_effects, 4)
    assert table["phase_effect"] == [[[p["folded_effect"] for p in unit["phases"]]]]  # layer x KV head x phase


def test_per_prompt_outcomes_rebuild_the_residue_table(trained: LoadedModel, tmp_path: Path) -> None:
    ctx = AnalysisContext(trained, build_task(RESIDUE_SPEC, trained, 8), options(tmp_path), {}, tmp_path)
    result = run_knockout(ctx, KnockoutSettings(calibration=4))
    table = result["table"]
    assert result["modulus"] == 8 and table["layers"] == [0, 1]
    assert [[len(h) for h in layer] for layer in table["residue_effect"]] == [[8, 8], [8, 8]]  # 2 layers, 2 KV heads
    assert [[len(h) for h in layer] for layer in table["phase_effect"]] == [[4, 4], [4, 4]]
    assert table_from_prompts(result, tmp_path / result["prompts"]) == table
    first = next(u for u in result["units"] if u["kv_head"] == 0 and u["layer"] == 1)
    assert table["residue_effect"][1][0] == [r["effect"] for r in first["residues"]]
