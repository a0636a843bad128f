"""What the ckv_kernels ops share: where kernels run (GPU or the Triton interpreter), input checks, and the
autotuning decorator (several configs on a GPU, exactly one under the interpreter, which cannot benchmark)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

# Read once, like @triton.jit itself: TRITON_INTERPRET must be set before ckv_kernels is imported.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_runnable(*tensors: torch.Tensor) -> None:
    """Raise a clear error unless every tensor is on one device where the kernels can run: a CUDA GPU, or the
    CPU with ``TRITON_INTERPRET=1`` set before ``ckv_kernels`` was imported."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    device = devices.pop()
    if device.type == "cuda" and not INTERPRET:
        return
    if device.type == "cpu" and INTERPRET:
        return
    if device.type == "cpu":
        raise RuntimeError(
            "ckv_kernels got CPU tensors, but Triton kernels run on CPU only under the interpreter: set "
            "TRITON_INTERPRET=1 before importing ckv_kernels (tests do), or use impl='torch'"
        )
    raise RuntimeError(f"ckv_kernels cannot run on device {device} (TRITON_INTERPRET={int(INTERPRET)})")


def check_float(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``t`` must be fp32/fp16/bf16 (and ``dtype`` when given)."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype} (all attention inputs share one dtype)")


def upcast_loads(dtype: torch.dtype) -> bool:
    """Whether kernels must convert loaded values to fp32: the interpreter reads bf16 as raw bits."""
    return INTERPRET and dtype == torch.bfloat16


def autotune(
    gpu_configs: Sequence[triton.Config],
    interpreter_config: triton.Config,
    key: list[str],
    prune: Callable[..., list[triton.Config]] | None = None,
) -> Callable[[Any], Any]:
    """``triton.autotune`` over ``gpu_configs`` on a GPU; under the interpreter the single
    ``interpreter_config`` (the interpreter can neither benchmark nor run several configs)."""
    if INTERPRET:
        return triton.autotune(configs=[interpreter_config], key=key)
    return triton.autotune(
        configs=list(gpu_configs), key=key, prune_configs_by={"early_config_prune": prune} if prune else None
    )
