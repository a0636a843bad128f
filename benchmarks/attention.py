"""Side-by-side timing of the compressed attention path against full causal attention, in one run.

For each sequence length T, head layout (Qwen3-0.6B: 16 query heads / 8 KV heads; the paper's: 16 / 1; head
dim 128) and compressor geometry (W8/S8, W8/S4; 16-token local window) it times forward and forward+backward of
- ``triton``: the joint-attention kernel (``ckv_kernels.joint_attention``),
- ``pool``: the pooling kernel for keys and values (scalar gate), i.e. what the compressor adds,
- ``reference``: the PyTorch reference (``joint_attention_reference``), skipped where it would not fit in memory,
- ``full``: full causal attention (flash-attn when installed, else SDPA), once per (T, layout),
- with ``--topk K`` (default 512 on CUDA, 64 on CPU; 0: none) ``triton`` and ``reference`` again with top-k
  selection: each position attends to K of its visible entries (spread over them, ``spread_selection``),
with achieved TFLOP/s (useful matmul FLOPs: 4*D per visible (query, key) pair and head, selected entries only
under top-k; backward 2.5x forward), peak memory (CUDA only) and speed-ups against full attention and the
reference (of the same selection). Prints a table and writes JSON (default under ``outputs/benchmarks/``).

    python benchmarks/attention.py                 # CUDA: T in 4K..128K; CPU: a CPU-sized set (> 6 min on 2 cores)
    python benchmarks/attention.py --quick         # a small set (CPU: seconds)
    TRITON_INTERPRET=1 python benchmarks/attention.py --quick   # CPU, also runs the kernels (interpreted: slow)

Each finished case prints ``[i/N]`` with the elapsed time and an ETA.

Needs only torch, triton and numpy (runs from a source checkout without installing ckv).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _import_project() -> None:
    """Make ``ckv`` and ``ckv_kernels`` importable from a source checkout (the GPU image has no ckv install)."""
    try:
        import ckv  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "src"))
    try:
        import ckv_kernels  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "kernels"))  # kernels/ckv_kernels: the package itself (kernels/ is no package)


_import_project()

import ckv_kernels  # noqa: E402
from ckv.attention.reference import joint_attention_reference  # noqa: E402
from ckv.geometry import local_span, local_start, num_entries, window_positions  # noqa: E402

LAYOUTS = {"qwen3": (16, 8, 128), "paper": (16, 1, 128)}  # query heads, KV heads, head dim
GEOMETRIES = {"w8s8": (8, 8), "w8s4": (8, 4)}  # window, stride
LOCAL_WINDOW = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUDA_T = (4096, 16384, 65536, 131072)
CPU_T = (512, 1024, 2048, 4096)
QUICK_T = {"cuda": (4096, 16384), "cpu": (256, 512)}
TOPK = {"cuda": 512, "cpu": 64}  # DeepSeek-V4-Flash's index_topk; on CPU one that binds from 512 tokens at S = 4
INTERPRETER_MAX_T = 256  # the Triton interpreter runs the kernels on CPU only at toy sizes
INTERPRETER_MAX_T_TOPK = 64  # and the top-k kernels (one program per position) at smaller ones still
OUT_DIR = ROOT / "outputs" / "benchmarks"  # default JSON folder (git-ignored: a run never rewrites a tracked file)


def joint_flops(T: int, heads: int, head_dim: int, stride: int, local_window, topk: Optional[int] = None) -> float:
    """Forward matmul FLOPs of joint attention over a whole sequence: 4*D per visible (query, key) pair (with
    ``topk``, at most ``topk`` entries per query)."""
    t = torch.arange(T, dtype=torch.float64)
    entries = torch.clamp(torch.div(t + 1, stride, rounding_mode="floor"), max=num_entries(T, stride))
    entries = (entries if topk is None else entries.clamp(max=topk)).sum()
    local = (t - torch.clamp(local_start(t, local_window, stride), min=0) + 1).clamp(min=0).sum()
    return 4.0 * head_dim * heads * float(entries + local)


def causal_flops(T: int, heads: int, head_dim: int) -> float:
    return 4.0 * head_dim * heads * T * (T + 1) / 2


def _flash():
    try:
        from flash_attn import flash_attn_func  # type: ignore

        return flash_attn_func
    except Exception:
        return None


def full_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full causal GQA attention, (B, T, H|KV, D) layout: flash-attn when installed (CUDA, fp16/bf16), else SDPA.
    On CUDA SDPA takes native GQA with its math backend excluded (it would materialise T x T); K/V are repeated
    per group where no fused backend takes native GQA, and always on CPU, whose GQA backward is pathologically
    slow with one KV head (7 s instead of 0.24 s at T=512, 16 heads, torch 2.13)."""
    flash = _flash()
    if flash is not None and q.is_cuda and q.dtype != torch.float32:
        return flash(q, k, v, causal=True)
    G = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if not q.is_cuda:
        kt, vt = kt.repeat_interleave(G, dim=1), vt.repeat_interleave(G, dim=1)
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        try:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        except RuntimeError:  # no fused backend with native GQA for this dtype
            kt, vt = kt.repeat_interleave(G, dim=1), vt.repeat_interleave(G, dim=1)
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return out.transpose(1, 2)


