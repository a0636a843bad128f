"""Dispatch of compressed attention's two ops by ``attention.impl``: pooling a window's tokens into an entry
(``pool``) and the joint softmax over entries and the exact local window (``joint_attention``), each to the
PyTorch oracle (``reference``, ``attention/reference.py``), the fast, memory-bounded block path (``torch``,
``attention/blocked.py``) or the Triton kernels (``triton``); ``auto`` decides per call (``resolve_impl``). Each op
also comes as a submodule without parameters or state (``Pooling``, ``JointAttention``), so that a forward hook can
read its inputs and outputs. ``attend_entries`` runs the joint softmax over several sets of entries (a compressed
layer's own and dual-offset compression's moved grid's, or the sets a source layer shares with other layers,
``EntrySet``), merged by their log-sum-exps (``merge_softmax``).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ckv.attention.blocked import joint_attention_blocked
from ckv.attention.reference import joint_attention_reference, pool_reference
from ckv.geometry import LocalWindow, local_span

IMPLS = ("auto", "reference", "torch", "triton")
# ``auto`` off CUDA runs the reference for a call whose score matrix per (batch, head), queries x (entries + local
# span), has at most this many elements, the fast path above: the reference is exact to the last digit of every
# study run before the fast path existed (66-token tasks), and cheap at that size; the fast path differs from it by
# summation order (~1e-7 relative).
REFERENCE_MAX_SCORES = 2**16


def resolve_impl(impl: str, device: torch.device, scores: Optional[int] = None) -> str:
    """``auto`` -> ``triton`` on CUDA (when ckv_kernels imports); elsewhere the fast path ``torch``, or the
    ``reference`` when the call's ``scores`` (queries x (entries + local span), per batch row and head) are at most
    ``REFERENCE_MAX_SCORES`` (None: size unknown, the fast path). ``triton`` on a non-CUDA device runs the kernels
    under the Triton interpreter (slow: meant for tests); it says so once, and raises RuntimeError when the
    interpreter is not enabled (TRITON_INTERPRET=1 before ckv_kernels is imported)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {list(IMPLS)}")
    if impl == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        return "reference" if scores is not None and scores <= REFERENCE_MAX_SCORES else "torch"
    if impl == "triton" and device.type != "cuda":
        _check_interpreter(device)
    return impl


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the Triton kernels (the ``ckv_kernels`` package and triton) import."""
    try:
        import ckv_kernels  # noqa: F401

        return True
    except ImportError:
        return False


_interpreter_announced = False


def _check_interpreter(device: torch.device) -> None:
    """Allow impl='triton' off CUDA only under the Triton interpreter, and say so once per process."""
    global _interpreter_announced
    if not triton_available():
        raise RuntimeError("attention.impl='triton' needs the ckv_kernels package and triton (pip install '.[gpu]')")
    import ckv_kernels

    if not ckv_kernels.INTERPRET:
        raise RuntimeError(
            f"attention.impl='triton' on {device.type} runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before ckv_kernels is imported (tests do), or use impl='auto' / 'torch' off CUDA"
        )
    if not _interpreter_announced:
        _interpreter_announced = True
        warnings.warn(
            f"attention.impl='triton' on {device.type}: the Triton kernels run under the interpreter "
            "(TRITON_INTERPRET=1), which is correct but very slow",
            RuntimeWarning,
            stacklevel=3,
        )


def pool(
    payload: torch.Tensor, logits: Optional[torch.Tensor], present: torch.Tensor, impl: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch of ``reference.pool_reference`` (see there for shapes): returns pooled entries and weights. Every
    impl but ``triton`` pools with the reference (one pass over the windows; the torch paths share it)."""
    if resolve_impl(impl, payload.device) == "triton":
        from ckv_kernels import pool as pool_triton

        return pool_triton(payload, logits, present)
    return pool_reference(payload, logits, present)


