"""Joint attention over chunk-compressed entries and an exact local window: the public wrapper ``joint_attention``
(input checks) and its ``autograd.Function``, which runs the passes in order. The oracle is
``ckv.attention.reference.joint_attention_reference``; docs/kernels.md has the full picture.

- ``attention_common``: what the passes share (row layout, geometry tests, ``Problem``);
- ``attention_fwd``: the query pass, forward (out, log-sum-exp) and, rerun with ``BWD``, dq;
- ``attention_bwd``: the key pass, dk/dv of the compressed entries and of the exact keys;
- ``attention_select``: top-k selection (``selected``): its query pass and its per-entry dkc/dvc pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ckv_kernels._common import check_float, check_runnable
from ckv_kernels.attention_bwd import run_key
from ckv_kernels.attention_common import SUPPORTED_HEAD_DIMS, Problem, local_lo
from ckv_kernels.attention_fwd import run_query
from ckv_kernels.attention_select import prepare_selection, run_select_entries, run_select_query

__all__ = ["JointAttentionFunction", "joint_attention"]


def _first_needed_key(q_start: int, Tq: int, stride: int, span: int, tail: bool, origin: int = 0) -> Optional[int]:
    """Earliest exact-key position any query's local window holds, or None when no window holds a key.
    Window starts never decrease with the query position, so it is the first query's window start (no earlier
    than ``origin``, the first position that exists); in tail mode that window is empty when the first query
    closes a stride block, and the next query's window then starts at the same position, ``q_start + 1``."""
    if span == 0 or Tq == 0:
        return None
    return max(int(local_lo.fn(q_start, stride, span, tail)), origin)


