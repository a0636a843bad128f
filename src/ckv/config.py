"""Validated model and attention configuration (plain dataclasses: library code never sees Hydra objects)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
from ckv.geometry import ENTRY_ROPE_POSITIONS
from ckv.options import GateConfig, GridConfig, MixingConfig, OptionGroup, QueryConfig, RopeConfig, SelectionConfig

# ``kind`` and ``impl`` are not here: the attention registry (ckv.attention) owns them, since the backends
# registered there decide which kinds exist, which implementations each one runs and which option groups it takes.
_CHOICES: dict[str, tuple[Any, ...]] = {
    "offset_maps": ("specific", "shared", "series"),
    "kv": ("separate", "tied"),
    "compressed_norm": ("pre", "post"),
    "entry_rope_position": ENTRY_ROPE_POSITIONS,
    "output_rope": ("keep", "inverse"),
}


@dataclass
class AttentionConfig:
    """Which attention backend a model uses, its core compressor fields and its option groups.

    ``window`` and ``stride`` follow docs/attention.md: entry ``j`` pools positions
    ``[(j+1)*stride - window, (j+1)*stride - 1]``. ``local_window`` is the number of exact recent tokens a query
    keeps (including itself) or ``"tail"`` (the tokens of the current unfinished stride block).
    ``kv_heads=None`` takes the model's ``n_kv_heads``. ``kind`` names a backend registered in ``ckv.attention``
    and ``impl`` one of that backend's implementations; the registry checks both, and which option groups the
    backend takes, when the model is built (``ckv.attention.check_attention``).

    Option groups (``GROUPS``; ``ckv.options``), each a nested mapping in YAML and null when off: ``rope``
    (always set), ``gate`` (null: uniform averaging), ``mixing`` (token mixing before pooling), ``grid``
    (phase-staggered grids), ``query`` (DeepSeek-V4's low-rank query path), ``selection`` (top-k selection of
    entries by DeepSeek-V4's lightning indexer; null: every visible entry). DeepSeek-V4's flags: ``sink`` (one
    learned attention-sink logit per query head) and ``output_rope='inverse'`` (the output rotated back by the
    query's position; needs tied K/V). ``block``: queries per block of the compressed fast path (``impl=torch``,
    ``ckv.attention.blocked``); null picks it from a memory budget (``blocked.choose_block``). It changes no
    result beyond summation order.
    """

    GROUPS: ClassVar[dict[str, type[OptionGroup]]] = {
        "rope": RopeConfig,
        "gate": GateConfig,
        "mixing": MixingConfig,
        "grid": GridConfig,
        "query": QueryConfig,
        "selection": SelectionConfig,
    }

    kind: str = "full"
    impl: str = "auto"
    qk_norm: bool = True
    kv_heads: Optional[int] = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    # the compressor
    window: int = 8
    stride: int = 8
    local_window: Union[int, str] = 16
    gate: Optional[GateConfig] = field(default_factory=GateConfig)
    offset_maps: str = "specific"  # offset-specific maps, shared maps + offset bias, or per-series maps (V4)
    kv: str = "separate"  # separate K and V branches, or V reuses the normalised, rotated keys
    compressed_norm: str = "pre"  # RMSNorm of compressed keys before pooling (per token) or after (post-norm)
    entry_rope_position: str = "block_start"
    sink: bool = False
    output_rope: str = "keep"
    block: Optional[int] = None
    mixing: Optional[MixingConfig] = None
    grid: Optional[GridConfig] = None
    query: Optional[QueryConfig] = None
    selection: Optional[SelectionConfig] = None

    def __post_init__(self) -> None:
        o = "attention"
        for name in ("kind", "impl"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{o}.{name}={getattr(self, name)!r} must be a non-empty string")
        for name, cls in self.GROUPS.items():
            setattr(self, name, _group(cls, getattr(self, name), required=name == "rope"))
        for name, allowed in _CHOICES.items():
            check_choice(f"{o}.{name}", getattr(self, name), allowed)
        for name in ("qk_norm", "sink"):
            check_bool(f"{o}.{name}", getattr(self, name))
        check_int(f"{o}.stride", self.stride)
        check_int(f"{o}.window", self.window)
        if self.window < self.stride:
            raise ConfigError(f"{o}.window={self.window} must be >= attention.stride={self.stride}")
        if self.kv_heads is not None:
            check_int(f"{o}.kv_heads", self.kv_heads)
        if self.block is not None:
            check_int(f"{o}.block", self.block)
        lw = self.local_window
        if (
            isinstance(lw, str)
            and lw != "tail"
            or not isinstance(lw, (int, str))
            or isinstance(lw, bool)
            or (isinstance(lw, int) and lw < 0)
        ):
            raise ConfigError(f"{o}.local_window={lw!r} must be an integer >= 0 or 'tail'")
        if self.offset_maps == "series" and self.window % self.stride:
            raise ConfigError(
                f"{o}.offset_maps='series' shares maps within each stride block of the window, so "
                f"attention.window={self.window} must be a multiple of attention.stride={self.stride}"
            )
        if self.output_rope == "inverse" and self.kv != "tied":
            raise ConfigError(
                f"{o}.output_rope='inverse' undoes the RoPE that tied values carry; it needs "
                f"attention.kv='tied' (got {self.kv!r})"
            )
        for group in self.groups():
            group.check_with(self)

    def groups(self) -> list[OptionGroup]:
        """The option groups that are set (``rope`` always), in ``GROUPS`` order."""
        return [g for g in (getattr(self, name) for name in self.GROUPS) if g is not None]

    def set_options(self) -> list[str]:
        """Names of the options in use that not every backend takes: the optional groups (off by default:
        ``mixing``, ``grid``, ``query``, ``selection``) that are set, and the DeepSeek-V4 flags that are on
        (``sink``, ``output_rope``). ``rope`` is every attention's; ``gate`` is a core compressor field like
        ``window``, unused without one."""
        groups = [name for name in _OPTIONAL_GROUPS if getattr(self, name) is not None]
        return groups + ["sink"] * self.sink + ["output_rope"] * (self.output_rope != "keep")

    @property
    def compressed(self) -> bool:
        return self.kind == "compressed"

    @property
    def tied_kv(self) -> bool:
        return self.kind == "compressed" and self.kv == "tied"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AttentionConfig:
        """From a mapping (a run's ``attention`` section or a weights ``config.json``'s); configs written before
        the option groups existed (flat ``rope_dims``, ``pooling``, ``mixing_kernel``, ...) are upgraded."""
        d = upgrade_attention(d)[0]
        reject_unknown(d, field_names(cls), "attention")
        return cls(**d)


_OPTIONAL_GROUPS = [
    f.name for f in dataclasses.fields(AttentionConfig) if f.name in AttentionConfig.GROUPS and f.default is None
]


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


def upgrade_attention(d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A flat attention mapping from before the option groups, rewritten into groups; returns ``(attention,
    training)`` where ``training`` holds the training-only keys that moved to the trainer (the gate-entropy
    floor: ``{"gate_entropy": {"floor": ..., "weight": ...}}``, empty when the config had none). A mapping in
    today's shape is returned unchanged."""
    d = dict(d)
    legacy = isinstance(d.get("rope"), str) or isinstance(d.get("gate"), str) or isinstance(d.get("mixing"), str)
    if not legacy and not (_LEGACY_KEYS - {"rope"}) & set(d):
        return d, {}
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


@dataclass
class ModelConfig:
    """A Qwen3-style decoder: pre-norm RMSNorm, per-head Q/K RMSNorm, GQA, SwiGLU, RoPE, no biases."""

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

    def __post_init__(self) -> None:
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
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by the number of KV heads ({self.kv_heads}); "
                "grouped-query attention needs n_heads % kv_heads == 0"
            )
        check_float(f"{o}.rope_theta", self.rope_theta, 0, low_open=True)
        check_float(f"{o}.norm_eps", self.norm_eps, 0, low_open=True)
        check_float(f"{o}.init_std", self.init_std, 0, low_open=True)
        check_bool(f"{o}.tie_embeddings", self.tie_embeddings)
        for group in self.attention.groups():
            group.check_model(self)

    @property
    def kv_heads(self) -> int:
        """Effective number of KV heads (the attention config may override the model's)."""
        return self.attention.kv_heads if self.attention.kv_heads is not None else self.n_kv_heads

    def grid_offsets(self, layer_idx: int) -> list[int]:
        """The grid offsets of layer ``layer_idx`` (0..stride-1): one for the whole layer (``[0]`` without
        ``attention.grid``), or one per KV head (``attention.grid.per: kv_head``)."""
        grid = self.attention.grid
        if grid is None:
            return [0]
        return grid.offsets_of(layer_idx, self.n_layers, self.kv_heads, self.attention.stride)

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
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        reject_unknown(d, field_names(cls), "ModelConfig")
        attention = AttentionConfig.from_dict(d.pop("attention", {}) or {})
        return cls(**d, attention=attention)


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
        reject_unknown(self.overrides, set(field_names(ModelConfig)) - {"attention", "vocab_size"}, "model")

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
