"""Top-k selection of compressed entries (attention.selection, ckv.options.selection): each invalid setting refused
with its one line, each valid combination accepted. The indexer's own functions (top-k, fake quantisation) and the
layer's selection are tests/attention/test_selection.py's and test_selection_oracle.py's; the standing properties
run for ``deepseek_v4_csa_sparse``, ``deepseek_v4_csa_oracle`` and ``<base>+selection=indexer`` in
tests/attention/test_properties.py."""

import pytest

from ckv.options import SelectionConfig
from ckv.options.selection import BY, QUANT_BLOCK

from .helpers import assert_accepted, assert_refused

SELECTION_FIELDS = "['by', 'head_dim', 'heads', 'quant', 'topk']"


@pytest.mark.parametrize(
    "attention, message",
    [
        (dict(selection=dict(topk=0)), "attention.selection.topk=0 must be an integer >= 1"),
        (dict(selection=dict(heads="2")), "attention.selection.heads='2' must be an integer >= 1"),
        (dict(selection=dict(head_dim=0)), "attention.selection.head_dim=0 must be an integer >= 1"),
        (
            dict(selection=dict(by="best")),
            "attention.selection.by='best' is not allowed; choose one of ['indexer', 'oracle']",
        ),
        (
            dict(selection=dict(quant="int8")),
            "attention.selection.quant='int8' is not allowed; choose one of ['none', 'fp8', 'fp4']",
        ),
        (
            dict(selection=dict(quant="fp8", by="oracle")),
            "attention.selection.quant='fp8' quantises the lightning indexer, but by='oracle' has none",
        ),
        (
            dict(selection=dict(quant="fp4", head_dim=48)),
            "attention.selection.head_dim=48 must be a multiple of quant='fp4''s block of 32 dims (or at most 32)",
        ),
        (
            dict(selection=dict(head_dim=7)),
            "attention.selection.head_dim=7 must hold the indexer's rotated dims (7: attention.rope mode='full', "
            "dims=None) and be even when every dim rotates",
        ),
        (
            dict(selection=dict(head_dim=8), rope=dict(mode="partial", dims=16)),
            "attention.selection.head_dim=8 must hold the indexer's rotated dims (16: attention.rope "
            "mode='partial', dims=16) and be even when every dim rotates",
        ),
        (
            dict(selection=dict(depth=1)),
            f"unknown attention.selection field(s) ['depth']; valid fields: {SELECTION_FIELDS}",
        ),
        (
            dict(selection=2),
            "attention.selection=2 must be a mapping of ['topk', 'heads', 'head_dim', 'by', 'quant'] or null (off)",
        ),
    ],
)
def test_bad_selection_settings_raise_one_clear_error(attention, message):
    assert_refused(attention, message)


COMBINATIONS = [  # quantisation is the indexer's: the oracle takes none
    (by, quant) for by in BY for quant in QUANT_BLOCK if quant == "none" or by == "indexer"
]


@pytest.mark.parametrize("by, quant", COMBINATIONS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_every_ranking_with_every_quantisation_it_takes_is_accepted(by, quant, head_dim):
    """Index heads below a quantisation block (16) and a multiple of every block (64)."""
    selection = dict(topk=2, heads=2, head_dim=head_dim, by=by, quant=quant)
    assert assert_accepted(dict(selection=selection)).attention.selection == SelectionConfig(**selection)


@pytest.mark.parametrize(
    "attention",
    [
        dict(selection=dict(topk=1, head_dim=8), rope=dict(mode="partial", dims=8)),  # the rotated dims just fit
        dict(selection=dict(head_dim=7), rope=dict(mode="none")),  # no dim rotates: any width
        dict(selection=dict(head_dim=7, by="oracle")),  # the oracle has no index keys
        dict(selection=dict(topk=2, heads=2, head_dim=16), query=dict(lora_rank=8)),  # index queries from the latent
        dict(selection=None),  # dense: every visible entry
    ],
)
def test_selection_is_accepted_beside_the_rope_and_query_it_fits(attention):
    assert assert_accepted(attention).attention.selection == (
        None if attention["selection"] is None else SelectionConfig(**attention["selection"])
    )
