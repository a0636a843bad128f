"""Long context on one CPU thread: compressed attention against the full attention it replaces.

    python benchmarks/long_context.py --quick          # a few minutes: T = 1K, 4K steps, 8K forward, the op at 4K
    python benchmarks/long_context.py                  # the full table (3 min 34 s on 2 quiet cores)
    python benchmarks/long_context.py --impl reference # every compressed row on the oracle (attention.impl)

Two tables, each row in its own fresh Python process (``torch.set_num_threads(1)``; its peak resident set is the
process's ``ru_maxrss``, so every row's figure is clean of the others'), every ratio against a row measured in
the same run:

1. **Training step**: ckv's ``tiny`` preset (2 layers, width 64, 4 query heads of 16), a 1,024-token vocabulary,
   batch 1, ``T`` tokens, for ``full`` (SDPA), ``w8s8``, ``w8s4``, ``deepseek_v4_csa``, ``deepseek_v4_csa_sparse``
   and ``deepseek_v4_hca`` (``conf/attention``, composed as ``train.py`` composes them): forward with the fused
   chunked cross-entropy (``ckv.train.loss``), the lightning indexer's KL (``ckv.train.indexer``, sparse stage)
   where the model has one, backward and one AdamW step; timed after a warm-up step on the first 1,024 tokens
   (first-call costs), the fastest of 3 steps up to 4K tokens, one step above. tokens/s and peak RSS as a ratio to
   ``full`` at the same ``T``. Then one no-grad forward (``Transformer.hidden_states``) at the longest ``T``.
2. **The attention op alone**: B = 1, 4 query heads of 64, 1 KV head, W8/S8 entries (random: the op, not the
   compressor), a 16-token local window and per-head sinks, at ``T`` tokens: forward, and forward + backward
   (gradients of every input), for SDPA full causal attention (the baseline), ckv's fast path
   (``ckv.attention.blocked``), ckv's reference (``ckv.attention.reference``, the oracle) and torch's
   FlexAttention (``torch.compile(flex_attention)`` with a block mask for entries + band and the sinks through
   ``score_mod``; its block mask is built once outside the timing; torch 2.13 has no CPU backward for it).
   Before timing, every op is compared with ckv's reference at T = 256 (SDPA with the reference's full-causal
   case: no entries, a window of T): the largest error relative to the output's largest value is in the table,
   and an op that does not match (> 1e-4) is not timed. An op whose memory estimate exceeds ``--mem-cap-gib`` is
   skipped and says so.

Memory estimates (to skip what would not fit) come from ckv's own accounting (``step_estimate_bytes``: the
backend's ``prefill_bytes``, ``index_bytes`` and ``working_bytes``). Results:
``--out`` (default ``outputs/long_context/``) gets ``report.md`` and ``report.json`` (the command, the date, the
machine, torch's version and every row). The machine may be shared: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
ATTENTIONS = ("full", "w8s8", "w8s4", "deepseek_v4_csa", "deepseek_v4_csa_sparse", "deepseek_v4_hca")
OPS = ("sdpa", "fast", "reference", "flex")
PASSES = ("forward", "forward+backward")
VOCAB = 1024
OP_HEADS, OP_KV_HEADS, OP_HEAD_DIM, OP_STRIDE, OP_LOCAL_WINDOW = 4, 1, 64, 8, 16
WARMUP_T = 1024  # a row's warm-up step runs on this many tokens (its first-call costs), then the timed one on T
SHORT_T = 4096  # rows up to this length take the fastest of 3 timed repeats, longer ones one
CHECK_T = 256  # the size at which every op is compared with the reference before it is timed
MATCH_TOL = 1e-4  # largest |op - reference| over the reference's largest |value|
GIB = 2**30


class Sizes(NamedTuple):
    """The lengths one run measures: training steps, the forward-only length, and the op's lengths."""

    train: tuple[int, ...]
    forward: tuple[int, ...]
    op: tuple[int, ...]


FULL = Sizes(train=(1024, 4096, 16384), forward=(32768,), op=(4096, 16384))
QUICK = Sizes(train=(1024, 4096), forward=(8192,), op=(4096,))


