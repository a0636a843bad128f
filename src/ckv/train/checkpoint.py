"""Atomic, resumable checkpoints of one run.

Layout under ``<run_dir>/checkpoints/``::

    step_00000100/
        engine/              DeepSpeed state: model, optimizer, LR scheduler (one shard file per rank under ZeRO)
        rank_00000.pt        per rank: data position and RNG states (python, numpy, torch, CUDA)
        weights/             consolidated fp32 weights in ``ckv.io.weights`` format (+ tokenizer.json), for analyses
        trainer_state.json   step, tokens seen, world size, time
    latest                   text file naming the newest complete checkpoint folder

A checkpoint is written into ``.tmp_step_XXXXXXXX`` and renamed into place only when every rank has finished;
the ``latest`` pointer is then replaced atomically. A process killed at any moment therefore leaves the previous
checkpoint intact and ``latest`` pointing at a complete folder. Old checkpoints are renamed to ``.trash_...``
before deletion, so a half-deleted folder never looks like a checkpoint. Leftovers are removed on the next start.
The run folder must be on a filesystem every rank sees. ``export_model`` writes ``<run_dir>/model/`` (the final
weights) the same way: into a temp folder, then renamed into place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from ckv.io.atomic import replace_dir, write_text_atomic
from ckv.io.layout import (
    CHECKPOINTS_DIR, LATEST_FILE, STATE_FILE, TMP_PREFIX, TOKENIZER_FILE, TRASH_PREFIX, WEIGHTS_DIR,
    CheckpointError, list_checkpoints, step_dir_name,
)
from ckv.io.weights import save_weights
from ckv.train.distributed import DistEnv, barrier

if TYPE_CHECKING:
    from ckv.model import Transformer
    from ckv.train.engine import Engine


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def capture_rng() -> dict[str, Any]:
    """Every RNG state a run uses (python, numpy, torch CPU and, when present, CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def export_model(model: Transformer, out: Path, tokenizer_path: Optional[str] = None) -> Path:
    """Write ``model``'s weights (and the tokenizer) to ``out`` as one complete folder."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_weights(model, tmp)
    if tokenizer_path:
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
    replace_dir(tmp, out)
    return out


class CheckpointManager:
    """Saves, loads and prunes the checkpoints of one run (collective calls: every rank calls them)."""

    def __init__(self, run_dir: Path, env: DistEnv, keep_last: int, keep_every: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.env = env
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.last_saved: Optional[tuple[int, Path]] = None  # (step, folder) saved or loaded by this process

    def clean_leftovers(self) -> None:
        """Remove temp and trash folders a killed process left behind (rank 0)."""
        if self.env.is_main and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    shutil.rmtree(p, ignore_errors=True)
        barrier()

    def save(self, engine: "Engine", step: int, trainer_state: dict[str, Any], rank_state: dict[str, Any],
             tokenizer_path: Optional[str] = None) -> Path:
        """Write checkpoint ``step`` atomically, point ``latest`` at it and prune old ones. Returns its folder.
        A step this process already saved or resumed from is not written again."""
        if self.last_saved is not None and self.last_saved[0] == step:
            return self.last_saved[1]
        final = self.root / step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        engine.save(tmp)
        torch.save({**rank_state, "rng": capture_rng()}, tmp / _rank_file(self.env.rank))
        with engine.full_module() as module:
            if self.env.is_main:
                save_weights(module, tmp / WEIGHTS_DIR)
                if tokenizer_path:
                    shutil.copyfile(tokenizer_path, tmp / WEIGHTS_DIR / TOKENIZER_FILE)
        barrier()
        if self.env.is_main:
            state = {**trainer_state, "step": step, "world_size": self.env.world_size, "time": time.time()}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            if final.exists():  # the same step saved again (e.g. by an earlier, interrupted invocation)
                os.rename(final, self.root / (TRASH_PREFIX + final.name))
            os.rename(tmp, final)
            write_text_atomic(self.root / LATEST_FILE, final.name + "\n")
            self._prune(keep=final)
            shutil.rmtree(self.root / (TRASH_PREFIX + final.name), ignore_errors=True)
        barrier()
        self.last_saved = (step, final)
        return final

    def _prune(self, keep: Path) -> None:
        found = list_checkpoints(self.run_dir)
        recent = {p for _, p in found[-self.keep_last:]}
        for step, path in found:
            if path in recent or path == keep or (self.keep_every and step % self.keep_every == 0):
                continue
            trash = self.root / (TRASH_PREFIX + path.name)
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def load(self, engine: "Engine", path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore engine state and this rank's RNG states from ``path``; returns ``(trainer_state, rank_state)``
        (the rank state holds the data position)."""
        state = json.loads((path / STATE_FILE).read_text())
        if state["world_size"] != self.env.world_size:
            raise CheckpointError(
                f"{path} was written by {state['world_size']} rank(s) but this run has {self.env.world_size}: the "
                "data positions are per rank, so resume with the same number of processes"
            )
        rank_file = path / _rank_file(self.env.rank)
        if not rank_file.is_file():
            raise CheckpointError(f"{path} has no {rank_file.name}: the checkpoint is incomplete")
        engine.load(path)
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        restore_rng(rank_state.pop("rng"))
        self.last_saved = (state["step"], path)
        return state, rank_state
