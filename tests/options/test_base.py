"""What every option group shares (``ckv.options.base``): one-line errors naming each field, and checks against
plain values (the compressor's stride, the model's layer and head counts), never against the config holding it."""

import dataclasses

import pytest

from ckv.attention import CompressedAttentionConfig
from ckv.config import ConfigError
from ckv.options import GridConfig, MixingConfig, RopeConfig, SelectionConfig


@pytest.mark.parametrize("group", sorted(CompressedAttentionConfig.GROUPS))
def test_every_option_group_field_rejects_wrong_values_with_one_line_naming_it(group):
    """Generated from the group dataclasses, so a new field cannot escape: each field, given values of the wrong
    type or range, fails with one ConfigError line naming ``attention.<group>.<field>`` (never another error)."""
    cls = CompressedAttentionConfig.GROUPS[group]
    wrong = ["not-a-choice", -7, 2.5, True, [1.5], {"x": 1}]
    for f in dataclasses.fields(cls):
        rejected = 0
        for value in wrong:
            try:
                cls(**{f.name: value})
            except ConfigError as err:
                assert f"attention.{group}.{f.name}" in str(err) and "\n" not in str(err), (f.name, value, err)
                rejected += 1
        assert rejected >= len(wrong) - 1, f"attention.{group}.{f.name} accepts most wrong values"


@pytest.mark.parametrize(
    "check, match",
    [
        (
            lambda: GridConfig(offsets=[0, 4]).check_stride(4),
            r"attention.grid.offsets\[1\]=4 must be < attention.stride=4",
        ),
        (
            lambda: GridConfig(offsets=[0, 1]).check_model(n_layers=3, kv_heads=1, head_dim=16),
            r"attention.grid.offsets has 2 entries; it needs one per layer \(model.n_layers=3\)",
        ),
        (
            lambda: GridConfig(offsets=[0], per="kv_head").check_model(n_layers=2, kv_heads=2, head_dim=16),
            r"one per kv_head \(KV heads=2\)",
        ),
        (lambda: MixingConfig(kernel=5).check_stride(4), "attention.mixing.kernel=5 must be <= attention.stride=4"),
        (lambda: MixingConfig().check_stride(1), "attention.mixing needs attention.stride >= 2"),
        (
            lambda: RopeConfig(mode="partial", dims=32).check_model(n_layers=2, kv_heads=1, head_dim=16),
            r"attention.rope.dims=32 must be an even integer in \[2, head_dim=16\]",
        ),
        (
            lambda: SelectionConfig(head_dim=8).check_rope(RopeConfig(mode="partial", dims=16)),
            r"attention.selection.head_dim=8 must hold the indexer's rotated dims \(16",
        ),
    ],
)
def test_groups_check_against_plain_values(check, match):
    with pytest.raises(ConfigError, match=match):
        check()


def test_groups_accept_what_fits():
    GridConfig(offsets=[0, 3]).check_stride(4)
    GridConfig(offsets=[0, 1]).check_model(n_layers=2, kv_heads=1, head_dim=16)
    MixingConfig(kernel=4).check_stride(4)
    RopeConfig(mode="partial", dims=16).check_model(n_layers=2, kv_heads=1, head_dim=16)
    SelectionConfig(head_dim=16, by="oracle").check_rope(RopeConfig(mode="full"))  # the oracle has no keys
