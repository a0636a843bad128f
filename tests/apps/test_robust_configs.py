"""make robust's configs: the two task experiments compose on make demo's model and budget with every attention
option of the plan (TrainConfig validates each model), and the GPU sweep of the fixes holds only options that
exist, at the paper's local window."""

import pytest

from ckv.apps.robust import MODELS
from tests.train.test_entry import USER_DATA, _sweep, _train_config


@pytest.mark.parametrize("task", sorted(MODELS))
def test_every_model_of_a_task_shares_the_demo_budget_and_local_window(task):
    budgets = set()
    for option in (m.option for m in MODELS[task]):
        cfg = _train_config([f"experiment=robust_{task}", *option.split()])
        budgets.add((cfg.trainer.max_steps, cfg.trainer.global_batch_size, cfg.optim.lr, cfg.data.seq_len))
        if cfg.attention["kind"] == "compressed":
            assert cfg.attention["local_window"] == 4 and cfg.attention["kv_heads"] == 1
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
