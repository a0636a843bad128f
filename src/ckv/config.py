"""Validated model and attention configuration (plain dataclasses: library code never sees Hydra objects)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from ckv.geometry import ENTRY_ROPE_POSITIONS

# ``kind`` and ``impl`` are not here: the attention registry (ckv.attention) owns them, since the backends
# registered there decide which kinds exist and which implementations each one runs.
_CHOICES: dict[str, tuple[Any, ...]] = {
    "pooling": ("gate", "mean"),
    "gate": ("scalar", "vector"),
    "offset_maps": ("specific", "shared", "series"),
    "kv": ("separate", "tied"),
    "compressed_norm": ("pre", "post"),
    "rope": ("full", "partial", "none"),
    "entry_rope_position": ENTRY_ROPE_POSITIONS,
}
# DeepSeek-V4's options (docs/attention.md, "DeepSeek-V4"): where RoPE sits in a head and how it pairs dims, and
# whether the output's RoPE is undone (tied values carry the keys' rotation)
_V4_CHOICES: dict[str, tuple[Any, ...]] = {
    "rope_side": ("leading", "trailing"),
    "rope_pairing": ("half", "interleaved"),
    "output_rope": ("keep", "inverse"),
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


def check_choice(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not allowed; choose one of {list(allowed)}")


def check_bool(field: str, value: Any) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is a bool (YAML ``true``/``false``, not 0/1 or a string)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{field}={value!r} must be true or false")


def check_int(field: str, value: Any, minimum: int = 1) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is an integer (not a bool) >= ``minimum``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{field}={value!r} must be an integer >= {minimum}")


def check_float(
    field: str,
    value: Any,
    low: Optional[float] = None,
    high: Optional[float] = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is a finite real number (an int or float, not a bool or
    a string) within the bounds: ``low``/``high`` are inclusive unless ``low_open``/``high_open``."""
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high}")
    wanted = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
    ):
        raise ConfigError(f"{field}={value!r} must be {wanted}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise ConfigError(f"{field}={value!r} must be {wanted}")


def reject_unknown(d: Mapping[str, Any], allowed: Iterable[str], owner: str) -> None:
    """Raise ConfigError listing the keys of ``d`` that are not in ``allowed`` (``owner`` names the section)."""
    allowed = set(allowed)
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"unknown {owner} field(s) {sorted(unknown)}; valid fields: {sorted(allowed)}")


def field_names(cls: type) -> list[str]:
    """The field names of dataclass ``cls``."""
    return [f.name for f in dataclasses.fields(cls)]


