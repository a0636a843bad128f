"""Attention backends behind one registry: ``kind`` -> backend class."""

from __future__ import annotations

from ckv.attention.base import AttentionBackend
from ckv.config import ConfigError, ModelConfig

REGISTRY: dict[str, type[AttentionBackend]] = {}


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    REGISTRY[cls.kind] = cls
    return cls


def build_attention(config: ModelConfig, layer_idx: int) -> AttentionBackend:
    """The attention module of one layer, chosen by ``config.attention.kind``."""
    kind = config.attention.kind
    if kind not in REGISTRY:
        raise ConfigError(f"attention.kind={kind!r} has no registered backend; available: {sorted(REGISTRY)}")
    return REGISTRY[kind](config, layer_idx)


from ckv.attention.compressed import CompressedAttention  # noqa: E402
from ckv.attention.full import FullAttention  # noqa: E402

register(FullAttention)
register(CompressedAttention)

__all__ = ["REGISTRY", "AttentionBackend", "CompressedAttention", "FullAttention", "build_attention", "register"]
