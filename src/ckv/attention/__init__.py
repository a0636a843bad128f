"""Attention backends behind one registry: ``kind`` -> backend class.

Registering a backend is the one place that makes a kind exist: each backend names the config class of its kind
(``config_class``), which ``AttentionConfig.from_dict`` builds for that kind (the registry is ``ckv.config``'s, so
that configs can pick their class), and ``check_attention`` (called by ``build_attention``, and by ``TrainConfig``
before any data is prepared) finds the backend and lets it refuse a configuration it cannot run.

Code outside ``ckv.attention`` imports from here; of the compressed backend it uses only its public surface
(``CompressedAttention``'s docstring, docs/attention.md): ``compressed_layers``, a layer's ``compressors()``,
``indexer`` and ``attend`` (a hook decodes its call with ``AttendCall``), a ``Compressor``'s ``payload``, ``gate``
(``CompressorGate``) and ``pooling`` (``Pooling``). ``EntrySet`` is what a source layer of cross-layer KV sharing
publishes into the dict the model's forward threads through its blocks.
"""

from __future__ import annotations

import math
from typing import Optional

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
    """The backend class of ``config.attention.kind``, after it (and, under a layer schedule, every layer's
    backend) has checked its layer's config; ConfigError naming the field when a kind is not registered or a
    backend cannot run the configuration."""
    if config.layers is not None:
        layer_backends(config)
    backend = _backend(config.attention.kind)
    backend.check(config)
    return backend


def layer_backends(config: ModelConfig) -> list[tuple[type[AttentionBackend], ModelConfig]]:
    """Each layer's backend class and the config it is built from (``ModelConfig.layer_config``), layer by layer,
    each checked: what the accounting sums over (one pair repeated ``n_layers`` times for a uniform stack)."""
    out = []
    for i in range(config.n_layers):
        layer = config.layer_config(i)
        if i == 0 or layer is not out[-1][1]:
            backend = _backend(layer.attention.kind)
            backend.check(layer)
        out.append((backend, layer))
    return out


def model_phase_stride(config: ModelConfig) -> Optional[int]:
    """The period of the phase effects a model's attention can cause (None: positions have no phase), after
    ``check_attention``: each layer's backend declares its own (``phase_stride``: a compressed layer's stride, None
    for full and sliding attention); a uniform stack's is its attention's, and under a layer schedule whose
    compressed layers have several strides it is their least common multiple, the shortest period in which every
    layer's phase repeats (strides 2 and 4: 4; 4 and 6: 12)."""
    check_attention(config)
    strides = {backend.phase_stride(layer) for backend, layer in layer_backends(config)} - {None}
    return math.lcm(*strides) if strides else None


def _backend(kind: str) -> type[AttentionBackend]:
    if kind not in REGISTRY:
        raise ConfigError(f"attention.kind={kind!r} has no registered backend; available: {sorted(REGISTRY)}")
    return REGISTRY[kind]


def build_attention(config: ModelConfig, layer_idx: int) -> AttentionBackend:
    """The attention module of layer ``layer_idx``, chosen by its attention's kind and built from its config
    (``ModelConfig.layer_config``: ``config`` itself without a layer schedule; the backend checks it)."""
    layer = config.layer_config(layer_idx)
    return _backend(layer.attention.kind)(layer, layer_idx)


from ckv.attention.compressed import CompressedAttention, compressed_layers  # noqa: E402
from ckv.attention.compressed_config import CompressedAttentionConfig  # noqa: E402
from ckv.attention.compressor import Compressor, CompressorGate  # noqa: E402
from ckv.attention.dispatch import AttendCall, EntrySet, JointAttention, Pooling  # noqa: E402
from ckv.attention.full import FullAttention, SlidingAttention, SlidingAttentionConfig  # noqa: E402

register(FullAttention)
register(CompressedAttention)
register(SlidingAttention)

__all__ = [
    "REGISTRY",
    "AttendCall",
    "AttentionBackend",
    "CompressedAttention",
    "CompressedAttentionConfig",
    "Compressor",
    "CompressorGate",
    "EntrySet",
    "FullAttention",
    "JointAttention",
    "Pooling",
    "SlidingAttention",
    "SlidingAttentionConfig",
    "build_attention",
    "check_attention",
    "compressed_layers",
    "layer_backends",
    "model_phase_stride",
    "register",
]
