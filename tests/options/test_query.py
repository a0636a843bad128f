"""DeepSeek-V4's low-rank query path (attention.query, ckv.options.query): each invalid setting refused with its
one line, each valid rank accepted, and the layer's queries read through the latent. The standing properties run
for ``deepseek_v4_csa_sparse`` (rank 8) in tests/attention/test_properties.py."""

import pytest
import torch

from ckv import Transformer
from ckv.options import QueryConfig
from tests.helpers import small_config, variant

from .helpers import assert_accepted, assert_refused


@pytest.mark.parametrize(
    "attention, message",
    [
        (dict(query=dict(lora_rank=0)), "attention.query.lora_rank=0 must be an integer >= 1"),
        (dict(query=dict(lora_rank="8")), "attention.query.lora_rank='8' must be an integer >= 1"),
        (dict(query=dict(lora_rank=2.5)), "attention.query.lora_rank=2.5 must be an integer >= 1"),
        (dict(query=dict(lora_rank=True)), "attention.query.lora_rank=True must be an integer >= 1"),
        (dict(query=dict(rank=8)), "unknown attention.query field(s) ['rank']; valid fields: ['lora_rank']"),
        (dict(query=8), "attention.query=8 must be a mapping of ['lora_rank'] or null (off)"),
    ],
)
def test_bad_query_settings_raise_one_clear_error(attention, message):
    assert_refused(attention, message)


@pytest.mark.parametrize("lora_rank", [1, 8, 64])
def test_any_rank_is_accepted_alone_and_with_the_indexer(lora_rank):
    """Ranks below and above the model's width (32); the lightning indexer reads its queries from the latent."""
    for selection in (None, dict(topk=2, heads=2, head_dim=16)):
        cfg = assert_accepted(dict(query=dict(lora_rank=lora_rank), selection=selection))
        assert cfg.attention.query == QueryConfig(lora_rank=lora_rank)


def test_no_query_path_is_the_default():
    assert assert_accepted({}).attention.query is None


def test_the_layer_reads_its_queries_through_the_low_rank_latent():
    """With attention.query the query map and the indexer's query map read RMSNorm(q_a x) (rank 8 here)."""
    torch.manual_seed(0)
    att = {**variant("deepseek_v4_csa_sparse"), "query": {"lora_rank": 8}}
    layer = Transformer(small_config(att, n_layers=1)).layers[0].self_attn
    x = torch.randn(1, 9, 32)
    latent = layer.query_latent(x)
    assert latent.shape == (1, 9, 8) and torch.equal(latent, layer.q_latent.norm(layer.q_latent.proj(x)))
    assert layer.q_proj.in_features == layer.indexer.q_proj.in_features == 8
