"""The first-GPU check: one command, at most 8 minutes on one H200, that settles what a CPU cannot.

    python benchmarks/gpu_check.py                         # on the GPU: outputs/gpu_check/report.{json,md}
    python benchmarks/gpu_check.py --out /tmp/g --dry-run  # anywhere: the plan, shapes checked on meta models

Sections, each with its own time budget (seconds; the total stays under 8 minutes: a section that overruns
shortens the ones after it). A section stops before an item that its budget would not cover (estimated from the
items before it) and records the skipped items and why; an item that fails is recorded the same way:
1. ``kernels`` (140 s): ``pytest tests/kernels`` on CUDA (``TRITON_INTERPRET=0``, ``TRITON_F32_DEFAULT=ieee``),
   the summary line and any failures captured;
2. ``attention`` (150 s): ``benchmarks/attention.py``'s kernel-vs-reference check (top-k selection included),
   then its rows at 8K-128K tokens for both head layouts (Qwen3 16/8/128, paper 16/1/128) and W8/S8: the Triton
   joint attention + pooling against full causal attention (flash-attn when installed, else SDPA), forward and
   forward+backward, with the ratios side by side; after each length's dense rows, DeepSeek-V4's sparse case
   (paper layout, W8/S4, top-512 selection: ``joint_attention(..., selected=...)`` and its reference);
3. ``training`` (80 s): one Qwen3-0.6B forward+backward at 4,096 tokens (bf16 weights, batch 1; the optimizer
   step is not included) for full attention (8 KV heads) and the paper's compressed model (W8/S8, 1 KV head), each
   today's way (logits + fp32 cross-entropy) and with full activation checkpointing + the chunked loss: time,
   tokens/s, MFU (``ckv.flops``, against the device's dense bf16 peak) and peak memory;
4. ``decode`` (50 s): prefill 32,768 tokens into the KV cache, then greedy decoding of 64 tokens: KV-cache bytes
   and tokens/s, full vs compressed;
5. ``long_context`` (60 s): ``benchmarks/long_context.py``'s rows at 16K and 64K tokens on the GPU (bf16): the
   attention op alone (B = 1, 4 heads of 64, 1 KV head, W8/S8, 16-token window, sinks), forward and
   forward + backward, for SDPA full causal attention (its flash kernel), ckv's Triton kernels, ckv's fast torch
   path, the reference (skipped past its memory) and FlexAttention (compiled; it has a backward on CUDA), each
   checked against the reference at 256 tokens first (within ``GPU_MATCH_TOL``: bf16); then the tiny model's
   training step for the six long-context options (needs hydra to compose ``conf/attention``; recorded as
   skipped without it).
Needs only torch, triton, numpy (and pytest for section 1) plus this checkout: ``ckv`` and ``ckv_kernels`` are
imported from ``src/`` and ``kernels/`` when not installed. No hydra, deepspeed, datasets or flash-attn needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 480
BUDGETS = {"kernels": 140, "attention": 150, "training": 80, "decode": 50, "long_context": 60}
ATTENTION_T = (8192, 16384, 32768, 65536, 131072)
ATTENTION_LAYOUTS = ("qwen3", "paper")
ATTENTION_GEOMETRY = "w8s8"
ATTENTION_TOPK = (512, "w8s4", ("paper",))  # V4-Flash's index_topk at V4's CSA stride, MQA-like layout
TRAIN_T = 4096
DECODE_CONTEXT, DECODE_TOKENS = 32768, 64
MODELS = {  # Qwen3-0.6B with ckv's full-attention control (Qwen3's 8 KV heads) and the paper's compressed default
    "full": {"kind": "full"},
    "compressed": {
        "kind": "compressed",
        "kv_heads": 1,
        "window": 8,
        "stride": 8,
        "local_window": 16,
        "pooling": "gate",
        "gate": "scalar",
    },
}


def _load_attention_benchmark():
    """benchmarks/attention.py as a module (it makes ckv and ckv_kernels importable from the checkout)."""
    spec = importlib.util.spec_from_file_location("ckv_attention_benchmark", ROOT / "benchmarks" / "attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_script(name: str) -> Any:
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"ckv_{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_attention_benchmark()
lc = _load_script("long_context")
LONG_T = (16384, 65536)
LONG_OPS = ("sdpa", "triton", "fast", "reference", "flex")
GPU_MATCH_TOL = 2e-2  # bf16 inputs against the fp32 reference on the same values

from ckv import ModelConfig, Transformer  # noqa: E402
from ckv.flops import flops_per_token, mfu, parameter_count, peak_flops  # noqa: E402
from ckv.train.checkpointing import apply_activation_checkpointing  # noqa: E402
from ckv.train.loss import chunked_cross_entropy  # noqa: E402


class Section:
    """Runs items under a time budget; an item is skipped (with the reason recorded) when the time left is below
    its estimate: the last item's duration times ``growth`` (for items that grow, e.g. doubling T)."""

    def __init__(self, name: str, budget_s: float) -> None:
        self.name, self.budget_s = name, budget_s
        self.start = time.monotonic()
        self.items: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self.last_s: Optional[float] = None

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def run(self, label: str, fn: Callable[[], Any], growth: float = 1.0, first_estimate_s: float = 0.0) -> Any:
        estimate = first_estimate_s if self.last_s is None else self.last_s * growth
        if estimate > self.left():
            self.skipped.append(
                {
                    "item": label,
                    "reason": f"estimated {estimate:.0f} s > {max(self.left(), 0):.0f} s "
                    f"left of the {self.budget_s} s budget",
                }
            )
            return None
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:  # recorded, and the check goes on: one failure must not lose the other sections
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            kind = "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else type(e).__name__
            self.skipped.append({"item": label, "reason": f"{kind}: {str(e).splitlines()[0] if str(e) else ''}"})
            out = None
        self.last_s = time.monotonic() - t0
        print(f"[{self.name}] {label}: {self.last_s:.1f} s", flush=True)
        return out

    def report(self) -> dict[str, Any]:
        return {
            "budget_s": self.budget_s,
            "used_s": round(time.monotonic() - self.start, 1),
            "items": self.items,
            "skipped": self.skipped,
        }