def full_backend(device: torch.device, dtype: torch.dtype) -> str:
    return "flash-attn" if _flash() is not None and device.type == "cuda" and dtype != torch.float32 else "sdpa"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA: synchronised around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(
    forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor], device: torch.device, repeats: int, warmup: int
) -> dict:
    """Forward and forward+backward time (ms) and, on CUDA, the peak memory of forward+backward above the inputs."""
    out = forward()
    grad = torch.randn_like(out)

    def fwd_bwd() -> None:
        torch.autograd.grad(forward(), inputs, grad)

    with torch.no_grad():
        fwd = time_ms(forward, device, repeats, warmup)
    both = time_ms(fwd_bwd, device, repeats, warmup)
    peak = None
    if device.type == "cuda":
        del out
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        sync(device)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "peak_mib": peak}


def free_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            return float(next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))) * 1024
    except (OSError, StopIteration):
        return 8e9


def reference_bytes(B: int, T: int, H: int, stride: int) -> float:
    """Rough fp32 working set of the reference's forward+backward: ~8 copies of the (T, E + L) score matrix."""
    return 8.0 * 4 * B * H * T * (num_entries(T, stride) + local_span(LOCAL_WINDOW, stride))


def leaf(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype).requires_grad_()


def spread_selection(B: int, T: int, E: int, K: int, stride: int, device: torch.device) -> torch.Tensor:
    """(B, T, K) int64 top-k selection without scoring (T, E): a position seeing ``n > K`` entries takes one at
    random from each of K consecutive, disjoint runs of ``n // K`` or more entries (all distinct, spread over its
    whole past, the scattered reads an indexer causes); one seeing ``n <= K`` takes all of them, -1 after."""
    n = torch.clamp((torch.arange(T, device=device) + 1) // stride, max=E)[None, :, None]  # (1, T, 1)
    j = torch.arange(K, device=device)[None, None, :]  # (1, 1, K)
    lo, hi = j * n // K, (j + 1) * n // K  # runs of width >= 1 where n >= K
    spread = lo + (torch.rand(B, T, K, device=device) * (hi - lo)).long()
    return torch.where(n > K, spread, torch.where(j < n, j, -1)).expand(B, T, K).contiguous()


def run_case(
    T: int,
    layout: str,
    geometry: str,
    args,
    device: torch.device,
    dtype: torch.dtype,
    kernels: bool,
    full: Optional[dict],
    topk: Optional[int] = None,
) -> list[dict]:
    """Rows for one (T, layout, W/S): triton, pool, triton+pool, reference; with ``topk``, triton and reference
    under top-k selection (``spread_selection``). Ratios against ``full`` and the case's reference."""
    H, KV, D = LAYOUTS[layout]
    W, S = GEOMETRIES[geometry]
    B, E = args.batch, num_entries(T, S)
    q = leaf((B, T, H, D), device, dtype)
    k, v = leaf((B, T, KV, D), device, dtype), leaf((B, T, KV, D), device, dtype)
    kc, vc = leaf((B, E, KV, D), device, dtype), leaf((B, E, KV, D), device, dtype)
    ins = [q, kc, vc, k, v]
    selected = None if topk is None else spread_selection(B, T, E, topk, S, device)
    flops = joint_flops(T, H, D, S, LOCAL_WINDOW, topk) * B
    base = {
        "T": T,
        "layout": layout,
        "H": H,
        "KV": KV,
        "D": D,
        "window": W,
        "stride": S,
        "local_window": LOCAL_WINDOW,
        "topk": topk,
    }
    rows = []

    def add(impl: str, m: dict, f: Optional[float]) -> None:
        row = {**base, "impl": impl, **m}
        if f is not None:
            row["fwd_tflops"] = f / m["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = 3.5 * f / m["fwd_bwd_ms"] / 1e9
        rows.append(row)

    if kernels:
        span = local_span(LOCAL_WINDOW, S)
        attn = measure(
            lambda: ckv_kernels.joint_attention(*ins, stride=S, local_span=span, selected=selected)[0],
            ins,
            device,
            args.repeats,
            args.warmup,
        )
        add("triton", attn, flops)
    if kernels and topk is None:  # the compressor's cost does not depend on the selection
        _, present = window_positions(0, E, W, S, device=device)
        payloads = [leaf((B, E, W, KV, D), device, dtype) for _ in range(2)]
        logits = [leaf((B, E, W, KV, 1), device, dtype) for _ in range(2)]
        pool_ins = payloads + logits

        def pool_kv() -> torch.Tensor:
            return sum(ckv_kernels.pool(p, g, present)[0] for p, g in zip(payloads, logits))

        pooled = measure(pool_kv, pool_ins, device, args.repeats, args.warmup)
        add("pool(k+v)", pooled, None)
        add(
            "triton+pool",
            {
                "fwd_ms": attn["fwd_ms"] + pooled["fwd_ms"],
                "fwd_bwd_ms": attn["fwd_bwd_ms"] + pooled["fwd_bwd_ms"],
                "peak_mib": None if attn["peak_mib"] is None else max(attn["peak_mib"], pooled["peak_mib"]),
            },
            flops,
        )
    need = reference_bytes(B, T, H, S)
    if need < 0.7 * free_bytes(device):
        try:
            add(
                "reference",
                measure(
                    lambda: joint_attention_reference(*ins, stride=S, local_window=LOCAL_WINDOW, selected=selected)[0],
                    ins,
                    device,
                    args.repeats,
                    args.warmup,
                ),
                flops,
            )
        except torch.cuda.OutOfMemoryError:
            rows.append({**base, "impl": "reference", "skipped": "out of memory"})
    else:
        rows.append({**base, "impl": "reference", "skipped": f"needs ~{need / 2**30:.0f} GiB"})
    ref = next((r for r in rows if r["impl"] == "reference" and "fwd_bwd_ms" in r), None)
    for row in rows:
        if "fwd_tflops" not in row:  # skipped, or the pooling alone
            continue
        if full is not None:
            row["x_full_fwd"] = full["fwd_ms"] / row["fwd_ms"]
            row["x_full_fwd_bwd"] = full["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        if ref is not None and row is not ref:
            row["x_reference_fwd_bwd"] = ref["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return rows


def run_full(T: int, layout: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    H, KV, D = LAYOUTS[layout]
    q = leaf((args.batch, T, H, D), device, dtype)
    k, v = leaf((args.batch, T, KV, D), device, dtype), leaf((args.batch, T, KV, D), device, dtype)
    m = measure(lambda: full_causal(q, k, v), [q, k, v], device, args.repeats, args.warmup)
    f = causal_flops(T, H, D) * args.batch
    return {
        "T": T,
        "layout": layout,
        "H": H,
        "KV": KV,
        "D": D,
        "impl": f"full ({full_backend(device, dtype)})",
        **m,
        "fwd_tflops": f / m["fwd_ms"] / 1e9,
        "fwd_bwd_tflops": 3.5 * f / m["fwd_bwd_ms"] / 1e9,
    }


def check(device: torch.device, dtype: torch.dtype, topk: Optional[int] = None) -> list[dict]:
    """Kernel vs reference at a small size before timing: relative RMS error of the output and each gradient, per
    layout and geometry; with ``topk``, also under top-k selection (W8/S4, a shorter length on CPU: the interpreter
    runs one program per position there)."""
    cases = [(layout, geometry, None) for layout in LAYOUTS for geometry in GEOMETRIES]
    if topk:
        cases += [(layout, "w8s4", topk) for layout in LAYOUTS]
    out = []
    for layout, geometry, k_sel in cases:
        H, KV, D = LAYOUTS[layout]
        S = GEOMETRIES[geometry][1]
        T = 1000 if device.type == "cuda" else (100 if k_sel is None else 32)
        K = None if k_sel is None else min(k_sel, max(1, T // S // 4))  # binding: a quarter of the entries at most
        ins = [
            leaf(s, device, dtype)
            for s in ((1, T, H, D), (1, T // S, KV, D), (1, T // S, KV, D), (1, T, KV, D), (1, T, KV, D))
        ]
        selected = None if K is None else spread_selection(1, T, T // S, K, S, device)
        o = ckv_kernels.joint_attention(*ins, stride=S, local_span=local_span(LOCAL_WINDOW, S), selected=selected)[0]
        g = torch.randn_like(o)
        got = [o, *torch.autograd.grad(o, ins, g)]
        ref_ins = [x.detach().float().requires_grad_() for x in ins]
        r = joint_attention_reference(*ref_ins, stride=S, local_window=LOCAL_WINDOW, selected=selected)[0]
        want = [r, *torch.autograd.grad(r, ref_ins, g.float())]
        errs = [((a.float() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item() for a, b in zip(got, want)]
        row = {"layout": layout, "geometry": geometry, "T": T, "topk": K}
        out.append({**row, **dict(zip(("out", "dq", "dkc", "dvc", "dk", "dv"), errs))})
    return out


def fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: list[dict]) -> str:
    head = (
        "T",
        "layout",
        "W/S",
        "top-k",
        "impl",
        "fwd ms",
        "f+b ms",
        "fwd TF/s",
        "f+b TF/s",
        "peak MiB",
        "x full f+b",
        "x ref f+b",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        ws = f"W{r['window']}/S{r['stride']}" if "stride" in r else "-"
        topk = "-" if r.get("topk") is None else str(r["topk"])
        if "skipped" in r:
            cells = [str(r["T"]), r["layout"], ws, topk, r["impl"], f"skipped: {r['skipped']}"] + [""] * 6
        else:
            cells = [
                str(r["T"]),
                r["layout"],
                ws,
                topk,
                r["impl"],
                fmt(r["fwd_ms"], ".3g"),
                fmt(r["fwd_bwd_ms"], ".3g"),
                fmt(r.get("fwd_tflops"), ".3g"),
                fmt(r.get("fwd_bwd_tflops"), ".3g"),
                fmt(r.get("peak_mib"), ".0f"),
                fmt(r.get("x_full_fwd_bwd"), ".2f"),
                fmt(r.get("x_reference_fwd_bwd"), ".2f"),
            ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


class Progress:
    """One line per finished case: ``[i/N]``, elapsed time and an ETA that weights each case by ``T**2``
    (attention's cost grows with it, so the long cases at the end take most of the time)."""

    def __init__(self, lengths: list[int]) -> None:
        self.weights, self.total, self.count, self.t0 = [T * T for T in lengths], len(lengths), 0, time.perf_counter()

    def done(self, what: str) -> None:
        self.count += 1
        elapsed = time.perf_counter() - self.t0
        left = sum(self.weights[self.count :]) / sum(self.weights[: self.count]) * elapsed
        print(f"[{self.count}/{self.total}] done: {what} | elapsed {elapsed:.0f} s, eta ~{left:.0f} s", flush=True)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small set of lengths")
    p.add_argument("--T", type=int, nargs="+", help="sequence lengths (default: by device)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, help="timed calls per measurement (median); default 10 CUDA, 5 CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--topk",
        type=int,
        help="top-k selection rows with K entries per position (0: none); default "
        f"{TOPK['cuda']} on CUDA, {TOPK['cpu']} on CPU",
    )
    p.add_argument("--no-check", action="store_true", help="skip the kernel-vs-reference check before timing")
    p.add_argument(
        "--json", type=Path, help=f"output file (default {OUT_DIR.relative_to(ROOT)}/attention_<device>.json)"
    )
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not ckv_kernels.INTERPRET else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    args.repeats = args.repeats or (10 if device.type == "cuda" else 5)
    lengths = args.T or (QUICK_T[device.type] if args.quick else (CUDA_T if device.type == "cuda" else CPU_T))
    topk = TOPK[device.type] if args.topk is None else args.topk
    if topk < 0:
        p.error(f"--topk={topk} must be >= 0 (0: no top-k rows)")
    meta = {
        "command": "python " + " ".join([str(Path(sys.argv[0]))] + (argv if argv is not None else sys.argv[1:])),
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"cpu ({platform.processor() or 'x86_64'}, {torch.get_num_threads()} threads)",
        "interpreter": ckv_kernels.INTERPRET,
        "dtype": str(dtype).replace("torch.", ""),
        "batch": args.batch,
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "full_backend": full_backend(device, dtype),
        "repeats": args.repeats,
        "topk": topk or None,
        "flops": "4*D per visible (query, key) pair and head (selected entries only under top-k); fwd+bwd = 3.5x fwd",
    }
    print(json.dumps(meta))
    result = {"meta": meta, "check": [], "rows": []}
    if not args.no_check and (device.type == "cuda" or ckv_kernels.INTERPRET):
        result["check"] = check(device, dtype, topk or None)
        print("kernel vs reference (rel RMS):", json.dumps(result["check"]))
    per_t = len(args.layouts) * len(args.geometries) * (2 if topk else 1)
    progress = Progress([T for T in lengths for _ in range(per_t)])
    print(f"{progress.total} cases (T in {lengths}; --quick: a small set)", flush=True)
    for T in lengths:
        kernels = device.type == "cuda" or (ckv_kernels.INTERPRET and T <= INTERPRETER_MAX_T)
        for layout in args.layouts:
            full = run_full(T, layout, args, device, dtype)
            result["rows"].append(full)
            for geometry in args.geometries:
                result["rows"].extend(run_case(T, layout, geometry, args, device, dtype, kernels, full))
                progress.done(f"T={T} {layout} {geometry}")
                if topk:
                    kernels_topk = device.type == "cuda" or (ckv_kernels.INTERPRET and T <= INTERPRETER_MAX_T_TOPK)
                    result["rows"].extend(run_case(T, layout, geometry, args, device, dtype, kernels_topk, full, topk))
                    progress.done(f"T={T} {layout} {geometry} top-{topk}")
    print(table(result["rows"]))
    out = args.json or OUT_DIR / f"attention_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


def package_version(name: str) -> Optional[str]:
    """``name.__version__``, or None when the package does not import."""
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