def _check_inputs(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stride: int,
    local_span: int,
    tail: bool,
    q_start: int,
    origin: int = 0,
) -> None:
    """Raise a clear error on any input the kernels do not support."""
    for name, t in (("q", q), ("kc", kc), ("vc", vc), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-d (B, T, heads, head_dim), got shape {tuple(t.shape)}")
        check_float(name, t, q.dtype)
    B, Tq, H, D = q.shape
    if kc.shape != vc.shape or k.shape != v.shape:
        raise ValueError(
            f"kc {tuple(kc.shape)} must match vc {tuple(vc.shape)}, k {tuple(k.shape)} must match v {tuple(v.shape)}"
        )
    KV = kc.shape[2]
    if kc.shape[0] != B or k.shape[0] != B or k.shape[2] != KV or kc.shape[3] != D or k.shape[3] != D:
        raise ValueError(
            f"inconsistent shapes: q {tuple(q.shape)}, kc {tuple(kc.shape)}, k {tuple(k.shape)} "
            "(expected (B, Tq, H, D), (B, E, KV, D), (B, Tk, KV, D))"
        )
    if H % KV:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads {KV}")
    if triton.next_power_of_2(H // KV) > 64:
        raise ValueError(f"GQA group H/KV={H // KV} is larger than the supported 64")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={D} is not supported by the Triton kernels; supported: {SUPPORTED_HEAD_DIMS}")
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride={stride!r} must be an integer >= 1")
    if not isinstance(local_span, int) or isinstance(local_span, bool) or local_span < 0:
        raise ValueError(f"local_span={local_span!r} must be an integer >= 0")
    if not isinstance(tail, bool):
        raise ValueError(f"tail={tail!r} must be a bool")
    if tail and local_span != stride - 1:
        raise ValueError(f"tail mode keeps at most stride - 1 = {stride - 1} exact keys, got local_span={local_span}")
    if not isinstance(origin, int) or isinstance(origin, bool) or origin < 0:
        raise ValueError(f"origin={origin!r} must be an integer >= 0")
    if not isinstance(q_start, int) or isinstance(q_start, bool) or q_start < origin:
        raise ValueError(f"q_start={q_start!r} must be an integer >= {origin} (origin)")
    k_start = q_start + Tq - k.shape[1]
    if k_start < origin:
        raise ValueError(
            f"{k.shape[1]} exact keys end at position {q_start + Tq - 1}, so they would start before "
            f"the first position {origin}"
        )
    first = _first_needed_key(q_start, Tq, stride, local_span, tail, origin)
    if first is not None and first < k_start:
        raise ValueError(f"exact keys start at position {k_start}, but a local window reaches back to {first}")
    check_runnable(q, kc, vc, k, v)


def _query_pass(
    prob: Problem,
    tensors: tuple[torch.Tensor, ...],
    bwd: bool,
    sinks: Optional[torch.Tensor],
    sel: Optional[torch.Tensor],
    count: Optional[torch.Tensor],
) -> None:
    """The forward or the dq pass over ``tensors`` = (q, kc, vc, k, v, o, lse, do, dq, delta): the dense kernel, or
    with a selection (``prepare_selection``) the top-k one."""
    if sel is None:
        run_query(prob, *tensors, bwd=bwd, sinks=sinks)
    else:
        run_select_query(prob, *tensors, sel, count, bwd=bwd, sinks=sinks)


class JointAttentionFunction(torch.autograd.Function):
    """Autograd for the joint-attention kernels. Saves the inputs, the output and the log-sum-exp; the backward
    recomputes P. The log-sum-exp output is not differentiable."""

    @staticmethod
    def forward(ctx, q, kc, vc, k, v, sinks, prob: Problem, sel, count):
        o = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)  # (B, Tq, H)
        sinks32 = None if sinks is None else sinks.detach().float().contiguous()
        if prob.Tq:  # DO, DQ, DELTA unused
            _query_pass(prob, (q, kc, vc, k, v, o, lse, o, o, lse), False, sinks32, sel, count)
        ctx.save_for_backward(q, kc, vc, k, v, o, lse, sinks32, sel, count)
        ctx.prob = prob
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kc, vc, k, v, o, lse, sinks, sel, count = ctx.saved_tensors
        prob: Problem = ctx.prob
        do = do.contiguous()
        if prob.Tq == 0:
            dsink = None if sinks is None else torch.zeros_like(sinks, dtype=ctx.sinks_dtype)
            return tuple(torch.zeros_like(t) for t in (q, kc, vc, k, v)) + (dsink, None, None, None)
        dq, delta = torch.empty_like(q), torch.empty_like(lse)
        _query_pass(prob, (q, kc, vc, k, v, o, lse, do, dq, delta), True, None, sel, count)  # dq, delta
        # d sink_h = -sum over (batch, query) of P(sink) * delta, P(sink) = exp(sink_h - lse)
        dsink = None if sinks is None else (-(sinks - lse).exp() * delta).sum((0, 1)).to(ctx.sinks_dtype)
        if not prob.E:
            dkc, dvc = torch.zeros_like(kc), torch.zeros_like(vc)
        elif sel is None:
            dkc, dvc = run_key(prob, q, kc, vc, do, lse, delta, compressed=True)
        else:
            dkc, dvc = run_select_entries(prob, q, kc, vc, do, lse, delta, sel, count)
        if prob.span and prob.Tk:
            dk, dv = run_key(prob, q, k, v, do, lse, delta, compressed=False)
        else:  # no local window: exact keys get no gradient
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        return dq, dkc, dvc, dk, dv, dsink, None, None, None


def joint_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    local_span: int,
    tail: bool = False,
    q_start: int = 0,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    origin: int = 0,
    selected: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over visible compressed entries and the exact keys of each query's local window (Triton;
    same contract as ``ckv.attention.reference.joint_attention_reference``).

    q: (B, Tq, H, D) at positions ``q_start .. q_start+Tq-1``; kc, vc: (B, E, KV, D) compressed entries
    ``0..E-1`` (entry j visible from position ``(j+1)*stride - 1``); k, v: (B, Tk, KV, D) exact keys at
    positions ``q_start+Tq-Tk ..``. The exact local window of the query at t is its last ``local_span`` tokens
    ``[t - local_span + 1, t]`` (0 = none), or with ``tail`` the tokens of its unfinished stride block
    ``[((t+1) // stride) * stride, t]`` (then ``local_span`` must be ``stride - 1``, the widest such block); the
    caller derives both from the geometry (``ckv.geometry.local_span``). H % KV == 0 with H/KV <= 64; D in
    SUPPORTED_HEAD_DIMS; all inputs fp32, fp16 or bf16 (one dtype), accumulation in fp32.
    ``sinks`` (H,), any float dtype: one extra logit per head whose probability is dropped (DeepSeek-V4).
    Returns out (B, Tq, H, D) in q's dtype (0 where a query sees nothing) and the log-sum-exp (B, Tq, H) fp32,
    sinks included (-inf where a query sees nothing and there are no sinks). Differentiable in q, kc, vc, k, v
    and sinks. ``origin``: the first position that exists (0; a layer with a shifted grid passes every position
    in its grid coordinates, where real position 0 is ``origin``). The kernels derive query and key positions
    from ``q_start`` and ``Tk`` alone and never read a key before ``k_start >= origin``, so ``origin`` only
    bounds the input checks.
    ``selected`` (B, Tq, K) int64 or int32: top-k selection, as in the reference (each row lists the entries its
    position attends to, shared by its heads, -1 = empty slot; an entry counts iff visible and listed; a repeated
    index or one outside -1 .. E-1 raises ValueError). Checking it costs one host sync.
    """
    _check_inputs(q, kc, vc, k, v, stride, local_span, tail, q_start, origin)
    if sinks is not None:
        check_float("sinks", sinks)
        if sinks.shape != (q.shape[2],) or sinks.device != q.device:
            raise ValueError(
                f"sinks must have shape (H,) = ({q.shape[2]},) on {q.device}, got "
                f"{tuple(sinks.shape)} on {sinks.device}"
            )
    sel, count = (None, None)
    if selected is not None:
        sel, count = prepare_selection(selected, q.shape[0], q.shape[1], kc.shape[1], q_start, stride, q.device)
    prob = Problem(q, kc, k, stride, local_span, tail, q_start, scale)
    q, kc, vc, k, v = (t.contiguous() for t in (q, kc, vc, k, v))
    return JointAttentionFunction.apply(q, kc, vc, k, v, sinks, prob, sel, count)
