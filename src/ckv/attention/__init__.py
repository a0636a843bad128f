"""Attention backends behind one registry: ``kind`` -> backend class.

Registering a backend is the one place that makes a kind exist: each backend names the config class of its kind
(``config_class``), which ``AttentionConfig.from_dict`` builds for that kind (the registry is ``ckv.config``'s, so
that configs can pick their class), and ``check_attention`` (called by ``build_attention``, and by ``TrainConfig``
before any data is prepared) finds the backend and lets it refuse a configuration it cannot run.

Code outside ``ckv.attention`` imports from here; of the compressed backend it uses only its public surface
(``CompressedAttention``'s docstring, docs/attention.md): ``compressed_layers``, a layer's ``compressors()``,
``indexer`` and ``attend`` (a hook decodes its call with ``AttendCall``), a ``Compressor``'s ``payload``, ``gate``
(``CompressorGate``) and ``pooling`` (``Pooling``).
"""

from __future__ import annotations

from ckv.attention.base import AttentionBackend
from ckv.config import REGISTRY, ConfigError, ModelConfig


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Register backend ``cls`` (and with it its ``config_class``) under ``cls.kind`` (usable as a class
    decorator); a kind is registered once."""
    if cls.kind in REGISTRY and REGISTRY[cls.kind] is not cls:
        raise ValueError(f"attention.kind={cls.kind!r} is already registered by {REGISTRY[cls.kind].__name__}")
    REGISTRY[cls.kind] = cls
    return cls


def check_attention(config: ModelConfig) -> type[AttentionBackend]:
    """The backend class of ``config.attention.kind``, after it has checked ``config``; ConfigError naming the
    field when the kind is not registered or the backend cannot run the configuration."""
    backend = _backend(config.attention.kind)
    backend.check(config)
    return backend


def _backend(kind: str) -> type[AttentionBackend]:
    if kind not in REGISTRY:
        raise ConfigError(f"attention.kind={kind!r} has no registered backend; available: {sorted(REGISTRY)}")
    return REGISTRY[kind]


def build_attention(config: ModelConfig, layer_idx: int) -> AttentionBackend:
    """The attention module of one layer, chosen by ``config.attention.kind`` (the backend checks ``config``)."""
    return _backend(config.attention.kind)(config, layer_idx)


from ckv.attention.compressed import CompressedAttention, compressed_layers  # noqa: E402
from ckv.attention.compressed_config import CompressedAttentionConfig  # noqa: E402
from ckv.attention.compressor import Compressor, CompressorGate  # noqa: E402
from ckv.attention.dispatch import AttendCall, JointAttention, Pooling  # noqa: E402
from ckv.attention.full import FullAttention  # noqa: E402

register(FullAttention)
register(CompressedAttention)

__all__ = [
    "REGISTRY",
    "AttendCall",
    "AttentionBackend",
    "CompressedAttention",
    "CompressedAttentionConfig",
    "Compressor",
    "CompressorGate",
    "FullAttention",
    "JointAttention",
    "Pooling",
    "build_attention",
    "check_attention",
    "compressed_layers",
    "register",
]
