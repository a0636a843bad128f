"""The compression geometry: the one place that says which positions an entry covers, when it becomes
visible, where its RoPE position is, which exact keys a query keeps, and what the phase of a position is.

Conventions (DeepSeek-V4's, see docs/attention.md):
- entry ``j`` covers positions ``[(j+1)*stride - window, (j+1)*stride - 1]``; positions below 0 are absent;
- entry ``j`` is visible to a query at position ``t`` iff ``(j+1)*stride - 1 <= t``;
- a sequence of ``T`` tokens has ``T // stride`` entries;
- the offset of a token inside entry ``j`` is ``p - ((j+1)*stride - window)`` in ``0..window-1``;
- the phase of position ``p`` is ``p % stride``; the boundary phase is ``stride - 1``;
- the exact local window of a query at ``t`` is ``[t - N + 1, t]`` (``N`` = local_window) or, in ``tail``
  mode, the tokens no visible entry covers yet: ``[((t+1) // stride) * stride, t]`` (empty when ``t`` closes a
  stride block).

Staggered grids (``attention.grid``): a layer whose grid is shifted by ``o`` (``0 <= o < stride``) has
entries covering ``[(j+1)S - W + o, (j+1)S - 1 + o]``, visible at ``t`` iff ``(j+1)S - 1 + o <= t``. It computes
in grid coordinates ``g = p + P``, ``P = grid_origin(o, stride) = (stride - o) % stride``: every rule above holds
unchanged in ``g``, with "present" meaning ``g >= P`` (real position >= 0) instead of ``g >= 0``; the functions
below that decide presence take that ``origin`` (default 0: no shift). Grid entry ``j`` is the shifted entry
``j - 1`` of the formula when ``o > 0`` (grid entry 0 covers ``[o - W, o - 1]``: positions ``0..o-1``).

Dual-offset compression (``attention.dual_offset``, an inference-time mitigation): a layer also attends, in the
same joint softmax, to the entries of its grid moved by ``offset`` more positions, whose origin is
``shifted_origin(P, offset, stride)``. The two grids' window ends fall ``offset`` and ``stride - offset`` apart,
so every record of at most ``window - max(offset, stride - offset) + 1`` tokens lies whole inside a window of one
of them (docs/mitigation.md), where one grid alone needs ``window - stride + 1``.

Everything here is pure and cheap; the reference, the attention backends (which hand the Triton kernels the
plain integers derived here), the cache, evaluation and the analyses import it instead of recomputing any of it.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch

LocalWindow = Union[int, Literal["tail"]]
EntryRopePosition = Literal["block_start", "window_start", "window_end"]
ENTRY_ROPE_POSITIONS = ("block_start", "window_start", "window_end")


def num_entries(seq_len: int, stride: int) -> int:
    """Number of compressed entries of a sequence of ``seq_len`` tokens (finished windows only)."""
    return seq_len // stride


def phase(position: int | torch.Tensor, stride: int) -> int | torch.Tensor:
    """Phase of a position: ``position mod stride``."""
    return position % stride


def grid_origin(grid_offset: int, stride: int) -> int:
    """Grid coordinate ``P`` of real position 0 for a grid shifted by ``grid_offset``: ``(stride - o) % stride``
    (``g = p + P``; 0 without a shift)."""
    return (stride - grid_offset) % stride


def shifted_origin(origin: int, offset: int, stride: int) -> int:
    """Grid coordinate of real position 0 for the grid at ``origin`` moved by ``offset`` more positions
    (``attention.dual_offset``: a second set of entries whose windows start ``offset`` later):
    ``(origin - offset) % stride``. Equal to ``origin`` when ``offset`` is a multiple of ``stride``."""
    return (origin - offset) % stride


def entry_start(j: int | torch.Tensor, window: int, stride: int) -> int | torch.Tensor:
    """First position covered by entry ``j`` (may be negative: those positions are absent)."""
    return (j + 1) * stride - window


def entry_end(j: int | torch.Tensor, stride: int) -> int | torch.Tensor:
    """Last position covered by entry ``j``; also the first query position that sees it."""
    return (j + 1) * stride - 1


def visible_entries(t: int | torch.Tensor, stride: int) -> int | torch.Tensor:
    """How many entries (``0..n-1``) a query at position ``t`` sees (entry j is visible iff ``(j+1)S - 1 <= t``)."""
    return (t + 1) // stride


def entry_rope_position(
    j: torch.Tensor, window: int, stride: int, mode: EntryRopePosition, origin: int = 0
) -> torch.Tensor:
    """Position (grid coordinates) at which the compressed key of entry ``j`` is rotated; ``origin`` is the grid
    coordinate of real position 0 (the real RoPE position is the result minus ``origin``)."""
    if mode == "block_start":  # DeepSeek-V4: first token of the entry's own stride block
        return j * stride
    if mode == "window_end":
        return entry_end(j, stride)
    if mode == "window_start":  # first present token of the window
        return torch.clamp(entry_start(j, window, stride), min=origin)
    raise ValueError(f"entry_rope_position must be one of {ENTRY_ROPE_POSITIONS}, got {mode!r}")


def offset_series(window: int, stride: int) -> torch.Tensor:
    """(window,) int64: the series of each offset, ``offset // stride``. Series ``s`` holds the window's tokens of
    stride block ``j - (window // stride - 1) + s`` of entry ``j`` (DeepSeek-V4's CSA, W = 2S: series 0 = "Ca",
    the previous block, series 1 = "Cb", the entry's own block). Needs ``window % stride == 0``."""
    if window % stride:
        raise ValueError(f"window={window} is not a multiple of stride={stride}: offsets do not form series")
    return torch.arange(window) // stride


def window_positions(
    first_entry: int, n: int, window: int, stride: int, device=None, origin: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions covered by entries ``first_entry .. first_entry + n - 1``.

    Returns ``positions`` (n, window) int64 and ``present`` (n, window) bool (False for positions < ``origin``:
    0 without a shift, ``grid_origin(o, stride)`` in a shifted layer's grid coordinates).
    """
    j = torch.arange(first_entry, first_entry + n, device=device)[:, None]  # (n, 1)
    pos = entry_start(j, window, stride) + torch.arange(window, device=device)[None, :]  # (n, W)
    return pos, pos >= origin


def local_span(local_window: LocalWindow, stride: int) -> int:
    """Largest number of exact keys a query can keep (the width of the local band)."""
    if local_window == "tail":
        return stride - 1
    return int(local_window)


def local_start(t: int | torch.Tensor, local_window: LocalWindow, stride: int) -> int | torch.Tensor:
    """First position of the exact local window of a query at ``t`` (may exceed ``t``: empty window)."""
    if local_window == "tail":
        return ((t + 1) // stride) * stride
    return t - int(local_window) + 1


def earliest_local_key(
    q_start: int, Tq: int, L: int, local_window: LocalWindow, stride: int, origin: int = 0
) -> Optional[int]:
    """The earliest key position any of the queries ``q_start .. q_start+Tq-1`` keeps exactly (None: none keeps
    one), from ints alone (no host sync). A query at ``t`` keeps ``max(local_start(t), t - L + 1, origin) .. t``; that
    start never decreases with ``t``, and within ``stride`` queries one keeps a key when any does (only a tail
    window is ever empty, and only at the last position of each stride), so the first non-empty one is the earliest."""
    for t in range(q_start, q_start + min(Tq, stride + 1)):
        first = max(local_start(t, local_window, stride), t - L + 1, origin)
        if first <= t:
            return first
    return None


def compressed_mask(q_pos: torch.Tensor, n_entries: int, stride: int, first: int = 0) -> torch.Tensor:
    """(Tq, E - first) bool: entry ``first + j`` is visible to the query at ``q_pos[i]``."""
    j = torch.arange(first, n_entries, device=q_pos.device)
    return entry_end(j, stride)[None, :] <= q_pos[:, None]


def local_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, local_window: LocalWindow, stride: int, origin: int = 0
) -> torch.Tensor:
    """(Tq, Tk) bool: the exact key at ``k_pos[c]`` is in the local window of the query at ``q_pos[i]`` (keys
    below ``origin`` are absent)."""
    start = local_start(q_pos, local_window, stride)
    return (k_pos[None, :] >= start[:, None]) & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= origin)


def influence_mask(
    seq_len: int, window: int, stride: int, local_window: LocalWindow, grid_offset: int = 0
) -> torch.Tensor:
    """(T, T) bool over real positions: token ``p`` can influence the query at ``t`` in one compressed attention
    layer whose grid is shifted by ``grid_offset`` (through a visible entry covering ``p`` or through ``t``'s
    local window)."""
    P = grid_origin(grid_offset, stride)
    n = seq_len + P  # grid coordinates 0 .. n-1; real positions are P ..
    t = torch.arange(n)
    e = num_entries(n, stride)
    pos, present = window_positions(0, e, window, stride, origin=P)  # (E, W)
    covers = torch.zeros(e, n, dtype=torch.bool)
    if e:
        covers[torch.arange(e)[:, None].expand_as(pos)[present], pos[present]] = True
    via_entries = (compressed_mask(t, e, stride).float() @ covers.float()) > 0  # (n, n)
    return (via_entries | local_mask(t, t, local_window, stride, origin=P))[P:, P:]


def local_keep(seq_len: int, local_window: LocalWindow, stride: int, origin: int = 0) -> int:
    """Exact keys a decoding cache must keep after ``seq_len`` tokens: those in the next query's local window
    (later queries' windows start no earlier). In a shifted layer ``seq_len`` is in grid coordinates and keys
    below ``origin`` were never held (the keep is at most ``seq_len - origin``)."""
    return max(0, seq_len - max(local_start(seq_len, local_window, stride), origin))


def pending_keep(seq_len: int, window: int, stride: int, origin: int = 0) -> int:
    """Hidden states a decoding cache must keep after ``seq_len`` tokens to pool the next entry to close (grid
    coordinates and ``origin`` as in ``local_keep``)."""
    next_start = entry_start(seq_len // stride, window, stride)
    return max(seq_len - max(next_start, origin), 0)
