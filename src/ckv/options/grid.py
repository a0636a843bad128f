"""Phase-staggered grids (``attention.grid``; null: every layer's windows start at position 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Union

from ckv.checks import ConfigError, check_choice, check_int
from ckv.options.base import OptionGroup

if TYPE_CHECKING:
    from ckv.config import AttentionConfig, ModelConfig


@dataclass
class GridConfig(OptionGroup):
    """Shift each layer's window grid: ``offsets`` is one offset per layer (0..stride-1; entry ``j`` then covers
    ``[(j+1)S - W + o, (j+1)S - 1 + o]``) or ``"stagger"`` (layer ``l`` gets ``(l * stride) // n_layers``).
    A shifted layer computes in grid coordinates (``ckv.geometry``); no parameters, and per layer the FLOPs of
    its own entries and visible pairs."""

    name: ClassVar[str] = "grid"
    offsets: Union[list[int], str] = "stagger"

    def __post_init__(self) -> None:
        o = "attention.grid.offsets"
        if isinstance(self.offsets, str):
            check_choice(o, self.offsets, ("stagger",))
            return
        if not isinstance(self.offsets, (list, tuple)):
            raise ConfigError(f"{o}={self.offsets!r} must be 'stagger' or a list of ints (one per layer)")
        self.offsets = list(self.offsets)
        for i, value in enumerate(self.offsets):
            check_int(f"{o}[{i}]", value, minimum=0)

    def check_with(self, attention: AttentionConfig) -> None:
        if isinstance(self.offsets, list):
            for i, value in enumerate(self.offsets):
                if value >= attention.stride:
                    raise ConfigError(
                        f"attention.grid.offsets[{i}]={value} must be < attention.stride={attention.stride}"
                    )

    def check_model(self, config: ModelConfig) -> None:
        if isinstance(self.offsets, list) and len(self.offsets) != config.n_layers:
            raise ConfigError(
                f"attention.grid.offsets has {len(self.offsets)} entries; it needs one per layer "
                f"(model.n_layers={config.n_layers})"
            )

    def offset(self, layer_idx: int, n_layers: int, stride: int) -> int:
        """The grid offset of layer ``layer_idx`` (0..stride-1)."""
        if self.offsets == "stagger":
            return (layer_idx * stride) // n_layers
        return int(self.offsets[layer_idx])
