"""Joint attention with top-k selection (``selected``): the wrapper's preparation of the selection, the query
kernel (forward and, with ``BWD``, dq) and the per-entry dkc/dvc kernel, with their launchers. The exact keys'
dk/dv is the dense key pass (``attention_bwd``). The oracle is ``ckv.attention.reference.joint_attention_reference``.

- ``select_query_kernel`` runs one program per query position and (batch, KV head), its G heads as rows, gathering
  the position's selected entries (rows sorted ascending, ``prepare_selection``) with the dense kernel's step
  (``attention_fwd.query_step``) before the same local band.
- ``select_entry_kernel`` computes dkc/dvc per entry over the positions that selected it (the inverse map,
  ``_selection_csr``), in a fixed order: no atomics, deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ckv_kernels._common import autotune
from ckv_kernels.attention_common import LOG2E, Problem, load, prune_rows, rows
from ckv_kernels.attention_fwd import local_band, query_finish, query_start, query_step

__all__ = [
    "ENTRY_CONFIGS",
    "SELECT_CONFIGS",
    "prepare_selection",
    "run_select_entries",
    "run_select_query",
    "select_entry_kernel",
    "select_query_kernel",
]

# One position per program (``select_query_kernel``: gathered entries, BLOCK_N per step) and one entry per program
# (``select_entry_kernel``: BLOCK_M (position, head) rows per step). All compile for sm_90 without spills
# (benchmarks/kernel_resources.py); untimed on a GPU.
SELECT_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=2) for n, w in ((64, 4), (32, 4), (64, 8))]
_SELECT_INTERPRETER_CONFIG = triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)
ENTRY_CONFIGS = [
    triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=2) for m, w in ((32, 4), (64, 8), (32, 8), (16, 4))
]
_ENTRY_INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=1)


def prepare_selection(
    selected: torch.Tensor, B: int, Tq: int, E: int, q_start: int, stride: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``selected`` (B, Tq, K) and turn it into what the kernels read: each row's entries in ascending order,
    int32, empty slots (-1) as E, so that the entries its position sees come first; and their count (B, Tq) int32.
    One host sync (the check). K = 0 becomes one empty slot (the kernels never get an empty tensor)."""
    if selected.dtype not in (torch.int64, torch.int32) or selected.dim() != 3 or tuple(selected.shape[:2]) != (B, Tq):
        raise ValueError(
            f"selected must be an int64 or int32 tensor (B, Tq, K) = ({B}, {Tq}, K), got {selected.dtype} "
            f"{tuple(selected.shape)}"
        )
    if selected.device != device:
        raise ValueError(f"selected is on {selected.device}, the other inputs on {device}")
    if selected.shape[2] == 0:
        selected = selected.new_full((B, Tq, 1), -1)
    sel = selected.to(torch.int32, copy=True)  # out-of-range values (int32 may wrap them) are reported below
    sel = sel.masked_fill_(sel < 0, E).sort(dim=-1).values  # (B, Tq, K)
    if sel.numel():
        lo, hi = selected.min(), selected.max()
        repeated = ((sel[..., 1:] == sel[..., :-1]) & (sel[..., 1:] < E)).any()
        if ((lo < -1) | (hi >= E) | repeated).item():
            if lo < -1 or hi >= E:
                raise ValueError(
                    f"selected holds indices {lo.item()} .. {hi.item()}; allowed: -1 (empty slot) .. E-1 = {E - 1}"
                )
            raise ValueError("selected repeats an entry index within a row (each selected entry counts once)")
    visible = torch.clamp((torch.arange(q_start + 1, q_start + Tq + 1, device=device)) // stride, max=E)  # (Tq,)
    count = (sel < visible[None, :, None]).sum(-1, dtype=torch.int32)  # (B, Tq)
    return sel.contiguous(), count


@autotune(SELECT_CONFIGS, _SELECT_INTERPRETER_CONFIG, key=["Tq", "E", "K_SEL", "D", "G_PAD", "TAIL", "BWD"])
@triton.jit
def select_query_kernel(
    Q,
    KC,
    VC,
    K,
    V,
    O,
    LSE,
    DO,
    DQ,
    DELTA,
    SINK,
    SEL,
    COUNT,
    Tq,
    Tk,
    E,
    KV,
    K_SEL,
    q_start,
    k_start,
    stride,
    span,
    qk_scale,
    sm_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    TAIL: tl.constexpr,
    LOCAL: tl.constexpr,
    BWD: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SINK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Forward or dq pass of ``query_kernel`` with top-k selection, for ONE query position and the G heads of
    one (batch, KV head): G_PAD >= 16 rows (heads padded, masked: tl.dot needs 16), since no two positions share
    their entries. SEL (B, Tq, K_SEL) int32: each row's entries in ascending order, the COUNT (B, Tq) int32
    visible ones first; (a) gathers those ``BLOCK_N`` at a time, (b) is the dense kernel's local band."""
    H = KV * G
    i0 = Tq - 1 - tl.program_id(0)  # later positions see more entries: start them first
    b = tl.program_id(1) // KV
    kv = tl.program_id(1) % KV
    i, row, row_ok = rows(i0, Tq, H, kv, G, G_PAD, G_PAD)  # i = i0 on every row
    t = q_start + i
    d = tl.arange(0, D)
    plane = (b * Tq).to(tl.int64) * H
    Q, O, DO, DQ, LSE, DELTA = Q + plane * D, O + plane * D, DO + plane * D, DQ + plane * D, LSE + plane, DELTA + plane
    q_offs = row[:, None] * D + d[None, :]
    q, do, acc, m_i, l_i = query_start(
        Q, O, DO, LSE, DELTA, SINK, q_offs, row, row_ok, kv, H, G, D, BWD, UPCAST, HAS_SINK, G_PAD
    )

    # (a) the selected entries, gathered; slots past the count read as entry E (masked)
    sel_base = (b * Tq + i0).to(tl.int64) * K_SEL
    n_sel = tl.load(COUNT + b * Tq + i0)
    kc_base = (b * E).to(tl.int64) * KV * D + kv * D
    for s0 in range(0, n_sel, BLOCK_N):
        slots = s0 + tl.arange(0, BLOCK_N)
        cols = tl.load(SEL + sel_base + slots, mask=slots < n_sel, other=E)
        acc, m_i, l_i = query_step(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            KC + kc_base,
            VC + kc_base,
            cols,
            E,
            KV * D,
            E,
            stride,
            k_start,
            span,
            qk_scale,
            D,
            True,
            True,
            TAIL,
            BWD,
            UPCAST,
        )
    # (b) the band of exact keys of this position's local window
    if LOCAL:
        k_base = (b * Tk).to(tl.int64) * KV * D + kv * D
        t0 = q_start + i0
        acc, m_i, l_i = local_band(
            acc,
            m_i,
            l_i,
            q,
            do,
            t,
            K + k_base,
            V + k_base,
            t0,
            t0,
            Tk,
            E,
            KV,
            stride,
            k_start,
            span,
            qk_scale,
            D,
            TAIL,
            BWD,
            UPCAST,
            BLOCK_N,
        )
    query_finish(acc, m_i, l_i, O, LSE, DQ, q_offs, row, row_ok, sm_scale, BWD)


@autotune(ENTRY_CONFIGS, _ENTRY_INTERPRETER_CONFIG, key=["Tq", "E", "D", "G_PAD"], prune=prune_rows)
@triton.jit
def select_entry_kernel(
    Q,
    KC,
    VC,
    DO,
    LSE,
    DELTA,
    DKC,
    DVC,
    OFFSETS,
    TOKENS,
    Tq,
    E,
    KV,
    qk_scale,
    sm_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dkc, dvc of ONE compressed entry ``program_id(0)`` of one (batch, KV head) under top-k selection: the sum
    over the query positions that selected it (and see it), in ascending order, ``BLOCK_M // G_PAD`` positions
    x G heads per step. TOKENS[OFFSETS[b*E + e] : OFFSETS[b*E + e + 1]] (int32) are those positions (indices into
    Tq), OFFSETS (B*E + 1,) int64. One entry per program: scores are dot products with one key (no tl.dot), and
    the program writes its entry's gradients alone, zeros when no query selected it (no atomics)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    H = KV * G
    e = tl.program_id(0)
    b = tl.program_id(1) // KV
    kv = tl.program_id(1) % KV
    d = tl.arange(0, D)
    entry = ((b * E + e).to(tl.int64) * KV + kv) * D
    key = load(KC + entry + d, d < D, UPCAST).to(tl.float32)  # (D,)
    val = load(VC + entry + d, d < D, UPCAST).to(tl.float32)
    plane = (b * Tq).to(tl.int64) * H
    Q, DO, LSE, DELTA = Q + plane * D, DO + plane * D, LSE + plane, DELTA + plane
    lo = tl.load(OFFSETS + b * E + e)
    hi = tl.load(OFFSETS + b * E + e + 1)
    dk = tl.zeros([D], dtype=tl.float32)
    dv = tl.zeros([D], dtype=tl.float32)
    r = tl.arange(0, BLOCK_M)
    g = r % G_PAD
    for s0 in range(lo, hi, BLOCK_Q):
        slot = s0 + r // G_PAD
        ok = (slot < hi) & (g < G)
        i = tl.load(TOKENS + slot, mask=ok, other=0)
        row = i * H + kv * G + g
        q_offs = row[:, None] * D + d[None, :]
        q = load(Q + q_offs, ok[:, None], UPCAST).to(tl.float32)  # (BLOCK_M, D)
        do = load(DO + q_offs, ok[:, None], UPCAST).to(tl.float32)
        lse = tl.load(LSE + row, mask=ok, other=0.0) * 1.4426950408889634  # finite: these rows see the entry
        delta = tl.load(DELTA + row, mask=ok, other=0.0)
        p = tl.where(ok, tl.exp2(tl.sum(q * key[None, :], 1) * qk_scale - lse), 0.0)  # (BLOCK_M,)
        ds = p * (tl.sum(do * val[None, :], 1) - delta)
        dv += tl.sum(p[:, None] * do, 0)
        dk += tl.sum(ds[:, None] * q, 0)
    tl.store(DKC + entry + d, (dk * sm_scale).to(DKC.dtype.element_ty))
    tl.store(DVC + entry + d, dv.to(DVC.dtype.element_ty))


def _selection_csr(sel: torch.Tensor, count: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection inverted for the dkc/dvc pass: the positions (indices into Tq) that see and selected entry e
    of batch b are ``tokens[offsets[b*E + e] : offsets[b*E + e + 1]]``, ascending. A stable sort of the key
    ``b*E + entry`` over every (b, position, slot), unused slots keyed ``B*E`` (last); no host sync.
    Returns offsets (B*E + 1,) int64 and tokens (B*Tq*K,) int32."""
    B, Tq, K = sel.shape
    used = torch.arange(K, device=sel.device) < count[..., None]  # (B, Tq, K)
    batch = torch.arange(B, device=sel.device, dtype=torch.int32)[:, None, None] * E
    keys, order = (sel + batch).masked_fill_(~used, B * E).flatten().sort(stable=True)  # int32 keys, int64 order
    tokens = order.div_(K, rounding_mode="floor").remainder_(Tq).to(torch.int32)  # in place: one int64 buffer
    offsets = torch.searchsorted(keys, torch.arange(B * E + 1, device=sel.device, dtype=keys.dtype))
    return offsets, tokens


def run_select_query(
    prob: Problem,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dq: torch.Tensor,
    delta: torch.Tensor,
    sel: torch.Tensor,
    count: torch.Tensor,
    bwd: bool,
    sinks: Optional[torch.Tensor] = None,
) -> None:
    """Forward (o, lse) or, with ``bwd``, the dq pass (dq, delta) under top-k selection, one position per program;
    ``sel``, ``count`` from ``prepare_selection``."""
    tensors, geometry, flags = prob.query_arguments((q, kc, vc, k, v, o, lse, do, dq, delta), bwd, sinks)
    select_query_kernel[(prob.Tq, prob.B * prob.KV)](
        *tensors,
        sel,
        count,
        prob.Tq,
        prob.Tk,
        prob.E,
        prob.KV,
        sel.shape[2],
        *geometry,
        G_PAD=max(16, prob.g_pad),  # tl.dot needs 16 rows
        **flags,
    )


def run_select_entries(
    prob: Problem,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    sel: torch.Tensor,
    count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dkc, dvc under top-k selection: each entry sums over the positions that selected it (``_selection_csr``),
    one program per (entry, batch, KV head), every entry written."""
    offsets, tokens = _selection_csr(sel, count, prob.E)
    dkc, dvc = torch.empty_like(kc), torch.empty_like(vc)
    select_entry_kernel[(prob.E, prob.B * prob.KV)](
        q,
        kc,
        vc,
        do,
        lse,
        delta,
        dkc,
        dvc,
        offsets,
        tokens,
        prob.Tq,
        prob.E,
        prob.KV,
        prob.sm_scale * LOG2E,
        prob.sm_scale,
        G=prob.G,
        G_PAD=prob.g_pad,
        D=prob.D,
        UPCAST=prob.upcast,
    )
    return dkc, dvc
