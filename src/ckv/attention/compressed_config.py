"""The config of compressed attention (``attention.kind: compressed``): the compressor's fields and every option
group, on top of the fields every kind takes (``ckv.config.AttentionConfig``). ``CompressedAttention`` names it
as its ``config_class``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from ckv.config import AttentionConfig, ConfigError, check_bool, check_choice, check_int
from ckv.geometry import ENTRY_ROPE_POSITIONS
from ckv.options import GateConfig, GridConfig, MixingConfig, OptionGroup, QueryConfig, RopeConfig, SelectionConfig

_CHOICES: dict[str, tuple[Any, ...]] = {
    "offset_maps": ("specific", "shared", "series"),
    "kv": ("separate", "tied"),
    "compressed_norm": ("pre", "post"),
    "entry_rope_position": ENTRY_ROPE_POSITIONS,
    "output_rope": ("keep", "inverse"),
}


@dataclass
class CompressedAttentionConfig(AttentionConfig):
    """Chunked KV compression with joint attention: the compressor's fields and its option groups.

    ``window`` and ``stride`` follow docs/attention.md: entry ``j`` pools positions
    ``[(j+1)*stride - window, (j+1)*stride - 1]``. ``local_window`` is the number of exact recent tokens a query
    keeps (including itself) or ``"tail"`` (the tokens of the current unfinished stride block).

    Option groups (``GROUPS``; ``ckv.options``), each a nested mapping in YAML and null when off: ``rope``
    (always set), ``gate`` (null: uniform averaging), ``mixing`` (token mixing before pooling), ``grid``
    (phase-staggered grids), ``query`` (DeepSeek-V4's low-rank query path), ``selection`` (top-k selection of
    entries by DeepSeek-V4's lightning indexer; null: every visible entry). DeepSeek-V4's flags: ``sink`` (one
    learned attention-sink logit per query head) and ``output_rope='inverse'`` (the output rotated back by the
    query's position; needs tied K/V). ``block``: queries per block of the compressed fast path (``impl=torch``,
    ``ckv.attention.blocked``); null picks it from a memory budget (``blocked.choose_block``). It changes no
    result beyond summation order. ``dual_offset`` (null: off): an inference-time mitigation, no parameters: each
    layer also pools its windows moved by this many positions (``0 < dual_offset < stride``; 0 adds nothing: the
    moved windows are the layer's own) with the same compressor, and every query attends to both sets of entries in
    its one joint softmax (docs/mitigation.md); not with ``selection`` (its indexer ranks one set of entries).
    """

    GROUPS: ClassVar[dict[str, type[OptionGroup]]] = {
        "rope": RopeConfig,
        "gate": GateConfig,
        "mixing": MixingConfig,
        "grid": GridConfig,
        "query": QueryConfig,
        "selection": SelectionConfig,
    }

    kind: str = "compressed"
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
    dual_offset: Optional[int] = None
    mixing: Optional[MixingConfig] = None
    grid: Optional[GridConfig] = None
    query: Optional[QueryConfig] = None
    selection: Optional[SelectionConfig] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        o = "attention"
        for name, allowed in _CHOICES.items():
            check_choice(f"{o}.{name}", getattr(self, name), allowed)
        check_bool(f"{o}.sink", self.sink)
        check_int(f"{o}.stride", self.stride)
        check_int(f"{o}.window", self.window)
        if self.window < self.stride:
            raise ConfigError(f"{o}.window={self.window} must be >= attention.stride={self.stride}")
        if self.block is not None:
            check_int(f"{o}.block", self.block)
        if self.dual_offset is not None:
            check_int(f"{o}.dual_offset", self.dual_offset, 0)
            if self.dual_offset >= self.stride:
                raise ConfigError(
                    f"{o}.dual_offset={self.dual_offset} must be < attention.stride={self.stride} (a multiple of the "
                    "stride moves the windows onto themselves)"
                )
            if self.selection is not None:
                raise ConfigError(
                    f"{o}.dual_offset: dual-offset compression attends every entry of the second set, but "
                    "attention.selection picks each query's top-k of one set: use one of the two"
                )
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
            group.check_stride(self.stride)
        if self.selection is not None:
            self.selection.check_rope(self.rope)

    @property
    def tied_kv(self) -> bool:
        return self.kv == "tied"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "window": self.window,
            "stride": self.stride,
            "pooling": "mean" if self.gate is None else "gate",
        }
