"""Pure-PyTorch reference of the compressed KV path: the oracle the Triton kernels, the decoding cache and
every analysis are tested against. Vectorised; memory O(T * (T/stride + local)), never (T, T)."""

from __future__ import annotations

from typing import Optional

import torch

from ckv.geometry import LocalWindow, compressed_mask, earliest_local_key, local_span, local_start


def pool_reference(
    payload: torch.Tensor, logits: Optional[torch.Tensor], present: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool each window's payloads into one entry.

    payload: (B, E, W, KV, D); logits: (B, E, W, KV, G) with G = 1 (scalar gate) or D (vector gate), or None for
    uniform averaging; present: (E, W) bool, False for positions before 0 (never all False in a row).
    Returns pooled (B, E, KV, D) and weights alpha (B, E, W, KV, G) (G = 1 for the mean), summing to 1 over W.
    """
    mask = present[None, :, :, None, None]  # (1, E, W, 1, 1)
    if logits is None:
        alpha = (mask / present.sum(-1).clamp_min(1)[None, :, None, None, None]).to(payload.dtype)
    else:
        scores = logits.float().masked_fill(~mask, float("-inf"))
        alpha = torch.softmax(scores, dim=2).to(payload.dtype)
    pooled = (alpha * payload).sum(dim=2)  # (B, E, KV, D)
    return pooled, alpha


def check_selected(selected: torch.Tensor, B: int, Tq: int, E: int) -> None:
    """Raise ValueError unless ``selected`` is an integer (B, Tq, K) tensor of entry indices in ``-1 .. E-1`` with
    no index repeated within a row (-1, the empty slot, may repeat). Reads the values (one host sync)."""
    if selected.dtype not in (torch.int64, torch.int32) or selected.dim() != 3 or selected.shape[:2] != (B, Tq):
        raise ValueError(
            f"selected must be an int64 or int32 tensor (B, Tq, K) = ({B}, {Tq}, K), got {selected.dtype} "
            f"{tuple(selected.shape)}"
        )
    if selected.numel() == 0:
        return
    lo, hi = selected.min().item(), selected.max().item()
    if lo < -1 or hi >= E:
        raise ValueError(f"selected holds indices {lo} .. {hi}; allowed: -1 (empty slot) .. E-1 = {E - 1}")
    s = selected.sort(dim=-1).values
    if ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any():
        raise ValueError("selected repeats an entry index within a row (each selected entry counts once)")


def selection_mask(selected: torch.Tensor, B: int, Tq: int, E: int) -> torch.Tensor:
    """(B, Tq, E) bool: entry ``j`` is listed in row ``[b, i]`` of ``selected`` (checked by ``check_selected``)."""
    check_selected(selected, B, Tq, E)
    listed = torch.zeros(B, Tq, E + 1, dtype=torch.bool, device=selected.device)  # column E: the empty slots
    listed.scatter_(-1, torch.where(selected < 0, E, selected).long(), True)
    return listed[..., :E]


def joint_attention_reference(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    local_window: LocalWindow,
    q_start: int = 0,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    origin: int = 0,
    selected: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over visible compressed entries and the exact keys of each query's local window.

    q: (B, Tq, H, D) at positions ``q_start .. q_start+Tq-1``; kc, vc: (B, E, KV, D) entries ``0..E-1``;
    k, v: (B, Tk, KV, D) exact keys at positions ``q_start+Tq-Tk .. q_start+Tq-1`` (they must reach back as far
    as any query's local window). H % KV == 0 (grouped-query attention). ``sinks`` (H,): one extra logit per
    head in every query's softmax (DeepSeek-V4's attention sink) whose probability is dropped (its value is 0).
    Returns out (B, Tq, H, D) in q's dtype and the log-sum-exp (B, Tq, H) in fp32, sinks included (-inf where a
    query sees nothing and there is no sink; its output is 0 either way).
    ``origin``: the first present position (0; a layer with a shifted grid passes positions in grid coordinates,
    ``q_start`` included, and its grid coordinate of real position 0): exact keys before it do not exist.
    ``selected`` (B, Tq, K) integer, top-k selection (DeepSeek-V4's indexer): row ``[b, i]`` lists the entries the
    query at ``q_start + i`` may attend to, shared by all its heads; -1 marks an empty slot. An entry enters the
    softmax iff it is visible and listed; the local window and the sinks are unchanged. The order within a row does
    not matter; an index repeated in a row, or outside ``-1 .. E-1``, raises ValueError (``check_selected``).
    None: every visible entry (the dense path).
    """
    B, Tq, H, D = q.shape
    E, KV, Tk = kc.shape[1], k.shape[2], k.shape[1]
    G = H // KV
    scale = D**-0.5 if scale is None else scale
    dev = q.device
    q_pos = torch.arange(q_start, q_start + Tq, device=dev)
    k_start = q_start + Tq - Tk

    qg = q.reshape(B, Tq, KV, G, D).float()
    mask_c = compressed_mask(q_pos, E, stride)[None]  # (1, Tq, E)
    if selected is not None:
        mask_c = mask_c & selection_mask(selected, B, Tq, E)  # (B, Tq, E): visible and selected
    nb = mask_c.shape[0]  # 1, or B with a selection
    s_c = torch.einsum("btkgd,bekd->bkgte", qg, kc.float()) * scale  # (B, KV, G, Tq, E)

    L = local_span(local_window, stride)
    if E + L == 0:  # nothing can ever be visible (no entries yet, no local window)
        if sinks is None:
            return torch.zeros_like(q), q.new_full((B, Tq, H), float("-inf"), dtype=torch.float32)
        return torch.zeros_like(q), sinks.float().expand(B, Tq, H)  # only the sink: lse = its logit
    band = q_pos[:, None] - L + 1 + torch.arange(L, device=dev)[None, :]  # (Tq, L) key positions
    mask_l = (band >= local_start(q_pos, local_window, stride)[:, None]) & (band >= origin)
    earliest = earliest_local_key(q_start, Tq, L, local_window, stride, origin)
    if earliest is not None and earliest < k_start:
        raise ValueError(f"exact keys start at position {k_start}, but a local window reaches further back")
    idx = (band - k_start).clamp(0, max(Tk - 1, 0))
    k_l = k[:, idx] if Tk else k.new_zeros(B, Tq, L, KV, D)  # (B, Tq, L, KV, D)
    v_l = v[:, idx] if Tk else v.new_zeros(B, Tq, L, KV, D)
    s_l = torch.einsum("btkgd,btlkd->bkgtl", qg, k_l.float()) * scale  # (B, KV, G, Tq, L)

    mask = torch.cat([mask_c, mask_l.expand(nb, Tq, L)], dim=-1)  # (nb, Tq, E + L)
    scores = torch.cat([s_c, s_l], dim=-1)
    if sinks is not None:  # the sink: one more always-visible column per head, probability dropped below
        sink = sinks.float().view(1, KV, G, 1, 1).expand(B, KV, G, Tq, 1)
        scores = torch.cat([scores, sink], dim=-1)
        mask = torch.cat([mask, mask.new_ones(nb, Tq, 1)], dim=-1)
    mask = mask[:, None, None]  # (nb, 1, 1, Tq, columns), broadcast over heads
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    m = scores.amax(dim=-1, keepdim=True).detach()
    p = torch.exp(scores - m) * mask  # masked columns are exactly 0, also where a row is all masked
    denom = p.sum(dim=-1)  # (B, KV, G, Tq)
    o = torch.einsum("bkgte,bekd->btkgd", p[..., :E], vc.float())
    o = o + torch.einsum("bkgtl,btlkd->btkgd", p[..., E : E + L], v_l.float())
    o = o / denom.clamp_min(1e-30).permute(0, 3, 1, 2)[..., None]
    lse = torch.where(denom > 0, m.squeeze(-1) + denom.clamp_min(1e-30).log(), float("-inf"))
    return o.reshape(B, Tq, H, D).to(q.dtype), lse.permute(0, 3, 1, 2).reshape(B, Tq, H)