# ---- children: one measurement each ----------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@functools.cache
def _composed(attention: str, impl: Optional[str]) -> dict[str, Any]:
    """The tiny preset's ``ModelConfig`` with ``conf/attention/<attention>.yaml`` as ``train.py`` composes it (Hydra,
    once per option), as a dict."""
    from ckv.train.plan import compose_train_config
    from ckv.train.plan import model_config as plan_model_config

    overrides = [f"attention={attention}", "model=tiny"] + ([] if impl is None else [f"attention.impl={impl}"])
    return plan_model_config(compose_train_config(overrides), vocab_size=VOCAB).to_dict()


def model_config(attention: str, seq_len: int, impl: Optional[str] = None) -> Any:
    """``_composed`` for sequences of ``seq_len`` tokens."""
    from ckv import ModelConfig

    return ModelConfig.from_dict({**_composed(attention, impl), "max_seq_len": seq_len})


OP_REPEATS = 3  # the op rows: the fastest of 3 calls at every length (a first call at a new length is cold)


def repeats(seq_len: int) -> int:
    """Timed repeats of a row (the fastest counts): 3 up to ``SHORT_T`` tokens, where one call is short and noisy
    on a shared machine, else 1."""
    return 3 if seq_len <= SHORT_T else 1


def train_child(config: dict[str, Any], seq_len: int, mode: str) -> dict[str, Any]:
    """A training step (``mode='train'``) or a no-grad forward (``'forward'``) of the model of ``config`` (a
    ``ModelConfig`` dict: ``model_config``'s, composed by the parent) at ``seq_len`` tokens in this process, after
    the same on its first ``WARMUP_T`` tokens; the fastest of ``repeats`` steps' seconds, tokens/s, the last loss
    and the peak RSS."""
    import torch

    from ckv import ModelConfig, Transformer
    from ckv.train.indexer import IndexerTraining, IndexerTrainingConfig, has_indexer
    from ckv.train.loss import chunked_cross_entropy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dict(config))
    ids = torch.randint(0, VOCAB, (1, seq_len))  # (B, T)
    labels = torch.randint(0, VOCAB, (1, seq_len))
    warm = min(seq_len, WARMUP_T)  # first-call costs are not the step's: a warm-up on the first tokens
    if mode == "forward":
        model.eval()
        with torch.no_grad():
            model.hidden_states(ids[:, :warm])
            seconds, hidden = best_of(lambda: model.hidden_states(ids), repeats(seq_len))  # (B, T, d)
        return step_row(seq_len, seconds, None, bool(torch.isfinite(hidden).all()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    indexer = IndexerTraining(model, IndexerTrainingConfig()) if has_indexer(model) else None

    def step(T: int) -> float:
        if indexer is not None:
            indexer.start(dense=False)  # the sparse stage: each query attends its top-k entries
        hidden = model.hidden_states(ids[:, :T])  # (B, T, d)
        loss = chunked_cross_entropy(hidden, model.lm_head.weight, labels[:, :T], chunk_tokens=4096)
        objective = loss if indexer is None else loss + indexer.finish()[0]
        objective.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step(warm)
    seconds, loss = best_of(lambda: step(seq_len), repeats(seq_len))
    return step_row(seq_len, seconds, loss, math.isfinite(loss))


def best_of(fn: Callable[[], Any], n: int) -> tuple[float, Any]:
    """The fastest of ``n`` timed calls of ``fn`` (seconds) and the last call's result."""
    times, out = [], None
    for _ in range(n):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def step_row(seq_len: int, seconds: float, loss: Optional[float], finite: bool) -> dict[str, Any]:
    """A training-step or forward row: its time, tokens/s, last loss (None for a forward), peak RSS, finiteness."""
    return {
        "seconds": seconds,
        "tokens_per_s": seq_len / seconds,
        "loss": loss,
        "peak_rss": peak_rss_bytes(),
        "finite": finite,
    }


def op_inputs(seq_len: int, grad: bool, seed: int = 0, device: str = "cpu", dtype: Any = None) -> dict[str, Any]:
    """Random inputs of the op: q (1, T, 4, 64), k and v (1, T, 1, 64), entries kc and vc (1, T / 8, 1, 64),
    sinks (4,); fp32 unless ``dtype``, drawn on the CPU (the same values on every device)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    E, H, KV, D = seq_len // OP_STRIDE, OP_HEADS, OP_KV_HEADS, OP_HEAD_DIM
    shapes = {"q": (1, seq_len, H, D), "k": (1, seq_len, KV, D), "v": (1, seq_len, KV, D),
              "kc": (1, E, KV, D), "vc": (1, E, KV, D), "sinks": (H,)}  # fmt: skip
    return {
        name: torch.randn(*shape, generator=g).to(device=device, dtype=dtype or torch.float32).requires_grad_(grad)
        for name, shape in shapes.items()
    }


def sdpa_op(x: dict[str, Any]) -> Any:
    """Full causal attention over the T exact keys (grouped-query, SDPA): the baseline."""
    import torch.nn.functional as F

    q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))  # (B, heads, T, D)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


def reference_op(x: dict[str, Any], local_window: int = OP_LOCAL_WINDOW, entries: bool = True) -> Any:
    """ckv's reference of the joint attention (``entries=False``: no entries, the full-causal case SDPA matches)."""
    from ckv.attention.reference import joint_attention_reference

    kc, vc = (x[n] if entries else x[n][:, :0] for n in ("kc", "vc"))
    sinks = x["sinks"] if entries else None
    return joint_attention_reference(
        x["q"], kc, vc, x["k"], x["v"], stride=OP_STRIDE, local_window=local_window, sinks=sinks
    )[0]


def fast_op() -> Optional[Callable[[dict[str, Any]], Any]]:
    """ckv's fast torch path (``ckv.attention.blocked``), or None where this checkout has none."""
    try:
        from ckv.attention.blocked import joint_attention_blocked
    except ImportError:
        return None

    def run(x: dict[str, Any]) -> Any:
        return joint_attention_blocked(
            x["q"], x["kc"], x["vc"], x["k"], x["v"], stride=OP_STRIDE, local_window=OP_LOCAL_WINDOW,
            sinks=x["sinks"],
        )[0]  # fmt: skip

    return run


def flex_op(seq_len: int, device: str = "cpu") -> Callable[[dict[str, Any]], Any]:
    """torch's FlexAttention for the same attention, its block mask built here (once, outside any timing): keys are
    [sink, entries 0..E-1, tokens 0..T-1] with the sink's value 0 and its logit set by ``score_mod`` (the sink
    takes probability, adds nothing); the mask keeps visible entries and the local band."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ckv.geometry import entry_end, local_start

    E, S, W = seq_len // OP_STRIDE, OP_STRIDE, OP_LOCAL_WINDOW

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        entry, token = kv_idx - 1, kv_idx - 1 - E
        is_entry = (kv_idx >= 1) & (kv_idx <= E)
        band = (kv_idx > E) & (token <= q_idx) & (token >= local_start(q_idx, W, S))
        return (kv_idx == 0) | (is_entry & (entry_end(entry, S) <= q_idx)) | band

    block_mask = create_block_mask(mask_mod, None, None, seq_len, 1 + E + seq_len, device=device)
    compiled = torch.compile(flex_attention)

    def run(x: dict[str, Any]) -> Any:
        sinks = x["sinks"]

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return torch.where(kv_idx == 0, sinks[h].to(score.dtype), score)

        zero = x["k"].new_zeros(1, 1, OP_KV_HEADS, OP_HEAD_DIM)
        k = torch.cat([zero, x["kc"], x["k"]], dim=1).transpose(1, 2)  # (B, KV, 1 + E + T, D)
        v = torch.cat([zero, x["vc"], x["v"]], dim=1).transpose(1, 2)
        out = compiled(x["q"].transpose(1, 2), k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2)  # (B, T, H, D)

    return run


def triton_op(x: dict[str, Any]) -> Any:
    """ckv's Triton kernels of the joint attention (CUDA; ``benchmarks/gpu_check.py``)."""
    from ckv.attention.dispatch import joint_attention

    return joint_attention(
        x["q"], x["kc"], x["vc"], x["k"], x["v"], stride=OP_STRIDE, local_window=OP_LOCAL_WINDOW, impl="triton",
        sinks=x["sinks"],
    )[0]  # fmt: skip


def build_op(op: str, seq_len: int, device: str = "cpu") -> Optional[Callable[[dict[str, Any]], Any]]:
    """The op's callable at ``seq_len`` (None: not in this checkout)."""
    return {"sdpa": lambda: sdpa_op, "reference": lambda: reference_op, "fast": fast_op,
            "flex": lambda: flex_op(seq_len, device), "triton": lambda: triton_op}[op]()  # fmt: skip


def op_error(
    op: str,
    fn: Callable[[dict[str, Any]], Any],
    grad: bool,
    seq_len: int = CHECK_T,
    device: str = "cpu",
    dtype: Any = None,
) -> float:
    """Largest |op - reference| over the reference's largest |value|, outputs and (``grad``) every input's
    gradient, at ``seq_len`` tokens, the op on ``device`` in ``dtype`` and the reference in fp32 on the same
    values; SDPA against the reference's full-causal case."""
    import torch

    errors, outs = [], []
    x_op = op_inputs(seq_len, grad, device=device, dtype=dtype)
    x_ref = {name: t.detach().float().requires_grad_(grad) for name, t in x_op.items()}  # the same values
    ref = (lambda x: reference_op(x, local_window=seq_len, entries=False)) if op == "sdpa" else reference_op
    for run, x in ((fn, x_op), (ref, x_ref)):
        out = run(x)
        tensors = [out.detach()]
        if grad:
            out.backward(torch.ones_like(out) / out.numel() ** 0.5)
            tensors += [x[n].grad for n in x if x[n].grad is not None]
        outs.append(tensors)
    for got, want in zip(*outs):
        errors.append(((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return max(errors)


def op_child(op: str, seq_len: int, grad: bool) -> dict[str, Any]:
    """Check the op against the reference at ``CHECK_T`` tokens (its warm-up), then time it at ``seq_len`` (the
    fastest of ``OP_REPEATS``; FlexAttention after a first call that compiles it for ``seq_len``), in this process."""
    import torch

    torch.set_num_threads(1)
    fn_check = build_op(op, CHECK_T)
    if fn_check is None:
        return {"status": "n/a (ckv.attention.blocked is not in this checkout)"}
    if grad and op == "flex":
        return {"status": "n/a (no CPU backward)"}
    error = op_error(op, fn_check, grad)
    if not error <= MATCH_TOL:
        return {"status": f"not timed: differs from the reference by {error:.1e}", "error": error}
    fn = fn_check if op in ("sdpa", "reference") else build_op(op, seq_len)
    x = op_inputs(seq_len, grad)

    def call() -> None:
        out = fn(x) if grad else _no_grad(fn, x)
        if grad:
            out.backward(torch.ones_like(out))
            for t in x.values():
                t.grad = None

    if op == "flex":  # flex compiles for T at its first call; the others ran at CHECK_T
        call()
    seconds, _ = best_of(call, OP_REPEATS)
    return {"status": "ok", "error": error, "seconds": seconds, "peak_rss": peak_rss_bytes()}


def _no_grad(fn: Callable[[dict[str, Any]], Any], x: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return fn(x)


# ---- the parent: plan, run each row in a fresh process, report --------------------------------------------------
def step_estimate_bytes(attention: str, seq_len: int, mode: str, impl: Optional[str]) -> float:
    """Transient bytes the row would need by ckv's accounting: a forward, one layer's prefill transients and its
    indexer's (``ckv.eval.memory``); a training step, every layer's attention part (the reference's scores are
    kept for backward) plus the larger of the indexer's scores and its loss's logits
    (``AttentionBackend.working_bytes``)."""
    import torch

    from ckv.attention import check_attention
    from ckv.eval.memory import ckv_model_memory

    cfg, cpu = model_config(attention, seq_len, impl), torch.device("cpu")
    if mode == "forward":
        (group,) = ckv_model_memory(cfg, cpu).layers
        return max(group.scores(seq_len, seq_len), group.indexer(seq_len, seq_len))
    parts = check_attention(cfg).working_bytes(cfg, seq_len, cpu)
    indexer = max(parts.get("index scores", 0.0), parts.get("KL logits", 0.0))
    return cfg.n_layers * parts.get("attention", 0.0) + indexer


def op_estimate_bytes(op: str, seq_len: int, grad: bool) -> float:
    """Transient bytes of the op: the reference holds four fp32 copies of (H, T, entries + band + sink) scores
    (twice over with backward); the others hold O(T) tensors (a block at a time)."""
    if op != "reference":
        return 0.0
    columns = seq_len // OP_STRIDE + OP_LOCAL_WINDOW + 1
    return 4 * 4 * OP_HEADS * seq_len * columns * (2 if grad else 1)


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One row in a fresh Python process; its last stdout line is the row's JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"status": f"failed: {last[:200]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan_rows(sizes: Sizes, attentions: list[str], ops: list[str]) -> list[dict[str, Any]]:
    """Every row to measure, in order."""
    rows = [{"table": "train", "attention": a, "T": T, "mode": "train"} for T in sizes.train for a in attentions]
    rows += [{"table": "train", "attention": a, "T": T, "mode": "forward"} for T in sizes.forward for a in attentions]
    rows += [
        {"table": "op", "op": op, "T": T, "pass": p} for T in sizes.op for p in PASSES for op in ops
    ]  # fmt: skip
    return rows


def measure(row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run one planned row (or skip it past the memory cap); the row with its results."""
    cap = args.mem_cap_gib * GIB
    if row["table"] == "train":
        from ckv.flops import flops_per_token

        impl = None if row["attention"] == "full" else args.impl
        estimate = step_estimate_bytes(row["attention"], row["T"], row["mode"], impl)
        flops = flops_per_token(model_config(row["attention"], row["T"], impl), row["T"])
        row = {**row, "impl": impl or "auto", "estimate": estimate, "flops_per_token": flops.forward}
        if estimate > cap:
            return {**row, "status": f"skipped: > {args.mem_cap_gib:g} GiB (estimate {estimate / GIB:.1f} GiB)"}
        config = model_config(row["attention"], row["T"], impl).to_dict()
        spec = {"kind": "train", "config": config, "T": row["T"], "mode": row["mode"]}
        result = run_child(spec)
        return {**row, "status": result.pop("status", "ok"), **result}
    grad = row["pass"] == "forward+backward"
    estimate = op_estimate_bytes(row["op"], row["T"], grad)
    if estimate > cap:
        return {**row, "status": f"skipped: > {args.mem_cap_gib:g} GiB (estimate {estimate / GIB:.1f} GiB)"}
    return {**row, **run_child({"kind": "op", "op": row["op"], "T": row["T"], "grad": grad})}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each measured row's speed and peak RSS over its baseline's at the same T (and mode or pass)."""
    for row in rows:
        if row.get("status") != "ok":
            continue
        if row["table"] == "train":
            base = [r for r in rows if r["table"] == "train" and r["attention"] == "full" and
                    r["T"] == row["T"] and r["mode"] == row["mode"] and r.get("status") == "ok"]  # fmt: skip
            if base:
                row["speed_vs_base"] = row["tokens_per_s"] / base[0]["tokens_per_s"]
                row["rss_vs_base"] = row["peak_rss"] / base[0]["peak_rss"]
        else:
            base = [r for r in rows if r["table"] == "op" and r["op"] == "sdpa" and r["T"] == row["T"] and
                    r["pass"] == row["pass"] and r.get("status") == "ok"]  # fmt: skip
            if base:
                row["speed_vs_base"] = base[0]["seconds"] / row["seconds"]


def _fmt(x: Optional[float], spec: str) -> str:
    return "" if x is None else format(x, spec)


def report_markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The two tables as markdown, with the command and the machine."""
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}; {meta['machine']}; torch {meta['torch']}; one thread)",
        "",
        "Training step (tiny preset, batch 1, vocabulary 1,024; `forward`: one no-grad forward):",
        "",
        "| attention | impl | T | mode | tokens/s | vs full | peak RSS MiB | vs full | FLOPs/token | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["table"] == "train"):
        lines.append(
            f"| {r['attention']} | {r['impl']} | {r['T']:,} | {r['mode']} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{_fmt(r.get('speed_vs_base'), '.2f')} | {_fmt(r.get('peak_rss', 0) / 2**20 or None, ',.0f')} | "
            f"{_fmt(r.get('rss_vs_base'), '.2f')} | {r['flops_per_token'] / 1e6:.2f} M | {r['status']} |"
        )
    lines += [
        "",
        f"The attention op (B = 1, {OP_HEADS} heads of {OP_HEAD_DIM}, {OP_KV_HEADS} KV head, "
        f"W{OP_STRIDE}/S{OP_STRIDE}, "
        f"{OP_LOCAL_WINDOW}-token window, sinks; `vs SDPA`: SDPA's time over the op's; `error`: against the "
        f"reference at T = {CHECK_T}):",
        "",
        "| op | T | pass | ms | vs SDPA | peak RSS MiB | error | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["table"] == "op"):
        seconds = r.get("seconds")
        lines.append(
            f"| {r['op']} | {r['T']:,} | {r['pass']} | {_fmt(seconds and seconds * 1e3, ',.0f')} | "
            f"{_fmt(r.get('speed_vs_base'), '.2f')} | {_fmt(r.get('peak_rss', 0) / 2**20 or None, ',.0f')} | "
            f"{_fmt(r.get('error'), '.1e')} | {r['status']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T = 1K and 4K steps, an 8K forward, the op at 4K")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "long_context", help="report.md + report.json")
    p.add_argument("--impl", default=None, help="attention.impl of the compressed rows (default: the config's auto)")
    p.add_argument("--attention", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--train-T", type=int, nargs="*", help="training-step lengths (overrides the preset)")
    p.add_argument("--forward-T", type=int, nargs="*", help="forward-only lengths (overrides the preset)")
    p.add_argument("--op-T", type=int, nargs="*", help="op lengths (overrides the preset)")
    p.add_argument("--mem-cap-gib", type=float, default=8.0, help="skip a row whose estimate exceeds this")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        if spec["kind"] == "train":
            result = train_child(spec["config"], spec["T"], spec["mode"])
        else:
            result = op_child(spec["op"], spec["T"], spec["grad"])
        print(json.dumps(result))
        return []
    preset = QUICK if args.quick else FULL
    sizes = Sizes(
        train=tuple(preset.train if args.train_T is None else args.train_T),
        forward=tuple(preset.forward if args.forward_T is None else args.forward_T),
        op=tuple(preset.op if args.op_T is None else args.op_T),
    )
    if "full" not in args.attention or "sdpa" not in args.ops:
        p.error("the baselines 'full' (--attention) and 'sdpa' (--ops) must be measured: every ratio is theirs")
    planned = plan_rows(sizes, args.attention, args.ops)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, row in enumerate(planned, 1):
        name = row.get("attention") or row["op"]
        what = row.get("mode") or row["pass"]
        print(f"[{i}/{len(planned)}] {name} T={row['T']} {what} ...", end=" ", flush=True)
        rows.append(measure(row, args))
        elapsed = time.perf_counter() - start
        eta = elapsed / i * (len(planned) - i)
        r = rows[-1]
        figure = f"{r['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in r else (
            f"{r['seconds'] * 1e3:,.0f} ms" if "seconds" in r else r["status"])  # fmt: skip
        print(f"{figure} (elapsed {elapsed:.0f} s, ETA {eta:.0f} s)", flush=True)
    add_ratios(rows)
    import torch

    meta = {
        "command": "python benchmarks/long_context.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end",
        "torch": torch.__version__,
        "seconds": time.perf_counter() - start,
    }
    text = report_markdown(meta, rows)
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out / 'report.md'} and report.json")
    return rows


if __name__ == "__main__":
    main()
