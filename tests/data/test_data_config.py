"""DataConfig validation and the shipped conf/data presets."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from ckv.config import ConfigError
from ckv.data import DataConfig

CONF = Path(__file__).resolve().parents[2] / "conf" / "data"


def _load(name: str, **overrides: object) -> DataConfig:
    cfg = OmegaConf.merge(OmegaConf.load(CONF / f"{name}.yaml"), overrides)
    return DataConfig.from_dict(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))


@pytest.mark.parametrize("name", ["text_bible", "lookup_kv", "lookup_split", "lookup_kkvv", "mixture"])
def test_presets_load(name: str) -> None:
    cfg = _load(name)
    if cfg.kind != "text":
        assert cfg.lookup.max_len <= cfg.seq_len + 1


def test_lookup_split_preset_is_the_demo_recipe() -> None:
    lk = _load("lookup_split").lookup
    assert (lk.record, lk.n_keys, lk.n_values, lk.n_records, lk.n_queries, lk.filler) == (
        "split",
        16,
        16,
        16,
        8,
        (0, 0),
    )


def test_text_files_preset_needs_paths() -> None:
    with pytest.raises(MissingMandatoryValue, match="paths"):
        _load("text_files")
    assert _load("text_files", text={"paths": ["a.jsonl"]}).text.paths == ["a.jsonl"]


@pytest.mark.parametrize(
    "d, match",
    [
        ({"kind": "audio"}, "data.kind='audio'"),
        ({"seq_len": 1}, "data.seq_len=1"),
        ({"colour": 1}, r"unknown data field\(s\) \['colour'\]"),
        ({"text": {"vocab": 10}}, r"unknown data.text field\(s\) \['vocab'\]"),
        ({"text": {"txt_sample_by": "word"}}, "data.text.txt_sample_by='word'"),
        ({"text": {"paths": []}}, "data.text.paths"),
        ({"lookup": {"filler": [3, 1]}}, r"data.lookup.filler=\[3, 1\]"),
        ({"lookup": {"loss_on": "keys"}}, "data.lookup.loss_on='keys'"),
        ({"lookup": {"n_records": 20, "n_keys": 16}}, "data.lookup.n_records=20 exceeds n_keys=16"),
        ({"lookup": {"min_records": 17}}, "data.lookup.min_records=17 exceeds n_records=16"),
        ({"lookup": {"min_records": 0}}, "data.lookup.min_records=0 must be an integer >= 1"),
        ({"lookup": {"n_queries": 17, "distinct_queries": True}}, "a sequence holds at most 16: lower n_queries"),
        ({"lookup": {"filler": [0, 2], "n_filler": 0}}, "set data.lookup.n_filler >= 1"),
        ({"kind": "lookup", "seq_len": 20}, "data.seq_len=20 is too short"),
        ({"kind": "mixture", "mixture_ratio": 1.0}, "data.mixture_ratio=1.0"),
        ({"kind": "mixture", "mixture_ratio": "half"}, "data.mixture_ratio='half'"),
        ({"kind": "mixture", "mixture_ratio": float("nan")}, "data.mixture_ratio=nan"),
        ({"text": []}, "data.text must be a mapping"),
    ],
)
def test_bad_config_names_the_field(d: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DataConfig.from_dict(d)


def test_roundtrip_through_dict() -> None:
    cfg = _load("mixture")
    assert DataConfig.from_dict(cfg.to_dict()) == cfg
