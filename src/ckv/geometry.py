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

Everything here is pure and cheap; the reference, the attention backends (which hand the Triton kernels the
plain integers derived here), the cache, evaluation and the analyses import it instead of recomputing any of it.
"""

from __future__ import annotations

from typing import Literal, Union

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


def entry_start(j: int | torch.Tensor, window: int, stride: int) -> int | torch.Tensor:
    """First position covered by entry ``j`` (may be negative: those positions are absent)."""
    return (j + 1) * stride - window


def entry_end(j: int | torch.Tensor, stride: int) -> int | torch.Tensor:
    """Last position covered by entry ``j``; also the first query position that sees it."""
    return (j + 1) * stride - 1


def visible_entries(t: int | torch.Tensor, stride: int) -> int | torch.Tensor:
    """How many entries (``0..n-1``) a query at position ``t`` sees (entry j is visible iff ``(j+1)S - 1 <= t``)."""
    return (t + 1) // stride


def entry_rope_position(j: torch.Tensor, window: int, stride: int, mode: EntryRopePosition) -> torch.Tensor:
    """Position at which the compressed key of entry ``j`` is rotated."""
    if mode == "block_start":  # DeepSeek-V4: first token of the entry's own stride block
        return j * stride
    if mode == "window_end":
        return entry_end(j, stride)
    if mode == "window_start":  # first present token of the window
        return torch.clamp(entry_start(j, window, stride), min=0)
    raise ValueError(f"entry_rope_position must be one of {ENTRY_ROPE_POSITIONS}, got {mode!r}")


def offset_series(window: int, stride: int) -> torch.Tensor:
    """(window,) int64: the series of each offset, ``offset // stride``. Series ``s`` holds the window's tokens of
    stride block ``j - (window // stride - 1) + s`` of entry ``j`` (DeepSeek-V4's CSA, W = 2S: series 0 = "Ca",
    the previous block, series 1 = "Cb", the entry's own block). Needs ``window % stride == 0``."""
    if window % stride:
        raise ValueError(f"window={window} is not a multiple of stride={stride}: offsets do not form series")
    return torch.arange(window) // stride


def window_positions(first_entry: int, n: int, window: int, stride: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions covered by entries ``first_entry .. first_entry + n - 1``.

    Returns ``positions`` (n, window) int64 and ``present`` (n, window) bool (False for positions < 0).
    """
    j = torch.arange(first_entry, first_entry + n, device=device)[:, None]  # (n, 1)
    pos = entry_start(j, window, stride) + torch.arange(window, device=device)[None, :]  # (n, W)
    return pos, pos >= 0


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


def compressed_mask(q_pos: torch.Tensor, n_entries: int, stride: int) -> torch.Tensor:
    """(Tq, E) bool: entry ``j`` is visible to the query at ``q_pos[i]``."""
    j = torch.arange(n_entries, device=q_pos.device)
    return entry_end(j, stride)[None, :] <= q_pos[:, None]


def local_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, local_window: LocalWindow, stride: int) -> torch.Tensor:
    """(Tq, Tk) bool: the exact key at ``k_pos[c]`` is in the local window of the query at ``q_pos[i]``."""
    start = local_start(q_pos, local_window, stride)
    return (k_pos[None, :] >= start[:, None]) & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)


def influence_mask(seq_len: int, window: int, stride: int, local_window: LocalWindow) -> torch.Tensor:
    """(T, T) bool: token ``p`` can influence the query at ``t`` in one compressed attention layer
    (through a visible entry covering ``p`` or through ``t``'s local window)."""
    t = torch.arange(seq_len)
    e = num_entries(seq_len, stride)
    pos, present = window_positions(0, e, window, stride)  # (E, W)
    covers = torch.zeros(e, seq_len, dtype=torch.bool)
    if e:
        covers[torch.arange(e)[:, None].expand_as(pos)[present], pos[present]] = True
    via_entries = (compressed_mask(t, e, stride).float() @ covers.float()) > 0  # (T, T)
    return via_entries | local_mask(t, t, local_window, stride)


def local_keep(seq_len: int, local_window: LocalWindow, stride: int) -> int:
    """Exact keys a decoding cache must keep after ``seq_len`` tokens: those in the next query's local window
    (later queries' windows start no earlier)."""
    return max(0, seq_len - max(local_start(seq_len, local_window, stride), 0))


def pending_keep(seq_len: int, window: int, stride: int) -> int:
    """Hidden states a decoding cache must keep after ``seq_len`` tokens to pool the next entry to close."""
    next_start = entry_start(seq_len // stride, window, stride)
    return max(seq_len - max(next_start, 0), 0)

