"""What is unique to oracle selection (``attention.selection.by: oracle``): the top-k of the layer's own dense joint
softmax mass, summed over query heads. The property matrix (test_properties.py) runs the standing properties over
``deepseek_v4_csa_oracle``."""

from __future__ import annotations

import math

import pytest
import torch

from ckv import Transformer
from ckv.attention.indexer import entry_logits, oracle_scores, oracle_selection, top_k
from ckv.config import ConfigError
from ckv.train.config import TrainConfig
from tests.helpers import small_config
from tests.train.helpers import base_config

ORACLE = dict(kind="compressed", window=8, stride=4, local_window=3, kv_heads=1, selection=dict(topk=2, by="oracle"))


def test_the_oracle_ranks_entries_by_the_probability_summed_over_heads():
    """Two heads of 2 dims; q_h = sqrt(2) e_h makes the logit of head h on entry s its key's h-th coordinate.
    Entry 0 (2.5, 2.5) has mass 2 e^2.5 = 24.4, entry 1 (3, 0) e^3 + 1 = 21.1 (the larger single logit), entry 2
    (1, 1) 2e = 5.4, entry 3 (9, 9) is not visible to the query at grid position 14 (it closes at 15). With the
    second head's log-sum-exp at 5 instead of 0, entry 1 leads: e^3 + e^-5 = 20.1 against e^2.5 + e^-2.5 = 12.3."""
    q = math.sqrt(2) * torch.eye(2).reshape(1, 1, 2, 2)  # (B, T, H, D)
    kc = torch.tensor([[2.5, 2.5], [3.0, 0.0], [1.0, 1.0], [9.0, 9.0]]).reshape(1, 4, 1, 2)  # (B, E, KV, D)
    scores = oracle_scores(q, kc, torch.zeros(1, 1, 2), q_start=14, stride=4)
    want = [2 * math.exp(2.5), math.exp(3) + 1, 2 * math.e]
    assert scores[0, 0, :3].tolist() == pytest.approx(want, rel=1e-6) and scores[0, 0, 3] == float("-inf")
    assert oracle_selection(q, kc, torch.zeros(1, 1, 2), q_start=14, stride=4, k=2).tolist() == [[[0, 1]]]
    selected = oracle_selection(q, kc, torch.tensor([[[0.0, 5.0]]]), q_start=14, stride=4, k=2)
    assert selected.tolist() == [[[1, 0]]]
    selected = oracle_selection(q, kc, torch.zeros(1, 1, 2), q_start=14, stride=4, k=4)
    assert selected.tolist() == [[[0, 1, 2, -1]]]  # three visible entries: the fourth slot is empty


def test_the_layer_attends_to_the_top_k_of_its_dense_softmax():
    """The oracle layer has the dense layer's parameters exactly; it selects the top-k of the dense layer's own
    mass (read from the dense layer's joint softmax: queries, entries, log-sum-exp), and with a top-k at least the
    number of entries it is the dense layer."""
    torch.manual_seed(0)
    dense_att = {k: v for k, v in ORACLE.items() if k != "selection"}
    dense = Transformer(small_config(dense_att, n_layers=1)).eval()
    oracle = Transformer(small_config(ORACLE, n_layers=1)).eval()
    oracle.load_state_dict(dense.state_dict())  # strict: no parameter more or less
    ids = torch.randint(0, 64, (2, 27))
    seen = {}
    dense.layers[0].self_attn.attend.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(q=args[0], kc=args[1], lse=out[1]), with_kwargs=True
    )
    oracle.layers[0].self_attn.attend.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(selected=kwargs["selected"]), with_kwargs=True
    )
    with torch.no_grad():
        plain, picked = dense(ids), oracle(ids)
    mass = torch.exp(entry_logits(seen["q"], seen["kc"]) - seen["lse"][..., None]).sum(2)  # (B, T, E)
    t = torch.arange(27)[:, None]
    visible = (torch.arange(mass.shape[-1])[None] + 1) * 4 - 1 <= t  # (T, E): entry s closes at 4s + 3
    assert torch.equal(seen["selected"], top_k(mass.masked_fill(~visible, float("-inf")), 2))
    assert ((seen["selected"] >= 0).sum(-1) < visible.sum(-1)).any()  # it binds
    assert (picked - plain).abs().max() > 1e-4
    wide = Transformer(small_config({**ORACLE, "selection": dict(topk=64, by="oracle")}, n_layers=1)).eval()
    wide.load_state_dict(dense.state_dict())
    with torch.no_grad():
        assert torch.equal(wide(ids), plain)


def test_oracle_selection_has_no_indexer_and_refuses_a_warm_up(tmp_path):
    model = Transformer(small_config(ORACLE))
    assert all(layer.self_attn.indexer is None for layer in model.layers)
    run = base_config(tmp_path / "run", tmp_path / "cache")
    run["attention"] = ORACLE
    run["trainer"]["indexer"] = {"warmup_steps": 5}
    with pytest.raises(ConfigError, match="warmup_steps=5 is a dense stage for .*'oracle'") as err:
        TrainConfig.from_dict(run)
    assert "\n" not in str(err.value)
    run["trainer"]["indexer"] = {"warmup_steps": 0}
    TrainConfig.from_dict(run)  # the weight (default 1) is ignored: nothing to train
