"""Rules shared by the attention tests."""

from __future__ import annotations

from typing import Optional

import torch

from ckv import ModelConfig
from ckv.attention import check_attention
from ckv.geometry import compressed_mask, grid_origin, influence_mask, local_mask, num_entries, window_positions


def expected_influence(
    cfg: ModelConfig, layer_idx: int, T: int, selected: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(T, T) bool: token p can act on query t in layer ``layer_idx`` (the geometry's rule, written here from
    ``ckv.geometry``'s masks): full attention p <= t; compressed attention a visible entry covering any of p's
    mixing successors ``p .. p + taps - 1``, or t's local window, in the grid coordinates of one of the layer's
    grids (one per KV head with ``grid.per: kv_head``: their union). With top-k selection, ``selected`` (T, K)
    holds the entries (grid indices, -1 empty) the layer selected for each query: only those carry their tokens."""
    if check_attention(cfg).phase_stride(cfg) is None:
        return torch.ones(T, T, dtype=torch.bool).tril()
    rule = torch.zeros(T, T, dtype=torch.bool)
    for o in cfg.grid_offsets(layer_idx):
        rule |= _grid_influence(cfg, o, T, selected)
    return rule


def _grid_influence(cfg: ModelConfig, o: int, T: int, selected: Optional[torch.Tensor]) -> torch.Tensor:
    """expected_influence for one grid, shifted by ``o``."""
    a = cfg.attention
    P = grid_origin(o, a.stride)
    if selected is None:
        via = influence_mask(T, a.window, a.stride, 0, grid_offset=o)  # local window 0: entries only
    else:
        e = num_entries(T + P, a.stride)
        pos, present = window_positions(0, e, a.window, a.stride, origin=P)  # (E, W) grid positions
        covers = torch.zeros(e, T + P, dtype=torch.bool)  # entry -> the grid positions it pools
        covers[torch.arange(e)[:, None].expand_as(pos)[present], pos[present]] = True
        chosen = torch.zeros(T, e + 1, dtype=torch.bool)  # column e: empty slots
        chosen.scatter_(1, torch.where(selected < 0, e, selected), True)
        chosen = chosen[:, :e] & compressed_mask(torch.arange(T) + P, e, a.stride)
        via = (chosen.float() @ covers.float() > 0)[:, P:]  # (T, T) real positions
    taps = 1 if a.mixing is None else a.mixing.taps(a.stride)
    widened = via.clone()
    for k in range(1, taps):  # mixing: p also reaches every entry that pools p + k
        widened[:, : T - k] |= via[:, k:]
    g = torch.arange(T) + P
    return widened | local_mask(g, g, a.local_window, a.stride, origin=P)
