"""The attention options of the checkout's ``conf/attention``, composed by Hydra: ``option_names`` (the matrix: each
YAML, then each option of each group folder on ``GROUP_BASES``) and ``load_variant`` (one option as a plain dict).
``make smoke``, ``benchmarks/gpu_check.py`` and the tests' option matrix read the options through here."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

# every option of a group folder (conf/attention/mixing/conv.yaml, ...) is composed onto these bases: W = S, an
# overlapping window with offset-specific maps, and DeepSeek-V4's CSA
GROUP_BASES = ("w4s4", "w8s4", "deepseek_v4_csa")


def load_variant(conf_dir: str | Path, name: str) -> dict:
    """Attention option ``name`` of ``conf_dir`` composed by Hydra: the option it starts from (its ``defaults``,
    e.g. ``w8s8``) with its own fields merged over it. ``base+group=option`` composes a group folder's option onto
    a base (``w4s4+mixing=conv``: ``python train.py attention=w4s4 attention/mixing=conv``)."""
    base, *groups = name.split("+")
    with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name=base, overrides=groups))


def option_names(conf_dir: str | Path) -> list[str]:
    """Every attention option to check: each YAML of ``conf_dir``, then each option of each group folder composed
    onto ``GROUP_BASES`` (``w4s4+mixing=conv``, ...)."""
    root = Path(conf_dir)
    names = sorted(p.stem for p in root.glob("*.yaml"))
    groups = sorted((g.name, p.stem) for g in root.iterdir() if g.is_dir() for p in g.glob("*.yaml"))
    return names + [f"{base}+{group}={option}" for group, option in groups for base in GROUP_BASES]
