"""Validated model and attention configuration (plain dataclasses: library code never sees Hydra objects)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from ckv.checks import (  # noqa: F401  (re-exported: the config API)
    ConfigError,
    check_bool,
    check_choice,
    check_float,
    check_int,
    field_names,
    reject_unknown,
)
from ckv.options import OptionGroup, RopeConfig

# The attention backends by kind (``kind -> backend class``), filled by ``ckv.attention.register``. It lives here,
# below the backends, because a config picks its class by kind: each backend names its config (``config_class``).
REGISTRY: dict[str, Any] = {}


def config_class(kind: Any) -> type[AttentionConfig]:
    """The config class the backend registered for ``kind`` declares; ConfigError naming the field otherwise."""
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"attention.kind={kind!r} must be a non-empty string")
    if kind not in REGISTRY:
        raise ConfigError(f"attention.kind={kind!r} has no registered backend; available: {sorted(REGISTRY)}")
    return REGISTRY[kind].config_class


def not_taken_error(names: Iterable[str], kind: str) -> ConfigError:
    """The one-line error for attention fields that the config of ``kind`` does not take."""
    names = sorted(names)
    fields = ", ".join(f"attention.{n}" for n in names)
    verb = "is not a field" if len(names) == 1 else "are not fields"
    return ConfigError(f"{fields} {verb} of attention.kind={kind!r}; it takes {field_names(config_class(kind))}")


@dataclass
class AttentionConfig:
    """The attention fields every kind takes, and the union of the kinds' configs: ``from_dict`` builds the config
    class the backend registered under ``kind`` declares (``config_class``, ``ckv.attention.register``), and a
    field that class does not have is a ConfigError naming the field and the kind. Full attention takes exactly
    these fields; compressed attention's config (``ckv.attention.compressed_config``) adds the compressor's.

    ``kind`` names a registered backend and ``impl`` one of its implementations (the backend checks ``impl`` when
    the model is built: ``ckv.attention.check_attention``). ``kv_heads=None`` takes the model's ``n_kv_heads``.
    ``rope`` (``ckv.options.RopeConfig``, a nested mapping in YAML) is every kind's option group; a kind's
    ``GROUPS`` list the option groups it takes by key, each null when off (``rope`` always set).
    """

    GROUPS: ClassVar[dict[str, type[OptionGroup]]] = {"rope": RopeConfig}

    kind: str = "full"
    impl: str = "auto"
    qk_norm: bool = True
    kv_heads: Optional[int] = None
    rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self) -> None:
        own = config_class(self.kind)
        if type(self) is not own:
            raise ConfigError(
                f"attention.kind={self.kind!r} is configured by {own.__name__}, not {type(self).__name__}"
            )
        if not isinstance(self.impl, str) or not self.impl:
            raise ConfigError(f"attention.impl={self.impl!r} must be a non-empty string")
        for name, cls in self.GROUPS.items():
            setattr(self, name, _group(cls, getattr(self, name), required=name == "rope"))
        check_bool("attention.qk_norm", self.qk_norm)
        if self.kv_heads is not None:
            check_int("attention.kv_heads", self.kv_heads)

    def groups(self) -> list[OptionGroup]:
        """The option groups that are set (``rope`` always), in ``GROUPS`` order."""
        return [g for g in (getattr(self, name) for name in self.GROUPS) if g is not None]

    def option(self, name: str) -> Optional[OptionGroup]:
        """Option group ``name`` when this kind takes it and it is set, else None."""
        return getattr(self, name) if name in self.GROUPS else None

    @property
    def tied_kv(self) -> bool:
        """Whether the values reuse the keys (no value projection)."""
        return False

    def describe(self) -> dict[str, Any]:
        """What results and plots say about this attention: ``kind``, and the ``window``, ``stride`` and
        ``pooling`` of a compressor (None here: full attention has none)."""
        return {"kind": self.kind, "window": None, "stride": None, "pooling": None}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AttentionConfig:
        """The config of ``d["kind"]`` (this class's kind when absent) from a mapping; a field that config does not
        have is a ConfigError naming the field and the kind. Configs written before the option groups (flat
        ``rope_dims``, ``pooling``, ``mixing_kernel``, ...) are upgraded (``upgrade_attention``); a saved one from
        before one config per kind goes through ``saved_attention`` first."""
        d = upgrade_attention({"kind": cls.kind, **d})[0]
        own = config_class(d["kind"])
        foreign = set(d) - set(field_names(own))
        if foreign:
            raise not_taken_error(foreign, d["kind"])
        return own(**d)


def _group(cls: type[OptionGroup], value: Any, required: bool) -> Optional[OptionGroup]:
    """An option group from its config value: a mapping of its fields, the dataclass itself, or None (off)."""
    if value is None and not required:
        return None
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        off = "" if required else " or null (off)"
        raise ConfigError(f"attention.{cls.name}={value!r} must be a mapping of {field_names(cls)}{off}")
    reject_unknown(value, field_names(cls), f"attention.{cls.name}")
    return cls(**value)


# The flat attention keys that configs written before the option groups carried, and where each went.
_LEGACY_ROPE = {
    "rope": "mode",
    "rope_dims": "dims",
    "rope_side": "side",
    "rope_pairing": "pairing",
    "rope_theta": "theta",
}
_LEGACY_KEYS = set(_LEGACY_ROPE) | {
    "pooling",
    "gate_bias",
    "mixing_kernel",
    "grid_offsets",
    "gate_entropy_floor",
    "gate_entropy_weight",
}


# The fields that the one attention config of before (every kind's fields in one class) saved for every kind besides
# those every kind takes: a run saved then carries them whatever its kind, and its model ignored those its kind
# does not take.
_SINGLE_CONFIG_FIELDS = (
    "window",
    "stride",
    "local_window",
    "gate",
    "offset_maps",
    "kv",
    "compressed_norm",
    "entry_rope_position",
    "sink",
    "output_rope",
    "block",
    "mixing",
    "grid",
    "query",
    "selection",
)


def upgrade_attention(d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A flat attention mapping from before the option groups, rewritten into groups; returns ``(attention,
    training)`` where ``training`` holds the training-only keys that moved to the trainer (the gate-entropy floor:
    ``{"gate_entropy": {"floor": ..., "weight": ...}}``, empty when the config had none). A mapping in today's shape
    is returned unchanged."""
    d = dict(d)
    training: dict[str, Any] = {}
    legacy = isinstance(d.get("rope"), str) or isinstance(d.get("gate"), str) or isinstance(d.get("mixing"), str)
    if legacy or (_LEGACY_KEYS - {"rope"}) & set(d):
        rope = {new: d.pop(old) for old, new in _LEGACY_ROPE.items() if old in d}
        if rope:
            d["rope"] = rope
        pooling, kind, bias = d.pop("pooling", "gate"), d.pop("gate", "scalar"), d.pop("gate_bias", True)
        d["gate"] = None if pooling == "mean" else {"kind": kind, "bias": bias}
        mixing, kernel = d.pop("mixing", "none"), d.pop("mixing_kernel", None)
        d["mixing"] = None if mixing in (None, "none") else {"kernel": kernel}
        offsets = d.pop("grid_offsets", None)
        d["grid"] = None if offsets is None else {"offsets": offsets}
        floor, weight = d.pop("gate_entropy_floor", 0.0), d.pop("gate_entropy_weight", 0.0)
        training = {"gate_entropy": {"floor": floor, "weight": weight}} if floor or weight else {}
    return d, training


def saved_attention(d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An attention mapping that a run folder or weights folder saved (``config.yaml``, ``config.json``), in today's
    shape of its kind: ``upgrade_attention``, then the fields of the one config of before
    (``_SINGLE_CONFIG_FIELDS``) that the config of its kind does not take are dropped, whatever their values (a
    full-attention run saved then carries the compressor's fields, e.g. the ``local_window`` of its experiment,
    and its model ignored them). Returns ``(attention, training)`` as ``upgrade_attention`` does. A config built
    now (``from_dict``, ``ModelConfig(attention=...)``) refuses such a field instead."""
    d, training = upgrade_attention(d)
    if isinstance(d.get("kind"), str) and d["kind"] in REGISTRY:
        taken = field_names(config_class(d["kind"]))
        d = {k: v for k, v in d.items() if k in taken or k not in _SINGLE_CONFIG_FIELDS}
    return d, training


PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-0.6B: 596,049,920 parameters with full attention and tied embeddings
    "qwen3_0.6b": dict(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        mlp_dim=3072,
        rope_theta=1e6,
        max_seq_len=40960,
    ),
    "small": dict(
        vocab_size=4096,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        mlp_dim=768,
        rope_theta=1e4,
        max_seq_len=2048,
    ),
    "tiny": dict(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        rope_theta=1e4,
        max_seq_len=512,
    ),
}


# A layer's part in cross-layer KV sharing (``LayerSegment.kv``): its own KV only, a source that publishes its KV
# to the layers after it, or a consumer that reads the nearest source's beside its own sliding window.
KV_ROLES = ("own", "source", "shared")


@dataclass
class LayerSegment:
    """``count`` consecutive layers of a layer schedule (``ModelConfig.layers``) and their attention config (a
    mapping of the fields ``attention=`` takes, validated by its kind's config class; the model's ``attention``
    when the segment omits it). ``kv`` is the layers' part in cross-layer KV sharing (``KV_ROLES``): ``own`` (the
    default: no sharing), ``source`` (each layer publishes its KV: every token's keys and values, or its
    compressed entries) or ``shared`` (each layer reads the KV of the nearest ``source`` layer before it, beside
    its own sliding window)."""

    count: int
    attention: AttentionConfig
    kv: str = "own"

    def __post_init__(self) -> None:
        check_int("model.layers[].count", self.count)
        check_choice("model.layers[].kv", self.kv, KV_ROLES)
        if isinstance(self.attention, Mapping):
            self.attention = AttentionConfig.from_dict(self.attention)
        if not isinstance(self.attention, AttentionConfig):
            raise ConfigError(
                f"model.layers[].attention={self.attention!r} must be a mapping of attention fields or omitted "
                "(the model's attention)"
            )


@dataclass(frozen=True)
class KVSource:
    """The KV a consumer layer (``kv: shared``) reads, as ``ModelConfig.layer_config`` states it on that layer's
    config (``ModelConfig.kv_source``): the source's layer index ``layer``, ``stride``, the positions per published
    entry (its ratio: 1 for every token's key and value, a compressed source's stride), and ``origins``, the grid
    coordinate of real position 0 of each set of entries it publishes (its own grid first; with dual-offset
    compression its moved grid's after)."""

    layer: int
    stride: int
    origins: tuple[int, ...] = (0,)


@dataclass
class ModelConfig:
    """A Qwen3-style decoder: pre-norm RMSNorm, per-head Q/K RMSNorm, GQA, SwiGLU, RoPE, no biases.

    ``layers`` is the layer schedule: None (every layer uses ``attention``, the uniform stack) or a list of
    segments, ``[{count: 2, attention: {kind: sliding, sliding_window: 128}}, {count: 2}]``, layer by layer in
    order, whose counts add up to ``n_layers``; a segment without ``attention`` takes the model's. Each layer's
    backend gets ``layer_config(i)``: this config with the layer's attention and no schedule. A segment's ``kv``
    shares KV across layers (``LayerSegment``; docs/attention.md, "Cross-layer KV sharing"): ``kv_source`` is set
    only on the config ``layer_config`` gives a consumer layer (``KVSource``), never by hand.
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 128
    rope_theta: float = 1e4
    max_seq_len: int = 512
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    layers: Optional[list[LayerSegment]] = None
    kv_source: Optional[KVSource] = None

    def __post_init__(self) -> None:
        if self.kv_source is not None and (self.layers is not None or not isinstance(self.kv_source, KVSource)):
            raise ConfigError(
                f"model.kv_source={self.kv_source!r} is set by ModelConfig.layer_config on a consumer layer's config "
                "only: share KV with a layer schedule's kv (model.layers[k].kv: source / shared)"
            )
        if isinstance(self.attention, Mapping):
            self.attention = AttentionConfig.from_dict(self.attention)
        o = "model"
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "mlp_dim",
            "max_seq_len",
        ):
            check_int(f"{o}.{name}", getattr(self, name))
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs of dims)")
        source = "model.n_kv_heads" if self.attention.kv_heads is None else "attention.kv_heads"
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by {source}={self.kv_heads}; grouped-query "
                f"attention needs n_heads % kv_heads == 0: choose a divisor of {self.n_heads}"
            )
        self.n_kv_heads = self.kv_heads  # one count: the saved config.json states the KV heads the model has
        check_float(f"{o}.rope_theta", self.rope_theta, 0, low_open=True)
        check_float(f"{o}.norm_eps", self.norm_eps, 0, low_open=True)
        check_float(f"{o}.init_std", self.init_std, 0, low_open=True)
        check_bool(f"{o}.tie_embeddings", self.tie_embeddings)
        for group in self.attention.groups():
            group.check_model(n_layers=self.n_layers, kv_heads=self.kv_heads, head_dim=self.head_dim)
        if self.layers is not None:
            self.layers = self._schedule(self.layers)
            self._check_sharing()  # before the consumers' configs, which read their sources'
            for i in range(self.n_layers):
                self.layer_config(i)  # each layer's config checks itself (kv_heads, option groups against the model)

    def _schedule(self, layers: Any) -> list[LayerSegment]:
        """The segments of ``layers`` (mappings ``{count, attention}``, or ``LayerSegment``s), their counts adding
        up to ``n_layers``; a segment without ``attention`` gets the model's."""
        if isinstance(layers, (str, Mapping)) or not isinstance(layers, Iterable):
            raise ConfigError(
                f"model.layers={layers!r} must be null (every layer uses model.attention) or a list of "
                "{count, attention} segments"
            )
        segments = []
        for k, seg in enumerate(layers):
            if isinstance(seg, Mapping):
                reject_unknown(seg, field_names(LayerSegment), f"model.layers[{k}]")
                if "count" not in seg:
                    raise ConfigError(f"model.layers[{k}]={dict(seg)!r} needs a 'count' (how many layers it spans)")
                attention = seg.get("attention")
                kv = seg.get("kv", "own")
                check_choice(f"model.layers[{k}].kv", kv, KV_ROLES)
                seg = LayerSegment(seg["count"], self.attention if attention is None else attention, kv)
            elif not isinstance(seg, LayerSegment):
                raise ConfigError(f"model.layers[{k}]={seg!r} must be a mapping {{count, attention}}")
            segments.append(seg)
        total = sum(seg.count for seg in segments)
        if total != self.n_layers:
            counts = [seg.count for seg in segments]
            raise ConfigError(
                f"model.layers counts {counts} add up to {total} layers, not model.n_layers={self.n_layers}: make "
                "the segment counts add up to n_layers (or set model.layers=null for a uniform stack)"
            )
        return segments

    def _segment(self, layer_idx: int) -> LayerSegment:
        """The segment of the schedule that holds layer ``layer_idx`` (a schedule is set)."""
        if not 0 <= layer_idx < self.n_layers:
            raise IndexError(f"layer {layer_idx} is not one of the model's {self.n_layers} layers")
        for seg in self.layers:
            if layer_idx < seg.count:
                return seg
            layer_idx -= seg.count
        raise AssertionError("unreachable: the counts add up to n_layers")  # pragma: no cover

    def layer_attention(self, layer_idx: int) -> AttentionConfig:
        """The attention config of layer ``layer_idx``: its segment's, or ``attention`` without a schedule."""
        if self.layers is None:
            if not 0 <= layer_idx < self.n_layers:
                raise IndexError(f"layer {layer_idx} is not one of the model's {self.n_layers} layers")
            return self.attention
        return self._segment(layer_idx).attention

    def layer_kv(self, layer_idx: int) -> str:
        """Layer ``layer_idx``'s part in cross-layer KV sharing (``KV_ROLES``): its segment's ``kv``; ``own``
        without a schedule."""
        return "own" if self.layers is None else self._segment(layer_idx).kv

    def source_layer(self, layer_idx: int) -> Optional[int]:
        """The layer whose KV layer ``layer_idx`` reads: the nearest ``kv: source`` layer before a ``kv: shared``
        one (None for any other layer, and for a consumer with no source before it)."""
        if self.layer_kv(layer_idx) != "shared":
            return None
        return next((j for j in range(layer_idx - 1, -1, -1) if self.layer_kv(j) == "source"), None)

    def layer_config(self, layer_idx: int) -> ModelConfig:
        """The config layer ``layer_idx``'s backend is built from: this config itself without a schedule, else a
        copy holding the layer's attention as ``attention`` and no schedule (``n_layers`` and the other sizes the
        model's, so that per-layer options such as grid offsets see the model's depth); a consumer layer's
        (``kv: shared``) also states the KV it reads (``kv_source``: its source's layer, stride and grid origins,
        as the source's backend publishes them, ``shared_kv``)."""
        if self.layers is None:
            return self
        layer = dataclasses.replace(self, attention=self.layer_attention(layer_idx), layers=None)
        j = self.source_layer(layer_idx)
        if j is None:
            return layer
        source = self.layer_config(j)
        stride, origins = REGISTRY[source.attention.kind].shared_kv(source, j)
        return dataclasses.replace(layer, kv_source=KVSource(j, stride, origins))

    def _check_sharing(self) -> None:
        """Cross-layer KV sharing, segment by segment: a source's kind publishes its KV (its backend's
        ``shared_kv``), a consumer's kind reads shared KV (``reads_shared_kv``), has a source before it and agrees
        with it on KV heads and RoPE (the head size is the model's, ``head_dim``: no layer can differ in it)."""
        first = 0
        for k, seg in enumerate(self.layers):
            where, kind = f"model.layers[{k}].kv={seg.kv!r}", seg.attention.kind
            if seg.kv == "source":
                layer = self.layer_config(first)
                try:
                    REGISTRY[kind].shared_kv(layer, first)
                except ConfigError as e:
                    raise ConfigError(f"{where}: {e}") from None
            if seg.kv == "shared":
                readers = sorted(name for name, backend in REGISTRY.items() if backend.reads_shared_kv)
                if not REGISTRY[kind].reads_shared_kv:
                    raise ConfigError(
                        f"{where}: a consumer attends its source's KV beside its own sliding window, so its "
                        f"attention.kind must be one that does ({readers}), not {kind!r}"
                    )
                j = self.source_layer(first)
                if j is None:
                    raise ConfigError(
                        f"{where}: layer {first} reads the KV of the nearest layer before it with kv='source', and "
                        "no layer before it has one: put a kv: source segment before it (or set kv: own)"
                    )
                self._check_group(where, first, j)
            first += seg.count

    def _check_group(self, where: str, consumer: int, source: int) -> None:
        """A consumer layer and its source agree on what their keys share: KV heads and RoPE."""
        a, b = self.layer_config(consumer), self.layer_config(source)
        differ = [f"attention.kv_heads ({a.kv_heads} vs the source's {b.kv_heads})"] if a.kv_heads != b.kv_heads else []
        ra, rb = a.attention.rope, b.attention.rope
        differ += [
            f"attention.rope.{name} ({getattr(ra, name)!r} vs the source's {getattr(rb, name)!r})"
            for name in field_names(type(ra))
            if getattr(ra, name) != getattr(rb, name)
        ]
        if differ:
            raise ConfigError(
                f"{where}: layer {consumer} reads the KV of layer {source} but disagrees with it on "
                f"{', '.join(differ)}: a sharing group's layers must agree on KV heads and RoPE (the head size is "
                "the model's, model.head_dim)"
            )

    def describe_attention(self) -> dict[str, Any]:
        """What results and plots say about the model's attention: ``attention.describe()`` for a uniform stack;
        under a layer schedule ``kind`` is the schedule in short (``1x sliding + 3x compressed``), ``window``,
        ``stride`` and ``pooling`` the values its layers share (None where they differ or no layer has one) and
        ``layers`` each segment's ``count`` and ``describe()``."""
        if self.layers is None:
            return self.attention.describe()
        segments = [
            {"count": seg.count, **seg.attention.describe(), **({} if seg.kv == "own" else {"kv": seg.kv})}
            for seg in self.layers
        ]
        shared = {}
        for key in ("window", "stride", "pooling"):
            values = {seg[key] for seg in segments} - {None}
            shared[key] = values.pop() if len(values) == 1 else None
        return {"kind": self.layer_kinds, **shared, "layers": segments}

    @property
    def layer_kinds(self) -> str:
        """The layers' attention kinds in short, segment by segment: ``1x sliding + 3x compressed`` (a uniform
        stack: ``4x compressed``; a segment that shares KV says how: ``1x compressed kv=source + 2x sliding
        kv=shared``)."""
        segments = [LayerSegment(self.n_layers, self.attention)] if self.layers is None else self.layers
        return " + ".join(
            f"{seg.count}x {seg.attention.kind}" + ("" if seg.kv == "own" else f" kv={seg.kv}") for seg in segments
        )

    def with_impl(self, impl: str) -> ModelConfig:
        """This config run by ``impl`` (e.g. ``reference``, the oracle) in every layer whose kind runs it (its
        backend's ``impls``); under a layer schedule a layer whose kind does not (a sliding layer under
        ``reference``) keeps its own, unless no layer's kind runs it (then the backend's one-line error names it)."""
        kinds = {self.layer_attention(i).kind for i in range(self.n_layers)}
        runs = {k for k in kinds if impl in getattr(REGISTRY.get(k), "impls", ())}
        return self.map_attention(lambda a: dataclasses.replace(a, impl=impl) if a.kind in runs or not runs else a)

    def map_attention(self, change: Callable[[AttentionConfig], AttentionConfig]) -> ModelConfig:
        """This config with ``change`` applied to every attention config it holds: the model's and, under a layer
        schedule, each segment's (e.g. an ``impl`` override, or dual-offset compression on every compressed
        layer); the result is validated again."""
        layers = None
        if self.layers is not None:
            layers = [LayerSegment(s.count, change(s.attention), s.kv) for s in self.layers]
        return dataclasses.replace(self, attention=change(self.attention), layers=layers)

    @property
    def kv_heads(self) -> int:
        """The number of KV heads: ``attention.kv_heads`` when the attention sets it, else ``n_kv_heads`` (which
        ``__post_init__`` then sets to it, so that both fields state the count the model has)."""
        return self.attention.kv_heads if self.attention.kv_heads is not None else self.n_kv_heads

    def grid_offsets(self, layer_idx: int) -> list[int]:
        """The grid offsets of layer ``layer_idx`` (0..stride-1): one for the whole layer (``[0]`` without
        ``attention.grid``), or one per KV head (``attention.grid.per: kv_head``); the layer's own attention under
        a schedule."""
        layer = self.layer_config(layer_idx)
        grid = layer.attention.option("grid")
        if grid is None:
            return [0]
        return grid.offsets_of(layer_idx, self.n_layers, layer.kv_heads, layer.attention.stride)

    def grid_offset(self, layer_idx: int) -> int:
        """The one grid offset of layer ``layer_idx``; ValueError when its KV heads have grids of their own."""
        offsets = self.grid_offsets(layer_idx)
        if len(offsets) != 1:
            raise ValueError(f"layer {layer_idx} has one grid per KV head ({offsets}): use grid_offsets")
        return offsets[0]

    @property
    def rope_dims(self) -> int:
        """How many dims of each head rotate."""
        return self.attention.rope.rotated_dims(self.head_dim)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A preset (``qwen3_0.6b``, ``small``, ``tiny``) with fields overridden; ``attention`` may be a dict."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        reject_unknown(overrides, field_names(cls), "ModelConfig")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain values; ``layers`` is written only with a schedule, so that a uniform model's
        ``config.json`` is the one written before schedules existed, and a segment's ``kv`` only when it shares KV
        (``kv_source`` only on a consumer layer's config)."""
        d = dataclasses.asdict(self)
        for name in ("layers", "kv_source"):
            if d[name] is None:
                del d[name]
        for seg in d.get("layers") or []:
            if seg["kv"] == "own":
                del seg["kv"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From ``to_dict``'s mapping or a weights folder's saved ``config.json`` (its attention, and each
        segment's, through ``saved_attention``); one without ``layers`` (every config written before schedules)
        is a uniform stack."""
        d = dict(d)
        reject_unknown(d, field_names(cls), "ModelConfig")
        attention = AttentionConfig.from_dict(saved_attention(d.pop("attention", {}) or {})[0])
        layers = d.pop("layers", None)
        if isinstance(layers, list):
            layers = [
                {**seg, "attention": saved_attention(seg["attention"])[0]}
                if isinstance(seg, Mapping) and isinstance(seg.get("attention"), Mapping)
                else seg
                for seg in layers
            ]
        return cls(**d, attention=attention, layers=layers)


@dataclass
class ModelSpec:
    """Which model to build: a preset (``PRESETS``) plus ``ModelConfig`` field overrides, as a run's config names it.

    ``vocab_size="auto"`` takes the data's vocabulary (the tokenizer's size, or the lookup layout's). The
    attention fields come from a separate ``attention`` mapping (the run config's attention group). The preset
    and the override names are checked on construction; ``build`` checks the values.
    """

    preset: str = "tiny"
    vocab_size: Union[int, str] = "auto"
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, str):
            if self.vocab_size != "auto":
                raise ConfigError(f"model.vocab_size={self.vocab_size!r} must be an integer or 'auto'")
        else:
            check_int("model.vocab_size", self.vocab_size, 1)
        if self.preset not in PRESETS:
            raise ConfigError(f"model.preset={self.preset!r} is not a preset; choose one of {sorted(PRESETS)}")
        if "attention" in self.overrides:
            raise ConfigError("set attention fields in the attention group, not under model")
        settable = set(field_names(ModelConfig)) - {"attention", "vocab_size", "kv_source"}
        reject_unknown(self.overrides, settable, "model")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSpec:
        """``{"preset": ..., "vocab_size": ..., <any other ModelConfig field>: ...}`` (flat, as in conf/model)."""
        d = dict(d)
        if "preset" not in d:
            raise ConfigError(f"model needs a 'preset' (one of {sorted(PRESETS)}); got keys {sorted(d)}")
        preset, vocab = d.pop("preset"), d.pop("vocab_size", "auto")
        return cls(preset=preset, vocab_size=vocab, overrides=d)

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "vocab_size": self.vocab_size, **self.overrides}

    def build(self, attention: Mapping[str, Any], data_vocab_size: int) -> ModelConfig:
        """The validated ``ModelConfig``; ``data_vocab_size`` fills ``vocab_size="auto"`` and bounds a fixed one."""
        vocab = data_vocab_size if self.vocab_size == "auto" else self.vocab_size
        if vocab < data_vocab_size:
            raise ConfigError(f"model.vocab_size={vocab} is smaller than the data's vocabulary ({data_vocab_size} ids)")
        return ModelConfig.from_preset(self.preset, vocab_size=vocab, attention=dict(attention), **self.overrides)
