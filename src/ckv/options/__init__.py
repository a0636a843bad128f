"""Attention option groups: nested, optional sub-configs of the attention kinds' configs, one module each.

Each group validates itself (against plain values: the compressor's stride, the model's layer and head counts)
and declares its parameter, FLOP and decode-cache contributions beside its definition
(``ckv.options.base.OptionGroup``); each kind's config lists the groups it takes by key (``GROUPS``: full
attention ``rope``, compressed attention all of them), and its backend sums their contributions.
docs/extending.md has the checklist for a new group or option.
"""

from ckv.options.base import Dims, OptionGroup
from ckv.options.gate import GateConfig
from ckv.options.grid import GridConfig
from ckv.options.mixing import MixingConfig
from ckv.options.query import QueryConfig
from ckv.options.rope import RopeConfig, YarnConfig
from ckv.options.selection import SelectionConfig

__all__ = [
    "Dims",
    "GateConfig",
    "GridConfig",
    "MixingConfig",
    "OptionGroup",
    "QueryConfig",
    "RopeConfig",
    "SelectionConfig",
    "YarnConfig",
]