@dataclass
class AttentionConfig:
    """Which attention backend a model uses and every knob of the chunked compressor.

    ``window`` and ``stride`` follow docs/attention.md: entry ``j`` pools positions
    ``[(j+1)*stride - window, (j+1)*stride - 1]``. ``local_window`` is the number of exact recent tokens a query
    keeps (including itself) or ``"tail"`` (the tokens of the current unfinished stride block).
    ``kv_heads=None`` takes the model's ``n_kv_heads``. ``kind`` names a backend registered in ``ckv.attention``
    and ``impl`` one of that backend's implementations; the registry checks both when the model is built (see
    ``ckv.attention.check_attention``), so a newly registered backend needs no change here.
    """

    kind: str = "full"
    impl: str = "auto"
    # RoPE and Q/K norm apply to both backends
    rope: str = "full"
    rope_dims: Optional[int] = None  # for rope="partial": how many leading dims of each head rotate
    qk_norm: bool = True
    kv_heads: Optional[int] = None
    # compressed backend
    window: int = 8
    stride: int = 8
    pooling: str = "gate"
    gate: str = "scalar"
    gate_bias: bool = True
    offset_maps: str = "specific"  # offset-specific maps, shared maps + offset bias, or per-series maps (V4)
    kv: str = "separate"  # separate K and V branches, or V reuses the normalised, rotated keys
    compressed_norm: str = "pre"  # RMSNorm of compressed keys before pooling (per token) or after (post-norm)
    entry_rope_position: str = "block_start"
    local_window: Union[int, str] = 16
    # DeepSeek-V4 (all off by default): RoPE layout and this layer's own theta (None = model.rope_theta), one
    # learned attention-sink logit per query head, and the output rotated back by the query's position
    rope_side: str = "leading"
    rope_pairing: str = "half"
    rope_theta: Optional[float] = None
    sink: bool = False
    output_rope: str = "keep"
    # token mixing before pooling (docs/robustness.md): "conv" adds a causal depthwise convolution over each
    # compressor branch's input, mixing_kernel (2..stride) taps over the current and previous tokens
    mixing: str = "none"
    mixing_kernel: Optional[int] = None
    # phase-staggered grids (docs/robustness.md, docs/attention.md "Staggered grids"): None (no shift), one offset
    # per layer (0..stride-1; entry j then covers [(j+1)S - W + o, (j+1)S - 1 + o]), or "stagger": layer l gets
    # (l * stride) // n_layers; the length of a list is checked against model.n_layers by ModelConfig
    grid_offsets: Optional[Union[list[int], str]] = None
    # gate-entropy floor (docs/training.md; training only, the model ignores both): the trainer adds
    # gate_entropy_weight * mean relu(gate_entropy_floor * log(n) - H(alpha)) over every learned gate, n the
    # window's present offsets; the floor is a fraction of the largest entropy log(n), 0 turns it off
    gate_entropy_floor: float = 0.0
    gate_entropy_weight: float = 0.0

    def __post_init__(self) -> None:
        o = "attention"
        for name in ("kind", "impl"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{o}.{name}={getattr(self, name)!r} must be a non-empty string")
        for name in ("rope", "pooling", "gate", "offset_maps", "kv", "compressed_norm", "entry_rope_position"):
            check_choice(f"{o}.{name}", getattr(self, name), _CHOICES[name])
        for name in ("qk_norm", "gate_bias"):
            check_bool(f"{o}.{name}", getattr(self, name))
        check_int(f"{o}.stride", self.stride)
        check_int(f"{o}.window", self.window)
        if self.window < self.stride:
            raise ConfigError(f"{o}.window={self.window} must be >= attention.stride={self.stride}")
        if self.kv_heads is not None:
            check_int(f"{o}.kv_heads", self.kv_heads)
        if isinstance(self.local_window, str):
            if self.local_window != "tail":
                raise ConfigError(f"{o}.local_window={self.local_window!r} must be an integer >= 0 or 'tail'")
        elif not isinstance(self.local_window, int) or isinstance(self.local_window, bool) or self.local_window < 0:
            raise ConfigError(f"{o}.local_window={self.local_window!r} must be an integer >= 0 or 'tail'")
        if self.rope == "partial":
            if self.rope_dims is None:
                raise ConfigError(f"{o}.rope='partial' needs attention.rope_dims (an even number of dims per head)")
        elif self.rope_dims is not None:
            raise ConfigError(
                f"{o}.rope_dims={self.rope_dims} is only used with attention.rope='partial' (got rope={self.rope!r})"
            )
        self._check_v4_options()
        self._check_mixing()
        self._check_gate_entropy()
        self._check_grid_offsets()

    def _check_gate_entropy(self) -> None:
        o = "attention"
        floor, weight = self.gate_entropy_floor, self.gate_entropy_weight
        check_float(f"{o}.gate_entropy_floor", floor, 0, 1, high_open=True)
        check_float(f"{o}.gate_entropy_weight", weight, 0)
        if floor > 0 and (self.kind != "compressed" or self.pooling != "gate"):
            raise ConfigError(
                f"{o}.gate_entropy_floor={floor} keeps a learned gate spread: it needs kind='compressed' "
                f"and pooling='gate' (got kind={self.kind!r}, pooling={self.pooling!r})"
            )
        if floor > 0 and self.window < 2:
            raise ConfigError(
                f"{o}.gate_entropy_floor={floor} needs attention.window >= 2 (a 1-token window's gate "
                "has nothing to spread over)"
            )
        if weight > 0 and floor == 0:
            raise ConfigError(
                f"{o}.gate_entropy_weight={weight} weighs the gate-entropy penalty, which is off: set "
                "attention.gate_entropy_floor in (0, 1)"
            )

    def _check_grid_offsets(self) -> None:
        o, offsets = "attention", self.grid_offsets
        if offsets is None:
            return
        if self.kind != "compressed":
            raise ConfigError(f"{o}.grid_offsets is an option of kind='compressed' (got kind={self.kind!r})")
        if isinstance(offsets, str):
            check_choice(f"{o}.grid_offsets", offsets, ("stagger",))
            return
        if not isinstance(offsets, (list, tuple)):
            raise ConfigError(f"{o}.grid_offsets={offsets!r} must be null, 'stagger' or a list of ints (one per layer)")
        self.grid_offsets = list(offsets)
        for i, value in enumerate(self.grid_offsets):
            check_int(f"{o}.grid_offsets[{i}]", value, minimum=0)
            if value >= self.stride:
                raise ConfigError(f"{o}.grid_offsets[{i}]={value} must be < attention.stride={self.stride}")

    def _check_mixing(self) -> None:
        o = "attention"
        check_choice(f"{o}.mixing", self.mixing, ("none", "conv"))
        if self.mixing == "none":
            if self.mixing_kernel is not None:
                raise ConfigError(f"{o}.mixing_kernel={self.mixing_kernel} is only used with attention.mixing='conv'")
            return
        if self.kind != "compressed":
            raise ConfigError(f"{o}.mixing='conv' is an option of kind='compressed' (got kind={self.kind!r})")
        if self.mixing_kernel is None:
            raise ConfigError(f"{o}.mixing='conv' needs attention.mixing_kernel (2..stride={self.stride})")
        check_int(f"{o}.mixing_kernel", self.mixing_kernel, minimum=2)
        if self.mixing_kernel > self.stride:
            raise ConfigError(f"{o}.mixing_kernel={self.mixing_kernel} must be <= attention.stride={self.stride}")

    def _check_v4_options(self) -> None:
        o = "attention"
        for name, allowed in _V4_CHOICES.items():
            check_choice(f"{o}.{name}", getattr(self, name), allowed)
        check_bool(f"{o}.sink", self.sink)
        if self.rope_theta is not None and (
            isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0
        ):
            raise ConfigError(f"{o}.rope_theta={self.rope_theta!r} must be a number > 0 (or null: model.rope_theta)")
        if self.offset_maps == "series" and self.window % self.stride:
            raise ConfigError(
                f"{o}.offset_maps='series' shares maps within each stride block of the window, so "
                f"attention.window={self.window} must be a multiple of attention.stride={self.stride}"
            )
        if self.kind != "compressed" and (self.sink or self.output_rope != "keep"):
            raise ConfigError(f"{o}.sink and {o}.output_rope are options of kind='compressed' (got kind={self.kind!r})")
        if self.output_rope == "inverse" and self.kv != "tied":
            raise ConfigError(
                f"{o}.output_rope='inverse' undoes the RoPE that tied values carry; it needs "
                f"attention.kv='tied' (got {self.kv!r})"
            )

    @property
    def compressed(self) -> bool:
        return self.kind == "compressed"

    @property
    def tied_kv(self) -> bool:
        return self.kind == "compressed" and self.kv == "tied"


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
            reject_unknown(self.attention, field_names(AttentionConfig), "AttentionConfig")
            self.attention = AttentionConfig(**self.attention)
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
        a = self.attention
        if isinstance(a.grid_offsets, list) and len(a.grid_offsets) != self.n_layers:
            raise ConfigError(
                f"attention.grid_offsets has {len(a.grid_offsets)} entries; it needs one per layer "
                f"(model.n_layers={self.n_layers})"
            )
        if a.rope == "partial":
            if not isinstance(a.rope_dims, int) or a.rope_dims < 2 or a.rope_dims % 2 or a.rope_dims > self.head_dim:
                raise ConfigError(
                    f"attention.rope_dims={a.rope_dims!r} must be an even integer in [2, head_dim={self.head_dim}]"
                )

    @property
    def kv_heads(self) -> int:
        """Effective number of KV heads (the attention config may override the model's)."""
        return self.attention.kv_heads if self.attention.kv_heads is not None else self.n_kv_heads

    def grid_offset(self, layer_idx: int) -> int:
        """The grid offset of layer ``layer_idx`` (0..stride-1; 0 without ``attention.grid_offsets``)."""
        offsets = self.attention.grid_offsets
        if offsets is None:
            return 0
        if offsets == "stagger":
            return (layer_idx * self.attention.stride) // self.n_layers
        return int(offsets[layer_idx])

    @property
    def rope_dims(self) -> int:
        a = self.attention
        return {"full": self.head_dim, "partial": a.rope_dims or 0, "none": 0}[a.rope]

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
        att = d.pop("attention", {}) or {}
        reject_unknown(att, field_names(AttentionConfig), "AttentionConfig")
        return cls(**d, attention=AttentionConfig(**att))


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
