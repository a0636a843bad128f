"""The learned pooling gate (attention.gate, ckv.options.gate): each invalid setting refused with its one line,
each valid combination accepted. The standing properties (visibility, decode == prefill, torch == triton,
gradients, parameter and FLOP accounting) run for the gated options (``w8s8_vector_gate``, ``w8s8_no_gate_bias``,
...) and the mean-pooled ones (``w8s8_mean``) in tests/attention/test_properties.py."""

import itertools

import pytest

from ckv.options import GateConfig
from ckv.options.gate import KINDS

from .helpers import assert_accepted, assert_refused


@pytest.mark.parametrize(
    "attention, message",
    [
        (
            dict(gate=dict(kind="matrix")),
            "attention.gate.kind='matrix' is not allowed; choose one of ['scalar', 'vector']",
        ),
        (dict(gate=dict(kind=None)), "attention.gate.kind=None is not allowed; choose one of ['scalar', 'vector']"),
        (dict(gate=dict(bias="yes")), "attention.gate.bias='yes' must be true or false"),
        (dict(gate=dict(bias=1)), "attention.gate.bias=1 must be true or false"),
        (
            dict(gate=dict(temperature=2)),
            "unknown attention.gate field(s) ['temperature']; valid fields: ['bias', 'kind']",
        ),
        (dict(gate=3), "attention.gate=3 must be a mapping of ['kind', 'bias'] or null (off)"),
    ],
)
def test_bad_gate_settings_raise_one_clear_error(attention, message):
    assert_refused(attention, message)


@pytest.mark.parametrize("kind, bias", list(itertools.product(KINDS, [True, False])))
def test_every_gate_kind_with_and_without_bias_is_accepted(kind, bias):
    assert assert_accepted(dict(gate=dict(kind=kind, bias=bias))).attention.gate == GateConfig(kind=kind, bias=bias)


def test_no_gate_is_uniform_averaging_and_the_default_is_a_scalar_gate_with_bias():
    assert assert_accepted(dict(gate=None)).attention.gate is None
    assert assert_accepted({}).attention.gate == GateConfig(kind="scalar", bias=True)