def model_config(kind: str) -> ModelConfig:
    return ModelConfig.from_preset("qwen3_0.6b", attention={**MODELS[kind], "impl": "auto"})


# --- 1. kernel tests ---------------------------------------------------------------------------------------------


def kernel_tests(section: Section) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        section.skipped.append({"item": "pytest tests/kernels", "reason": "pytest is not installed"})
        return
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_F32_DEFAULT": "ieee",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT / "kernels"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", "-rf"]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(section.left(), 1))
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        section.skipped.append(
            {"item": "pytest tests/kernels", "reason": f"stopped at the {section.budget_s} s budget"}
        )
        rc = None
    lines = [line for line in out.splitlines() if line.strip()]
    section.items.append(
        {
            "command": " ".join(cmd[1:]),
            "returncode": rc,
            "seconds": round(time.monotonic() - t0, 1),
            "summary": lines[-1] if lines else "",
            "failures": [line for line in lines if line.startswith("FAILED")],
            "tail": "\n".join(lines[-30:]),
        }
    )


# --- 2. attention benchmark --------------------------------------------------------------------------------------


def attention_args() -> SimpleNamespace:
    return SimpleNamespace(batch=1, repeats=5, warmup=1)


def attention_benchmark(section: Section, device: torch.device) -> None:
    dtype = torch.bfloat16
    topk, topk_geometry, topk_layouts = ATTENTION_TOPK
    check = section.run("kernel vs reference check", lambda: bench.check(device, dtype, topk), first_estimate_s=5)
    if check is not None:
        section.items.append({"check": check})
    args = attention_args()
    for T in ATTENTION_T:
        fulls: dict[str, dict] = {}  # per layout: the ratios' denominator for the top-k rows
        for layout in ATTENTION_LAYOUTS:

            def case(T: int = T, layout: str = layout) -> list[dict]:
                full = bench.run_full(T, layout, args, device, dtype)
                return [full] + bench.run_case(T, layout, ATTENTION_GEOMETRY, args, device, dtype, True, full)

            rows = section.run(f"T={T} {layout}", case, growth=4.0, first_estimate_s=2)  # full attention ~ T^2
            if rows is not None:
                section.items.extend(rows)
                fulls[layout] = rows[0]
        for layout in topk_layouts:
            sparse = partial(
                bench.run_case, T, layout, topk_geometry, args, device, dtype, True, fulls.get(layout), topk
            )
            rows = section.run(f"T={T} {layout} {topk_geometry} top-{topk}", sparse)  # ~ the dense case before
            if rows is not None:
                section.items.extend(rows)


