"""RoPE of queries and keys (``attention.rope``): which dims rotate, where they sit, how they pair, the theta."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Optional

from ckv.checks import ConfigError, check_choice, check_float, check_int, field_names, reject_unknown
from ckv.options.base import OptionGroup

MODES = ("full", "partial", "none")
SIDES = ("leading", "trailing")
PAIRINGS = ("half", "interleaved")


@dataclass
class YarnConfig:
    """YaRN frequency scaling (``attention.rope.yarn``), as DeepSeek-V4's compressed layers use it: each rotated
    pair's inverse frequency blends the original ``1 / theta^(2i/n)`` (fast-rotating pairs, extrapolated) with it
    divided by ``factor`` (slow pairs, interpolated), by a linear ramp between the pairs that turn ``beta_fast``
    and ``beta_slow`` times over ``original_max_positions`` (the ramp's ends floored and ceiled, transformers'
    ``_compute_yarn_parameters`` with ``truncate``). No attention scaling: V4 sets YaRN's ``attention_factor`` to 1."""

    factor: float = 16.0
    original_max_positions: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        o = "attention.rope.yarn"
        check_float(f"{o}.factor", self.factor, 1)
        check_int(f"{o}.original_max_positions", self.original_max_positions, minimum=1)
        check_float(f"{o}.beta_fast", self.beta_fast, 0, low_open=True)
        check_float(f"{o}.beta_slow", self.beta_slow, 0, low_open=True)
        if self.beta_fast < self.beta_slow:
            raise ConfigError(f"{o}.beta_fast={self.beta_fast} must be >= {o}.beta_slow={self.beta_slow}")


@dataclass
class RopeConfig(OptionGroup):
    """Rotary position embedding. ``mode``: every dim of a head rotates (``full``), ``dims`` of them
    (``partial``), or none. ``side``: the rotated dims lead or trail the head (DeepSeek-V4: trailing);
    ``pairing``: ``half`` rotates dim i with i + n/2 (Qwen3), ``interleaved`` rotates pairs (2i, 2i+1) (DeepSeek-V4).
    ``theta``: this attention's own base (DeepSeek-V4's compress_rope_theta); null takes ``model.rope_theta``.
    ``yarn``: YaRN frequency scaling (``YarnConfig``; null: none). Compressed keys rotate at their entry's position
    (``attention.entry_rope_position``). No parameters."""

    name: ClassVar[str] = "rope"
    mode: str = "full"
    dims: Optional[int] = None
    side: str = "leading"
    pairing: str = "half"
    theta: Optional[float] = None
    yarn: Optional[YarnConfig] = None  # a mapping of its fields in YAML

    def __post_init__(self) -> None:
        o = "attention.rope"
        if isinstance(self.yarn, Mapping):
            reject_unknown(self.yarn, field_names(YarnConfig), f"{o}.yarn")
            self.yarn = YarnConfig(**self.yarn)
        elif self.yarn is not None and not isinstance(self.yarn, YarnConfig):
            raise ConfigError(f"{o}.yarn={self.yarn!r} must be a mapping of {field_names(YarnConfig)} or null (off)")
        if self.yarn is not None and self.mode == "none":
            raise ConfigError(f"{o}.yarn scales rotated dims; {o}.mode='none' rotates none")
        check_choice(f"{o}.mode", self.mode, MODES)
        check_choice(f"{o}.side", self.side, SIDES)
        check_choice(f"{o}.pairing", self.pairing, PAIRINGS)
        if self.mode == "partial":
            if self.dims is None:
                raise ConfigError(f"{o}.mode='partial' needs {o}.dims (an even number of dims per head)")
        elif self.dims is not None:
            raise ConfigError(f"{o}.dims={self.dims} is only used with {o}.mode='partial' (got mode={self.mode!r})")
        if self.theta is not None:
            check_float(f"{o}.theta", self.theta, 0, low_open=True)

    def check_model(self, n_layers: int, kv_heads: int, head_dim: int) -> None:
        d = self.dims
        if self.mode == "partial" and (not isinstance(d, int) or isinstance(d, bool) or d < 2 or d % 2 or d > head_dim):
            raise ConfigError(f"attention.rope.dims={d!r} must be an even integer in [2, head_dim={head_dim}]")

    def rotated_dims(self, head_dim: int) -> int:
        """How many dims of a ``head_dim`` head rotate."""
        return {"full": head_dim, "partial": self.dims or 0, "none": 0}[self.mode]
