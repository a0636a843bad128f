"""RoPE of queries and keys (attention.rope, ckv.options.rope) and its YaRN scaling (attention.rope.yarn): each
invalid setting refused with its one line, each valid combination accepted, and YaRN's frequencies equal to
transformers'. The rotation itself is tests/attention/test_v4_variants.py's; the standing properties run for
``w8s8_no_rope``, ``w8s8_rope16``, ``v4_ladder5_rope`` and the V4 options in tests/attention/test_properties.py."""

import itertools

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ckv.attention.rope import inverse_frequencies
from ckv.options import RopeConfig, YarnConfig
from ckv.options.rope import MODES, PAIRINGS, SIDES

from .helpers import assert_accepted, assert_refused

YARN_FIELDS = "['factor', 'original_max_positions', 'beta_fast', 'beta_slow']"


@pytest.mark.parametrize(
    "rope, message",
    [
        (dict(mode="half"), "attention.rope.mode='half' is not allowed; choose one of ['full', 'partial', 'none']"),
        (dict(side="middle"), "attention.rope.side='middle' is not allowed; choose one of ['leading', 'trailing']"),
        (dict(pairing="pairs"), "attention.rope.pairing='pairs' is not allowed; choose one of ['half', 'interleaved']"),
        (
            dict(mode="partial"),
            "attention.rope.mode='partial' needs attention.rope.dims (an even number of dims per head)",
        ),
        (
            dict(mode="full", dims=8),
            "attention.rope.dims=8 is only used with attention.rope.mode='partial' (got mode='full')",
        ),
        (dict(mode="partial", dims=7), "attention.rope.dims=7 must be an even integer in [2, head_dim=16]"),
        (dict(mode="partial", dims=0), "attention.rope.dims=0 must be an even integer in [2, head_dim=16]"),
        (dict(mode="partial", dims=32), "attention.rope.dims=32 must be an even integer in [2, head_dim=16]"),
        (dict(theta=0.0), "attention.rope.theta=0.0 must be a finite number > 0"),
        (dict(theta="big"), "attention.rope.theta='big' must be a finite number > 0"),
        (dict(theta=float("inf")), "attention.rope.theta=inf must be a finite number > 0"),
        (
            dict(base=2),
            "unknown attention.rope field(s) ['base']; valid fields: ['dims', 'mode', 'pairing', 'side', 'theta', "
            "'yarn']",
        ),
        (dict(yarn=dict(factor=0.5)), "attention.rope.yarn.factor=0.5 must be a finite number >= 1"),
        (
            dict(yarn=dict(original_max_positions=0)),
            "attention.rope.yarn.original_max_positions=0 must be an integer >= 1",
        ),
        (dict(yarn=dict(beta_fast=0)), "attention.rope.yarn.beta_fast=0 must be a finite number > 0"),
        (dict(yarn=dict(beta_slow=-1)), "attention.rope.yarn.beta_slow=-1 must be a finite number > 0"),
        (
            dict(yarn=dict(beta_fast=1, beta_slow=2)),
            "attention.rope.yarn.beta_fast=1 must be >= attention.rope.yarn.beta_slow=2",
        ),
        (
            dict(yarn=dict(scale=2)),
            "unknown attention.rope.yarn field(s) ['scale']; valid fields: ['beta_fast', 'beta_slow', 'factor', "
            "'original_max_positions']",
        ),
        (dict(yarn=4), f"attention.rope.yarn=4 must be a mapping of {YARN_FIELDS} or null (off)"),
        (
            dict(mode="none", yarn=dict()),
            "attention.rope.yarn scales rotated dims; attention.rope.mode='none' rotates none",
        ),
    ],
)
def test_bad_rope_settings_raise_one_clear_error(rope, message):
    assert_refused(dict(rope=rope), message)


def test_rope_is_never_off_by_null():
    assert_refused(
        dict(rope=None),
        "attention.rope=None must be a mapping of ['mode', 'dims', 'side', 'pairing', 'theta', 'yarn']",
    )


@pytest.mark.parametrize("mode, side, pairing", list(itertools.product(MODES, SIDES, PAIRINGS)))
def test_every_mode_side_and_pairing_is_accepted_with_its_own_theta_and_yarn(mode, side, pairing):
    dims = 8 if mode == "partial" else None
    for theta, yarn in itertools.product([None, 1e4], [None, dict(factor=4.0, original_max_positions=32)]):
        if yarn is not None and mode == "none":
            continue  # refused above: nothing rotates to scale
        rope = dict(mode=mode, dims=dims, side=side, pairing=pairing, theta=theta, yarn=yarn)
        expected = RopeConfig(**{**rope, "yarn": yarn and YarnConfig(**yarn)})
        assert assert_accepted(dict(rope=rope)).attention.rope == expected


@pytest.mark.parametrize(
    "factor, original, dims, theta", [(4.0, 16, 8, 160000.0), (16.0, 65536, 64, 160000.0), (2.0, 32, 16, 1e4)]
)
def test_yarn_frequencies_equal_transformers(factor, original, dims, theta):
    """V4's YaRN (attention factor 1) against transformers' ``_compute_yarn_parameters`` for the compress rope."""
    cfg = DeepseekV4Config(
        head_dim=dims * 2,
        partial_rotary_factor=0.5,
        compress_rope_theta=theta,
        max_position_embeddings=int(original * factor),
        rope_parameters={"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original},
    )
    want, scaling = ROPE_INIT_FUNCTIONS["yarn"](cfg, None, layer_type="compress")
    got = inverse_frequencies(dims, theta, YarnConfig(factor=factor, original_max_positions=original))
    assert scaling == 1.0 and torch.allclose(got, want, rtol=1e-6, atol=0)
    assert not torch.allclose(got, inverse_frequencies(dims, theta))  # the scaling changes some frequencies