def joint_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int,
    local_window: LocalWindow,
    q_start: int = 0,
    impl: str = "auto",
    sinks: Optional[torch.Tensor] = None,
    origin: int = 0,
    selected: Optional[torch.Tensor] = None,
    block: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint softmax of ``reference.joint_attention_reference`` (see there for shapes, ``origin`` and the
    top-k ``selected`` entries per query) by ``impl`` (``resolve_impl``: ``auto`` decides per call by size off
    CUDA; ``block``: the fast path's queries per block, None to choose); returns the output (B, Tq, H, D) and the
    joint softmax's log-sum-exp (B, Tq, H) fp32, which carries a gradient under ``reference`` only (no caller
    differentiates it). A layer with a shifted grid passes ``q_start`` in grid coordinates and its ``origin``."""
    scores = q.shape[1] * (kc.shape[1] + local_span(local_window, stride))
    impl = resolve_impl(impl, q.device, scores)
    if impl == "triton":
        from ckv_kernels import joint_attention as joint_attention_triton

        return joint_attention_triton(
            q,
            kc,
            vc,
            k,
            v,
            stride=stride,
            local_span=local_span(local_window, stride),
            tail=local_window == "tail",
            q_start=q_start,
            sinks=sinks,
            origin=origin,
            selected=selected,
        )
    joint = dict(stride=stride, local_window=local_window, q_start=q_start, sinks=sinks, origin=origin)
    if impl == "torch":
        return joint_attention_blocked(q, kc, vc, k, v, **joint, selected=selected, block=block)
    return joint_attention_reference(q, kc, vc, k, v, **joint, selected=selected)


@dataclass(frozen=True)
class EntrySet:
    """One set of entries a joint softmax attends: keys ``kc`` and values ``vc`` (B, E, KV, D) of entries
    ``0..E-1`` at ``stride`` positions each, entry ``j`` visible to a query at grid position ``g`` iff
    ``(j+1)*stride - 1 <= g``, in grid coordinates ``g = p + origin`` (``ckv.geometry``). A compressed layer's
    pooled entries (stride: its own), or a full layer's keys and values (stride 1: token ``j`` is entry ``j``); what
    a source layer shares with the layers that read its KV (``model.layers``' ``kv``)."""

    kc: torch.Tensor
    vc: torch.Tensor
    stride: int
    origin: int = 0


def merge_softmax(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the columns of two: outputs (B, T, H, D) and log-sum-exps (B, T, H) of two joint softmaxes
    of the same queries over disjoint columns give those of one softmax over all of them, each output weighted by
    its share ``exp(lse_i - lse)`` (a sink counted in one of the two stays counted once). A row that sees nothing
    in either (both -inf) outputs 0."""
    lse = torch.logaddexp(lse_a, lse_b)  # (B, T, H)
    seen = torch.isfinite(lse)
    w_a = torch.where(seen, torch.exp(lse_a - lse), 0.0)[..., None]  # (B, T, H, 1)
    w_b = torch.where(seen, torch.exp(lse_b - lse), 0.0)[..., None]
    out = w_a * out_a.float() + w_b * out_b.float()
    return out.to(out_a.dtype), lse


def attend_entries(
    q: torch.Tensor,
    sets: Sequence[EntrySet],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    start: int,
    local_window: LocalWindow,
    impl: str = "auto",
    sinks: Optional[torch.Tensor] = None,
    selected: Optional[torch.Tensor] = None,
    block: Optional[int] = None,
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor]] = joint_attention,
) -> torch.Tensor:
    """Queries q (B, T, H, D) at real positions ``start..`` in one softmax over entry sets and their exact local
    window k, v (B, Tk, KV, D) (the ``Tk`` real positions ending at the last query's): the first set's visible
    entries (its ``selected`` top-k, when given) with the local window and the ``sinks``, through ``attend``
    (``joint_attention``, or a compressed layer's hookable ``JointAttention``), then each further set's visible
    entries alone (dual-offset compression's moved grid), merged by log-sum-exps (``merge_softmax``). Each set
    runs in its own grid coordinates. Returns (B, T, H, D)."""
    first, *more = sets
    joint = dict(stride=first.stride, local_window=local_window, impl=impl, block=block)
    origin = first.origin
    out, lse = attend(
        q, first.kc, first.vc, k, v, **joint, q_start=start + origin, sinks=sinks, origin=origin, selected=selected
    )
    for s in more:  # the entries only: no local window, no sink
        joint.update(stride=s.stride, local_window=0)
        out_x, lse_x = joint_attention(q, s.kc, s.vc, k, v, **joint, q_start=start + s.origin, origin=s.origin)
        out, lse = merge_softmax(out, lse, out_x, lse_x)
    return out


class Pooling(nn.Module):
    """The pooling step of a compressor as a submodule without parameters or state, so that a forward hook can
    read the weights: ``forward(payload, logits, present, impl)`` returns ``(pooled, alpha)`` (see ``pool``)."""

    def forward(
        self, payload: torch.Tensor, logits: Optional[torch.Tensor], present: torch.Tensor, impl: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pool(payload, logits, present, impl=impl)


class JointAttention(nn.Module):
    """The joint softmax of a compressed layer as a submodule without parameters or state, so that a forward hook
    can read its inputs (queries, entries, the selection) and its log-sum-exp (the indexer's training target,
    ``ckv.train.indexer``): ``forward`` takes ``joint_attention``'s arguments and returns ``(out, lse)``; a hook
    reads them through ``AttendCall.decode`` (never by position or key itself)."""

    def forward(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        stride: int,
        local_window: LocalWindow,
        q_start: int = 0,
        impl: str = "auto",
        sinks: Optional[torch.Tensor] = None,
        origin: int = 0,
        selected: Optional[torch.Tensor] = None,
        block: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return joint_attention(
            q,
            kc,
            vc,
            k,
            v,
            stride=stride,
            local_window=local_window,
            q_start=q_start,
            impl=impl,
            sinks=sinks,
            origin=origin,
            selected=selected,
            block=block,
        )


@dataclass(frozen=True)
class AttendCall:
    """The arguments of one ``JointAttention`` call as its forward hooks and pre-hooks receive them
    (``args``, ``kwargs``), decoded once here: the queries ``q`` (B, Tq, H, D), the entries' keys ``kc``
    (B, E, KV, D), the ``stride``, the grid position of the first query ``q_start`` and the top-k ``selected``
    entries per query (B, Tq, K) or None (every visible entry)."""

    q: torch.Tensor
    kc: torch.Tensor
    stride: int
    q_start: int
    selected: Optional[torch.Tensor]

    @classmethod
    def decode(cls, args: tuple, kwargs: dict[str, Any]) -> AttendCall:
        """The call ``JointAttention.forward(*args, **kwargs)`` (a hook's ``args`` and ``kwargs``), decoded."""
        bound = _ATTEND_SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        return cls(a["q"], a["kc"], a["stride"], a["q_start"], a["selected"])

    @property
    def n_entries(self) -> int:
        """E: the layer's entries in this call."""
        return self.kc.shape[1]

    @property
    def last_query(self) -> int:
        """The grid position of the call's final query."""
        return self.q_start + self.q.shape[1] - 1


_ATTEND_SIGNATURE = inspect.signature(JointAttention.forward)
