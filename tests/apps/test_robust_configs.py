"""make robust's configs: the two task experiments compose on make demo's model and budget with every attention
option of the plan (TrainConfig validates each model), and the GPU sweep of the fixes holds only options that
exist, at the paper's local window."""

import pytest

from ckv.apps.robust import MODELS
from tests.train.helpers import USER_DATA
from tests.train.helpers import sweep as _sweep
from tests.train.helpers import train_config as _train_config


@pytest.mark.parametrize("task", sorted(MODELS))
def test_every_model_of_a_task_shares_the_demo_budget_and_local_window(task):
    budgets = set()
    for option in (m.option for m in MODELS[task]):
        cfg = _train_config([f"experiment=robust_{task}", *option.split()])
        budgets.add((cfg.trainer.max_steps, cfg.trainer.global_batch_size, cfg.optim.lr, cfg.data.seq_len))
        if cfg.attention["kind"] == "compressed":
            # one KV head, except the per-KV-head grids' two (at the W8/S4 gate's KV bytes per token)
            assert cfg.attention["local_window"] == 4
            assert cfg.attention["kv_heads"] == (2 if option == "attention=w8s8_kv2_heads" else 1)
    assert budgets == {(1000, 32, 3.0e-3, 66)}


def test_dense_task_packs_four_whole_records_into_an_eight_token_window():
    cfg = _train_config(["experiment=robust_dense"])
    lookup = cfg.data.lookup
    # 2-token records K(k) V(k, v) back to back: 8 / 2 = 4 per window; filler only after the last record
    assert lookup.record == "keyed" and tuple(lookup.filler) == (0, 0) and tuple(lookup.tail_filler) == (0, 8)
    assert (lookup.n_keys, lookup.n_values, lookup.n_records) == (16, 8, 16)


def test_paper_robust_sweep_holds_the_fixes_make_robust_kept_at_the_paper_local_window():
    """V4's maps and W4/S4, each with and without token mixing (W4/S4 plain is the equal-memory baseline), and
    the gate-entropy floor on W8/S4 in its own experiment; all at the paper's 16-token local window."""
    sweep = _sweep("paper_robust_fixes")
    assert set(sweep["attention"]) == {"deepseek_v4_csa", "w4s4"}
    assert set(sweep["attention.mixing"]) == {"null", "{kernel:null}"}
    for name in sweep["attention"]:
        for mixing in sweep["attention.mixing"]:
            cfg = _train_config(
                ["experiment=paper_robust_fixes", f"attention={name}", f"attention.mixing={mixing}"] + USER_DATA
            )
            assert cfg.attention["local_window"] == 16  # TrainConfig has also validated the model it describes
            assert (cfg.attention["mixing"] is None) == (mixing == "null")
    entropy = _train_config(["experiment=paper_robust_entropy"] + USER_DATA)
    assert entropy.attention["local_window"] == 16 and entropy.attention["stride"] == 4
    assert (entropy.trainer.gate_entropy.floor, entropy.trainer.gate_entropy.weight) == (0.5, 0.1)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_ablation_ladder_changes_one_thing_per_step_from_the_w8s4_gate_to_deepseek_v4_csa():
    """Each ladder YAML composes to its predecessor plus exactly the change its name states, and the last step is
    deepseek_v4_csa but for the local window (which the benchmark sets to 4 for every model)."""
    from ckv.apps.robust import LADDER, LADDER_STEPS
    from ckv.apps.variants import load_variant
    from ckv.config import AttentionConfig
    from tests.helpers import ATTENTION_DIR

    def composed(name: str) -> dict:
        return _flat(AttentionConfig.from_dict(load_variant(ATTENTION_DIR, name)).to_dict())

    changes = {
        "ladder1_series": {"offset_maps"},
        "ladder2_vector_gate": {"gate.kind"},
        "ladder3_tied": {"kv"},
        "ladder4_postnorm": {"compressed_norm"},
        "ladder5_rope": {"rope.mode", "rope.dims", "rope.side", "rope.pairing", "rope.theta"},
        "ladder6_sink": {"sink"},
        "ladder7_output_rope": {"output_rope"},
    }
    assert tuple(changes) == LADDER_STEPS and LADDER[0] == "overlap_w8s4"
    previous = composed("w8s4")
    for step in LADDER_STEPS:
        current = composed(f"v4_{step}")
        assert {k for k in current.keys() | previous.keys() if current.get(k) != previous.get(k)} == changes[step]
        previous = current
    v4 = composed("deepseek_v4_csa")
    assert {k for k in v4 if v4[k] != previous.get(k)} == {"local_window"}
