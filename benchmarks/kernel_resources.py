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
import importlib
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

import ckv_kernels.attention as A  # noqa: E402

P = importlib.import_module("ckv_kernels.pool")  # the module (the package re-exports a function of that name)

INT_ARGS = (
    *("Tq", "Tk", "E", "KV", "K_SEL", "q_start", "k_start", "stride", "n_keys", "span", "chunk", "split_stride"),
    *("W", "D"),
)
INDEX_PTRS = {"SEL": "*i32", "COUNT": "*i32", "TOKENS": "*i32", "OFFSETS": "*i64"}  # top-k selection
SELECT = ("select-fwd", "select-dq", "select-entry")


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


def _constexprs(kernel: str, G: int, D: int, config: triton.Config) -> dict:
    if kernel.startswith("pool"):  # vector gate over W = 8 offsets, the launcher's tile shape
        block_e = max(1, P._TILE_ELEMENTS // (8 * triton.next_power_of_2(D)))
        return dict(
            GATE=P.VECTOR.value, BWD=kernel == "pool-bwd", BLOCK_E=block_e, BLOCK_W=8, BLOCK_D=triton.next_power_of_2(D)
        )
    constexprs = dict(G=G, G_PAD=triton.next_power_of_2(G), D=D, TAIL=False, UPCAST=False, **config.kwargs)
    if kernel == "select-entry":
        constexprs.pop("TAIL")
        return constexprs
    if kernel in ("select-fwd", "select-dq"):  # one position per program: G_PAD >= 16 rows
        return dict(
            constexprs, G_PAD=max(16, constexprs["G_PAD"]), LOCAL=True, BWD=kernel == "select-dq", HAS_SINK=False
        )
    if kernel in ("fwd", "dq"):
        return dict(constexprs, LOCAL=True, BWD=kernel == "dq")
    return dict(constexprs, COMPRESSED=kernel == "key-compressed")


def compile_variant(kernel: str, dtype: str, G: int, D: int, config: triton.Config, arch: int) -> dict:
    """Compile one kernel variant with one config; returns resources (or the error)."""
    jit = {
        "fwd": A._query_kernel,
        "dq": A._query_kernel,
        "key-compressed": A._key_kernel,
        "key-local": A._key_kernel,
        "select-fwd": A._select_query_kernel,
        "select-dq": A._select_query_kernel,
        "select-entry": A._select_entry_kernel,
    }.get(kernel, P._pool_kernel)
    if isinstance(jit, triton.runtime.Autotuner):  # the autotuner wraps the JIT function
        jit = jit.fn
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
    constexprs = _constexprs(kernel, G, D, config)
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
        choices=["fwd", "dq", "key-compressed", "key-local", *SELECT, "pool-fwd", "pool-bwd"],
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
        configs = {
            "fwd": A._QUERY_CONFIGS,
            "dq": A._QUERY_CONFIGS,
            "select-fwd": A._SELECT_CONFIGS,
            "select-dq": A._SELECT_CONFIGS,
            "select-entry": A._ENTRY_CONFIGS,
        }.get(kernel, A._KEY_CONFIGS)
        if kernel.startswith("pool"):  # no autotuning, no GQA: one launch shape
            configs, groups = [triton.Config({"BLOCK_M": 1, "BLOCK_N": 0}, num_warps=4, num_stages=3)], [1]
        else:
            groups = args.groups
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
