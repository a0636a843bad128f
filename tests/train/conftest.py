"""Fixtures of the training tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckv.train import TrainConfig

from .helpers import MERGED_SECTIONS, base_config


@pytest.fixture
def make_config(tmp_path: Path, cache_dir: str) -> Callable[..., TrainConfig]:
    """``make_config(name, **sections)``: a tiny CPU run in ``tmp_path/name``; a keyword updates a section of
    ``MERGED_SECTIONS`` (``trainer={"max_steps": 4}``) or replaces any other (``data=TEXT_DATA``)."""

    def make(name: str = "run", **sections: Any) -> TrainConfig:
        d = base_config(tmp_path / name, cache_dir)
        for key, value in sections.items():
            d[key] = {**d[key], **value} if key in MERGED_SECTIONS else value
        return TrainConfig.from_dict(d)

    return make
