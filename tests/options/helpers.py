"""Builders shared by the option groups' tests: a tiny one-layer model over a compressed W4/S4 layer, built from an
attention config that must be refused with one line, or accepted and kept through a save and a load."""

from __future__ import annotations

import pytest

from ckv import ModelConfig, Transformer
from ckv.config import ConfigError
from tests.helpers import small_config

COMPRESSED = dict(kind="compressed", window=4, stride=4)


def assert_refused(attention: dict, message: str) -> None:
    """Building a model with ``attention`` (over ``COMPRESSED``) fails with the one ConfigError line ``message``."""
    with pytest.raises(ConfigError) as err:
        Transformer(small_config({**COMPRESSED, **attention}, n_layers=1))
    assert str(err.value) == message


def assert_accepted(attention: dict) -> ModelConfig:
    """A model with ``attention`` (over ``COMPRESSED``) builds, and its config comes back equal from its saved dict;
    returns the config."""
    cfg = small_config({**COMPRESSED, **attention}, n_layers=1)
    Transformer(cfg)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    return cfg
