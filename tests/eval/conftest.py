"""Fixtures of the evaluation tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers import save_tiny, tiny_deepseek_v4


@pytest.fixture(scope="session")
def tiny_v4(shared_folder: Callable[[str, Callable[[Path], object]], Path]) -> Callable[[int], Path]:
    """``tiny_v4(index_topk)``: the folder of the tiny random DeepseekV4ForCausalLM (``tiny_deepseek_v4``, seed 0)
    with the word tokenizer at that ``index_topk``, saved once per session (xdist workers share it); the one trained
    on ckv's synthetic lookup is tests/apps/test_demo_v4.py's."""

    def get(index_topk: int) -> Path:
        build = functools.partial(tiny_deepseek_v4, index_topk=index_topk)
        return shared_folder(f"tiny_v4_top{index_topk}", lambda folder: save_tiny(build, folder))

    return get
