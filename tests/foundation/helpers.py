"""Small builders shared by the foundation tests."""

from __future__ import annotations

from pathlib import Path

from ckv import ModelConfig
from ckv.apps.smoke import load_variant

ATTENTION_DIR = Path(__file__).resolve().parents[2] / "conf" / "attention"
VARIANTS = sorted(p.stem for p in ATTENTION_DIR.glob("*.yaml"))


def variant(name: str) -> dict:
    return load_variant(ATTENTION_DIR, name)


def small_config(attention: dict, **overrides) -> ModelConfig:
    """A tiny model that every variant fits (8 query heads so 1/2/4/8 KV heads divide, head_dim 16)."""
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, mlp_dim=64, max_seq_len=128)
    return ModelConfig(**{**base, **overrides}, attention=attention)