# --- 3. training step --------------------------------------------------------------------------------------------


def training_step(kind: str, lean: bool, device: torch.device, repeats: int = 3) -> dict[str, Any]:
    """Forward+backward of Qwen3-0.6B (bf16 weights) on one 4,096-token sequence: time, MFU, peak memory."""
    cfg = model_config(kind)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=torch.bfloat16)
    if lean:
        apply_activation_checkpointing(model, "full")
    ids = torch.randint(0, cfg.vocab_size, (1, TRAIN_T), device=device)
    labels = torch.randint(0, cfg.vocab_size, (1, TRAIN_T), device=device)

    def step() -> torch.Tensor:
        if lean:
            loss = chunked_cross_entropy(model.hidden_states(ids), model.lm_head.weight, labels)
        else:
            logits = model(ids)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())  # today's lm_loss
        loss.backward()
        return loss.detach()

    loss = step()  # warm-up (autotuning, compilation)
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    seconds = sorted(times)[len(times) // 2]
    flops = flops_per_token(cfg, TRAIN_T).training
    peak = peak_flops()
    tokens_per_s = TRAIN_T / seconds
    row = {
        "attention": kind,
        "setup": "checkpointed+chunked" if lean else "plain",
        "T": TRAIN_T,
        "step_ms": seconds * 1e3,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops,
        "mfu": None if peak is None else mfu(tokens_per_s, flops, peak),
        "peak_flops": peak,
        "peak_gib_above_weights": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "loss": loss.item(),
    }
    model = None  # drop the weights before emptying the allocator's cache
    torch.cuda.empty_cache()
    return row


def training(section: Section, device: torch.device) -> None:
    for kind in MODELS:
        for lean in (False, True):
            row = section.run(
                f"{kind} {'checkpointed+chunked' if lean else 'plain'}",
                lambda kind=kind, lean=lean: training_step(kind, lean, device),
                first_estimate_s=10,
            )
            if row is not None:
                section.items.append(row)


# --- 4. decoding -------------------------------------------------------------------------------------------------


@torch.no_grad()
def decode(kind: str, device: torch.device) -> dict[str, Any]:
    cfg = model_config(kind)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, DECODE_CONTEXT), device=device)
    cache = model.new_cache(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = model(ids, cache)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    cache_bytes = cache.nbytes()
    t0 = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        logits = model(logits[:, -1:].argmax(-1), cache)
    torch.cuda.synchronize()
    decode_s = time.perf_counter() - t0
    row = {
        "attention": kind,
        "context": DECODE_CONTEXT,
        "prefill_s": prefill_s,
        "kv_cache_bytes_at_context": cache_bytes,
        "decode_tokens": DECODE_TOKENS,
        "decode_tokens_per_s": DECODE_TOKENS / decode_s,
    }
    del model, cache
    torch.cuda.empty_cache()
    return row


def decoding(section: Section, device: torch.device) -> None:
    for kind in MODELS:
        row = section.run(kind, lambda kind=kind: decode(kind, device), first_estimate_s=10)
        if row is not None:
            section.items.append(row)


# --- 5. long context ----------------------------------------------------------------------------------------------


def long_context_op(op: str, T: int, grad: bool, device: torch.device, repeats: int = 3) -> dict[str, Any]:
    """One op row of ``benchmarks/long_context.py`` on the GPU in bf16: checked against the reference at 256 tokens,
    then timed (median of ``repeats`` after a warm-up) with its peak memory."""
    dtype = torch.bfloat16
    error = lc.op_error(op, lc.build_op(op, lc.CHECK_T, str(device)), grad, device=str(device), dtype=dtype)
    row: dict[str, Any] = {"op": op, "T": T, "pass": "forward+backward" if grad else "forward", "error": error}
    if not error <= GPU_MATCH_TOL:
        return {**row, "status": f"not timed: differs from the reference by {error:.1e}"}
    fn, x = lc.build_op(op, T, str(device)), lc.op_inputs(T, grad, device=str(device), dtype=dtype)

    def call() -> None:
        with torch.set_grad_enabled(grad):
            out = fn(x)
            if grad:
                out.backward(torch.ones_like(out))
                for t in x.values():
                    t.grad = None

    call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base, times = torch.cuda.memory_allocated(), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ms = sorted(times)[len(times) // 2] * 1e3
    return {**row, "status": "ok", "ms": ms, "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def long_context_train(attention: str, T: int, device: torch.device) -> dict[str, Any]:
    """The tiny model's training step (``long_context.py``'s) at T tokens on the GPU (bf16 weights): tokens/s and
    peak memory. Composes ``conf/attention`` with hydra (imported here, never by the dry run)."""
    from ckv.apps.variants import load_variant
    from ckv.train.indexer import IndexerTraining, IndexerTrainingConfig, has_indexer

    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(
        "tiny", vocab_size=lc.VOCAB, max_seq_len=T, attention=load_variant(ROOT / "conf" / "attention", attention)
    )
    model = Transformer(cfg).to(device=device, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    indexer = IndexerTraining(model, IndexerTrainingConfig()) if has_indexer(model) else None
    ids, labels = (torch.randint(0, lc.VOCAB, (1, T), device=device) for _ in range(2))

    def step() -> None:
        if indexer is not None:
            indexer.start(dense=False)
        loss = chunked_cross_entropy(model.hidden_states(ids), model.lm_head.weight, labels)
        (loss if indexer is None else loss + indexer.finish()[0]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30
    model = optimizer = None  # drop the weights and states before emptying the allocator's cache
    torch.cuda.empty_cache()
    return {"attention": attention, "T": T, "tokens_per_s": T / seconds, "peak_gib": peak}


def long_context(section: Section, device: torch.device) -> None:
    for T in LONG_T:
        for grad in (False, True):
            for op in LONG_OPS:
                if op == "reference" and lc.op_estimate_bytes(op, T, grad) > 16 * 2**30:
                    section.skipped.append({"item": f"{op} T={T} grad={grad}", "reason": "skipped: > 16 GiB"})
                    continue
                row = section.run(f"{op} T={T} grad={grad}", partial(long_context_op, op, T, grad, device))
                if row is not None:
                    section.items.append(row)
    for T in LONG_T:
        for attention in lc.ATTENTIONS:
            row = section.run(f"train {attention} T={T}", partial(long_context_train, attention, T, device))
            if row is not None:
                section.items.append(row)
    for rows, key, base in (
        ([r for r in section.items if "op" in r], ("T", "pass"), "sdpa"),
        ([r for r in section.items if "tokens_per_s" in r], ("T",), "full"),
    ):
        for r in rows:
            ref = [b for b in rows if b.get("op", b.get("attention")) == base and all(b[k] == r[k] for k in key)]
            if ref and "ms" in r and "ms" in ref[0]:
                r["x_sdpa"] = ref[0]["ms"] / r["ms"]
            elif ref and "tokens_per_s" in r:
                r["x_full"] = r["tokens_per_s"] / ref[0]["tokens_per_s"]


# --- the plan (dry run) and the reports --------------------------------------------------------------------------


def plan() -> dict[str, Any]:
    """Every shape and step the check runs, with each model built on the meta device (no memory, no GPU)."""
    models = {}
    for kind in MODELS:
        cfg = model_config(kind)
        with torch.device("meta"):
            model = Transformer(cfg)
            ids = torch.zeros(1, TRAIN_T, dtype=torch.long)
            h = model.embed_tokens(ids)  # (1, T, d): the embedding and head shapes meet the config
            logits_shape = tuple(model.lm_head(h).shape)
        n = sum(p.numel() for p in model.parameters())
        if n != parameter_count(cfg) or logits_shape != (1, TRAIN_T, cfg.vocab_size):
            raise AssertionError(
                f"{kind}: meta model has {n} parameters / logits {logits_shape}, expected "
                f"{parameter_count(cfg)} / {(1, TRAIN_T, cfg.vocab_size)}"
            )
        models[kind] = {
            "attention": MODELS[kind],
            "parameters": n,
            "training_flops_per_token": flops_per_token(cfg, TRAIN_T).training,
            "train_input": [1, TRAIN_T],
            "train_logits": list(logits_shape),
            "decode": {"context": DECODE_CONTEXT, "new_tokens": DECODE_TOKENS},
        }
    topk, topk_geometry, topk_layouts = ATTENTION_TOPK
    attention = []
    for T in ATTENTION_T:
        cases = [(layout, ATTENTION_GEOMETRY, None) for layout in ATTENTION_LAYOUTS]
        for layout, geometry, k_sel in cases + [(layout, topk_geometry, topk) for layout in topk_layouts]:
            H, KV, D = bench.LAYOUTS[layout]
            W, S = bench.GEOMETRIES[geometry]
            E = T // S
            row = {
                "T": T,
                "layout": layout,
                "q": [1, T, H, D],
                "k_v": [1, T, KV, D],
                "kc_vc": [1, E, KV, D],
                "window": W,
                "stride": S,
                "local_window": bench.LOCAL_WINDOW,
                "topk": k_sel,
                "reference_gib": bench.reference_bytes(1, T, H, S) / 2**30,
            }
            if k_sel is None:
                row["pool_payload"] = [1, E, W, KV, D]
            else:
                row["selected"] = [1, T, k_sel]
            attention.append(row)
    return {
        "budgets_s": BUDGETS,
        "total_budget_s": TOTAL_BUDGET_S,
        "kernels": {
            "command": "pytest tests/kernels -q",
            "env": {"TRITON_INTERPRET": "0", "TRITON_F32_DEFAULT": "ieee"},
            "test_files": sorted(p.name for p in (ROOT / "tests" / "kernels").glob("test_*.py")),
        },
        "attention": attention,
        "models": models,
        "long_context": {
            "T": list(LONG_T),
            "ops": list(LONG_OPS),
            "op_inputs": {name: list(t.shape) for name, t in lc.op_inputs(LONG_T[0], False, device="meta").items()},
            "reference_gib": {T: lc.op_estimate_bytes("reference", T, True) / 2**30 for T in LONG_T},
            "train": list(lc.ATTENTIONS),
        },
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# GPU check ({report['meta']['device']})",
        "",
        "```json",
        json.dumps(report["meta"], indent=1),
        "```",
        "",
    ]
    for name, sec in report["sections"].items():
        lines += [f"## {name} ({sec['used_s']} s of {sec['budget_s']} s)", ""]
        if name == "attention":
            rows = [r for r in sec["items"] if "impl" in r]
            checks = [r for r in sec["items"] if "check" in r]
            if checks:
                lines += ["kernel vs reference (relative RMS): `" + json.dumps(checks[0]["check"]) + "`", ""]
            if rows:
                lines += [bench.table(rows), ""]
        else:
            for item in sec["items"]:
                lines.append("- " + ", ".join(f"{k}={_short(v)}" for k, v in item.items() if k != "tail"))
                if "tail" in item:
                    lines += ["", "```", item["tail"], "```"]
            lines.append("")
        for s in sec["skipped"]:
            lines.append(f"- skipped {s['item']}: {s['reason']}")
        lines.append("")
    return "\n".join(lines)


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "gpu_check", help="folder for report.json and report.md"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and check shapes on meta models only")
    p.add_argument("--sections", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
        "triton": bench.package_version("triton"),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "peak_bf16_flops": peak_flops(),
        "dry_run": args.dry_run,
    }
    the_plan = plan()
    if args.dry_run:
        report = {"meta": meta, "plan": the_plan}
        print(json.dumps(the_plan, indent=1))
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
        (args.out / "report.md").write_text(
            "# GPU check: dry run\n\n```json\n" + json.dumps(the_plan, indent=1) + "\n```\n"
        )
        return report
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --dry-run to check the plan on CPU)")
    device = torch.device("cuda")
    runners = {
        "kernels": lambda s: kernel_tests(s),
        "attention": lambda s: attention_benchmark(s, device),
        "training": lambda s: training(s, device),
        "decode": lambda s: decoding(s, device),
        "long_context": lambda s: long_context(s, device),
    }
    report = {"meta": meta, "plan": the_plan, "sections": {}}
    start = time.monotonic()
    for name in args.sections:
        left = TOTAL_BUDGET_S - (time.monotonic() - start)  # an overrunning item shortens the sections after it
        section = Section(name, min(BUDGETS[name], max(left, 0)))
        runners[name](section)
        report["sections"][name] = section.report()
        (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))  # partial results survive
    (args.out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
