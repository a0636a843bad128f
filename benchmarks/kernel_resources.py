"""Compile the joint-attention kernels for a GPU target without a GPU and report, per autotune config, the
registers, spills and shared memory ptxas assigns. A machine without a GPU can thus check that every kernel
variant compiles for Hopper and see which configs spill.

    python benchmarks/kernel_resources.py                      # sm_90, bf16, D 128, both head layouts
    python benchmarks/kernel_resources.py --kernels key-compressed --groups 16 --arch 90
    python benchmarks/kernel_resources.py --kernels select-fwd select-dq select-entry   # top-k selection

Needs triton's bundled ptxas; must run without TRITON_INTERPRET. Compiling takes seconds per config on a CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_resources.py compiles real kernels: run it without TRITON_INTERPRET")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention as _bench  # noqa: E402,F401  (makes ckv and ckv_kernels importable from a checkout)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ckv_kernels.attention_bwd import KEY_CONFIGS, key_kernel  # noqa: E402
from ckv_kernels.attention_fwd import QUERY_CONFIGS, query_kernel  # noqa: E402
from ckv_kernels.attention_select import (  # noqa: E402
    ENTRY_CONFIGS,
    SELECT_CONFIGS,
    select_entry_kernel,
    select_query_kernel,
)
from ckv_kernels.pool_kernel import VECTOR, pool_blocks, pool_kernel  # noqa: E402

INT_ARGS = (
    *("Tq", "Tk", "E", "KV", "K_SEL", "q_start", "k_start", "stride", "n_keys", "span", "chunk", "split_stride"),
    *("W", "D"),
)
INDEX_PTRS = {"SEL": "*i32", "COUNT": "*i32", "TOKENS": "*i32", "OFFSETS": "*i64"}  # top-k selection
POOL_LAUNCH = triton.Config({}, num_warps=4, num_stages=3)  # the pooling kernel is not autotuned: one launch shape
VARIANTS = {  # what --kernels names: the kernel and its GPU autotune configs
    "fwd": (query_kernel, QUERY_CONFIGS),
    "dq": (query_kernel, QUERY_CONFIGS),
    "key-compressed": (key_kernel, KEY_CONFIGS),
    "key-local": (key_kernel, KEY_CONFIGS),
    "select-fwd": (select_query_kernel, SELECT_CONFIGS),
    "select-dq": (select_query_kernel, SELECT_CONFIGS),
    "select-entry": (select_entry_kernel, ENTRY_CONFIGS),
    "pool-fwd": (pool_kernel, [POOL_LAUNCH]),
    "pool-bwd": (pool_kernel, [POOL_LAUNCH]),
}


def _ptxas_report(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        exe = get_ptxas(arch).path
    except TypeError:  # older triton: no arch argument
        exe = get_ptxas().path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    err = subprocess.run(
        [exe, "-v", "--gpu-name", gpu, f.name, "-o", os.devnull], capture_output=True, text=True
    ).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else 0}


def jit_function(kernel: str) -> triton.runtime.JITFunction:
    """The JIT function of a ``--kernels`` name (the autotuner wraps it)."""
    jit = VARIANTS[kernel][0]
    return jit.fn if isinstance(jit, triton.runtime.Autotuner) else jit


def variant_constexprs(kernel: str, G: int, D: int, config: triton.Config) -> dict:
    """The constexpr arguments of one variant: every one its kernel declares."""
    if kernel.startswith("pool"):  # vector gate over W = 8 offsets, the launcher's tile shape
        block_e, block_w, block_d = pool_blocks(8, D)
        return dict(GATE=VECTOR.value, BWD=kernel == "pool-bwd", BLOCK_E=block_e, BLOCK_W=block_w, BLOCK_D=block_d)
    constexprs = dict(G=G, G_PAD=triton.next_power_of_2(G), D=D, TAIL=False, UPCAST=False, **config.kwargs)
    if kernel == "select-entry":
        constexprs.pop("TAIL")
        return constexprs
    if kernel in ("select-fwd", "select-dq"):  # one position per program: G_PAD >= 16 rows
        return dict(
            constexprs, G_PAD=max(16, constexprs["G_PAD"]), LOCAL=True, BWD=kernel == "select-dq", HAS_SINK=False
        )
    if kernel in ("fwd", "dq"):  # without sinks, like the select variants
        return dict(constexprs, LOCAL=True, BWD=kernel == "dq", HAS_SINK=False)
    return dict(constexprs, COMPRESSED=kernel == "key-compressed")


def compile_variant(kernel: str, dtype: str, G: int, D: int, config: triton.Config, arch: int) -> dict:
    """Compile one kernel variant with one config; returns resources (or the error)."""
    jit = jit_function(kernel)
    ptr = "*" + dtype
    fp32_ptrs = ("LSE", "DELTA") + (("DKEY", "DVAL") if kernel == "key-compressed" else ())
    types = {
        name: (
            "i32"
            if name in INT_ARGS
            else "fp32"
            if name.endswith("scale")
            else "*fp32"
            if name in fp32_ptrs
            else "*u8"
            if name == "PRESENT"
            else INDEX_PTRS.get(name, ptr)
        )
        for name in jit.arg_names
    }
    constexprs = variant_constexprs(kernel, G, D, config)
    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in jit.arg_names}
    src = ASTSource(
        fn=jit, signature=signature, constexprs={(jit.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    start = time.time()
    try:
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", arch, 32),
            options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
        )
    except Exception as e:  # report and go on: a config that does not compile is pruned by the autotuner too
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    return {
        **_ptxas_report(compiled.asm["ptx"], arch),
        "shared_bytes": compiled.metadata.shared,
        "compile_s": round(time.time() - start, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["fwd", "dq", "key-compressed", "key-local"],
        choices=list(VARIANTS),
    )
    p.add_argument("--groups", type=int, nargs="+", default=[2, 16], help="GQA ratios H/KV (Qwen3-0.6B: 2; paper: 16)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = p.parse_args()
    print(f"command: python benchmarks/kernel_resources.py {' '.join(sys.argv[1:])}  (triton {triton.__version__})")
    print("kernel | G | BLOCK_M | BLOCK_N | warps | stages | registers | spill bytes | shared KiB")
    print(" | ".join(["---"] * 9))
    for kernel in args.kernels:
        configs = VARIANTS[kernel][1]
        groups = [1] if kernel.startswith("pool") else args.groups  # pooling has no GQA
        for G in groups:
            for config in configs:
                if config.kwargs.get("BLOCK_M", 64) < triton.next_power_of_2(G):
                    continue
                r = compile_variant(kernel, args.dtype, G, args.head_dim, config, args.arch)
                blocks = (
                    ["-", "-"]
                    if kernel.startswith("pool")
                    else [str(config.kwargs.get(b, "-")) for b in ("BLOCK_M", "BLOCK_N")]
                )
                cells = [kernel, str(G), *blocks, str(config.num_warps), str(config.num_stages)]
                if "error" in r:
                    cells += [r["error"], "", ""]
                else:
                    cells += [str(r["registers"]), str(r["spill_bytes"]), f"{r['shared_bytes'] / 1024:.0f}"]
                print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
