"""Phase-staggered grids (``attention.grid``; null: every layer's windows start at position 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from ckv.checks import ConfigError, check_choice, check_int
from ckv.options.base import OptionGroup


@dataclass
class GridConfig(OptionGroup):
    """Shift window grids. ``per: layer``: ``offsets`` is one offset per layer (0..stride-1; entry ``j`` then
    covers ``[(j+1)S - W + o, (j+1)S - 1 + o]``) or ``"stagger"`` (layer ``l`` gets ``(l * stride) // n_layers``).
    ``per: kv_head``: every layer gives each KV head its own grid, ``offsets`` one per KV head or ``"stagger"``
    (head ``h`` gets ``(h * stride) // kv_heads``), so the heads' windows break at different phases. A shifted
    grid computes in grid coordinates (``ckv.geometry``); no parameters; FLOPs and cache per grid."""

    name: ClassVar[str] = "grid"
    offsets: Union[list[int], str] = "stagger"
    per: str = "layer"

    def __post_init__(self) -> None:
        o = "attention.grid.offsets"
        check_choice("attention.grid.per", self.per, ("layer", "kv_head"))
        if isinstance(self.offsets, str):
            check_choice(o, self.offsets, ("stagger",))
            return
        if not isinstance(self.offsets, (list, tuple)):
            raise ConfigError(f"{o}={self.offsets!r} must be 'stagger' or a list of ints (one per {self.per})")
        self.offsets = list(self.offsets)
        for i, value in enumerate(self.offsets):
            check_int(f"{o}[{i}]", value, minimum=0)

    def check_stride(self, stride: int) -> None:
        if isinstance(self.offsets, list):
            for i, value in enumerate(self.offsets):
                if value >= stride:
                    raise ConfigError(f"attention.grid.offsets[{i}]={value} must be < attention.stride={stride}")

    def check_model(self, n_layers: int, kv_heads: int, head_dim: int) -> None:
        count, name = (n_layers, "model.n_layers") if self.per == "layer" else (kv_heads, "KV heads")
        if isinstance(self.offsets, list) and len(self.offsets) != count:
            raise ConfigError(
                f"attention.grid.offsets has {len(self.offsets)} entries; it needs one per {self.per} ({name}={count})"
            )

    def offsets_of(self, layer_idx: int, n_layers: int, kv_heads: int, stride: int) -> list[int]:
        """The grid offsets (0..stride-1) of layer ``layer_idx``: one, shared by its KV heads (``per: layer``), or
        one per KV head (``per: kv_head``)."""
        count, i = (n_layers, layer_idx) if self.per == "layer" else (kv_heads, None)
        offsets = [(k * stride) // count for k in range(count)] if self.offsets == "stagger" else self.offsets
        return [int(offsets[i])] if i is not None else [int(o) for o in offsets]
