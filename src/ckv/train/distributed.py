"""Process-group set-up for every way a run starts, and the few collectives the loop needs.

- ``deepspeed --no_local_rank train.py`` / ``torchrun``: the launcher sets ``RANK``, ``WORLD_SIZE``, ... .
- a SLURM task (``hydra/launcher=slurm``): the variables are exported from the SLURM environment via submitit.
- plain ``python train.py``: single-process defaults (rank 0 of 1, a free local port), so that DeepSpeed needs no
  launcher and no MPI.
Every case then goes through the same ``deepspeed.init_distributed`` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from ckv.config import ConfigError

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistEnv:
    """Where this process sits in the job and which device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_vars() -> dict[str, str]:
    """Rank variables to set for this process (empty when a launcher already set them)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [v for v in RANK_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(f"the launcher set RANK/WORLD_SIZE but not {missing}; launch with deepspeed or torchrun")
        return {}
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        try:
            from submitit.helpers import TorchDistributedEnvironment
        except ImportError as e:
            raise RuntimeError(
                "a multi-task SLURM job needs submitit (pip install hydra-submitit-launcher) to find "
                "its ranks; or launch each node with torchrun"
            ) from e
        env = TorchDistributedEnvironment()
        return {
            "RANK": str(env.rank),
            "WORLD_SIZE": str(env.world_size),
            "LOCAL_RANK": str(env.local_rank),
            "MASTER_ADDR": env.master_addr,
            "MASTER_PORT": str(env.master_port),
        }
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }


def import_deepspeed(device: str) -> ModuleType:
    """Import DeepSpeed with the accelerator for ``device`` (``cpu`` or ``cuda``); a clear error when missing.

    On CPU, DeepSpeed's shared-memory collective op is marked unavailable so that a fresh machine does not compile
    it (~50 s) before its first run: every collective goes through gloo, which is all CPU runs need."""
    want = "cpu" if device == "cpu" else "cuda"
    chosen = os.environ.setdefault("DS_ACCELERATOR", want)
    if chosen != want:
        raise ConfigError(f"DS_ACCELERATOR={chosen} does not match trainer.device={device}; unset DS_ACCELERATOR")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        raise ImportError("training needs DeepSpeed: pip install 'ckv[deepspeed]' (deepspeed>=0.15)") from e
    if get_accelerator().device_name() != want:
        raise RuntimeError(
            f"DeepSpeed already runs on {get_accelerator().device_name()!r} in this process; "
            f"a {want} run needs a fresh process"
        )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if want == "cpu":
        import deepspeed.ops

        # the first access probes every op; the libaio probe's compiler calls are logged at INFO on the root logger
        # (distutils), which Hydra prints to stdout: two stray "gcc ... -laio" lines. Warnings and errors still show.
        root = logging.getLogger()
        level = root.level
        root.setLevel(max(level, logging.WARNING))
        try:
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        finally:
            root.setLevel(level)
    return deepspeed


_clean_exit = True  # False after a run failed: another rank may be gone, so the exit skips the barrier


def _shutdown() -> None:
    if dist.is_initialized():
        if _clean_exit:
            dist.barrier()
        dist.destroy_process_group()


@contextmanager
def distributed(device: torch.device) -> Iterator[DistEnv]:
    """The process group for ``device`` (CPU or CUDA, from ``ckv.device.resolve_device``), initialised on first
    use and kept for the life of the process (DeepSpeed caches its groups, so several runs in one process — Hydra
    multirun, tests — share it). At exit every rank waits at a barrier, then destroys the group, so that no rank leaves
    while another still
    talks to it; after a failed run the barrier is skipped."""
    global _clean_exit
    if not dist.is_initialized():
        os.environ.update(_launcher_vars())
    rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    deepspeed = import_deepspeed(dev.type)
    if not dist.is_initialized():
        deepspeed.init_distributed(verbose=False)
        atexit.register(_shutdown)
    try:
        yield DistEnv(rank=rank, world_size=world, local_rank=local, device=dev)
    except BaseException:
        _clean_exit = False
        raise


def all_reduce_mean(values: list[float], device: torch.device) -> list[float]:
    """Mean of each value over all ranks (float64, so that sums of many losses stay accurate)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Maximum of each value over all ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def strip_local_rank_arg(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local_rank N`` (appended by the deepspeed launcher without
    ``--no_local_rank``) into ``$LOCAL_RANK``; Hydra would reject it. Returns the cleaned argv."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
        elif a in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            out.append(a)
        i += 1
    return out
