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
checkpoint intact and ``latest`` pointing at a complete folder. Every file is fsync'ed before the rename. Old
checkpoints are renamed to ``.trash_...`` before deletion, so a half-deleted folder never looks like a checkpoint.
Leftovers are removed on the next start. The run folder must be on a filesystem every rank sees.
``export_model`` writes ``<run_dir>/model/`` (the final weights) the same way: into a temp folder, then renamed.

Before a resume, ``verify_checkpoint`` reads every file of the checkpoint (the CRCs of the ``torch.save`` zip
archives, the JSON of ``trainer_state.json``, the consolidated ``weights/`` in full), so damage is reported with the
file's path, not as a traceback from inside DeepSpeed, nor passed over by a rerun of a finished run.
``trainer.resume=fallback`` then resumes from the newest intact checkpoint and moves the damaged newer ones aside to
``damaged_step_XXXXXXXX`` (nothing is deleted). ``export_model`` reads the final weights back in full before they
replace ``model/``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from ckv.data.prepare import sha256_file
from ckv.io.atomic import fsync_file, fsync_tree, replace_dir, write_text_atomic
from ckv.io.layout import (
    CHECKPOINTS_DIR,
    DAMAGED_PREFIX,
    LATEST_FILE,
    STATE_FILE,
    TMP_PREFIX,
    TOKENIZER_FILE,
    TRASH_PREFIX,
    WEIGHTS_DIR,
    CheckpointError,
    damaged,
    latest_checkpoint,
    list_checkpoints,
    read_json_file,
    step_dir_name,
)
from ckv.io.weights import NonFiniteWeightsError, check_finite, is_weights_dir, save_weights, verify_weights
from ckv.train.distributed import DistEnv, barrier
from ckv.train.engine import ENGINE_TAG, Engine

if TYPE_CHECKING:
    from ckv.model import Transformer


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _check_archive(path: Path) -> None:
    """Read a ``torch.save`` file in full: a zip archive (the default format) has every member's CRC checked, any
    other file (DeepSpeed's ``checkpoint.serialization: false``) is unpickled. A truncated, zero-filled or
    overwritten file fails with its path."""
    try:
        if not zipfile.is_zipfile(path):
            torch.load(path, map_location="cpu", weights_only=False)
            return
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception as e:  # unpickling a damaged file can raise almost anything; all of it means "damaged"
        raise damaged(path, f"{type(e).__name__}: {e}") from e
    if bad is not None:
        raise damaged(path, f"its member {bad!r} fails its checksum")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of checkpoint folder ``path``, checked to hold the step, tokens and world size."""
    file = path / STATE_FILE
    try:
        state = read_json_file(file)
    except FileNotFoundError as e:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from e
    if not isinstance(state, dict) or not all(isinstance(state.get(k), int) for k in ("step", "tokens", "world_size")):
        raise damaged(file, "it does not hold integer step, tokens and world_size")
    return state


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Read every file of checkpoint folder ``path`` (``trainer_state.json``, the engine's and each rank's
    ``torch.save`` archives, the consolidated ``weights/`` that evaluation and export read) and raise
    ``CheckpointError`` naming the first damaged or missing one. Returns the trainer state."""
    state = read_trainer_state(path)
    engine_files = sorted((path / ENGINE_TAG).rglob("*.pt")) if (path / ENGINE_TAG).is_dir() else []
    if not engine_files:
        raise CheckpointError(f"{path / ENGINE_TAG} is missing or holds no engine state files")
    rank_files = [path / _rank_file(r) for r in range(state["world_size"])]
    for f in rank_files:
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint is incomplete")
    for f in engine_files + rank_files:
        _check_archive(f)
    weights = path / WEIGHTS_DIR
    if not is_weights_dir(weights):
        raise CheckpointError(f"{weights} is missing or incomplete: the checkpoint is incomplete")
    try:
        verify_weights(weights, "")
    except NonFiniteWeightsError as e:
        raise damaged(weights, str(e)) from e
    return state


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


def _check_tokenizer(saved: Path, current: Optional[str]) -> None:
    """CheckpointError when the tokenizer a checkpoint saved (``saved``) is not the data's now (``current``): its
    token ids would mean other tokens (a corpus prepared again with another tokenizer)."""
    if current is None or not saved.is_file():
        return
    old, new = sha256_file(str(saved)), sha256_file(current)
    if old != new:
        raise CheckpointError(
            f"{saved.parents[1]} was trained with tokenizer sha256 {old[:12]} and the data now has {new[:12]} "
            f"({current}): its token ids mean other tokens; resume with data prepared with the saved tokenizer "
            f"({saved}), or train a new run (another out_dir or name)"
        )


def export_model(model: Transformer, out: Path, tokenizer_path: Optional[str] = None) -> Path:
    """Write ``model``'s weights (and the tokenizer) to ``out`` as one complete folder, read back in full
    (``verify_weights``) before it replaces the old one."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_weights(model, tmp)
    if tokenizer_path:
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        fsync_file(tmp / TOKENIZER_FILE)
    verify_weights(tmp, f"the final weights could not be written to {out}: check the disk and train.py again")
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

    def save(
        self,
        engine: Engine,
        step: int,
        trainer_state: dict[str, Any],
        rank_state: dict[str, Any],
        tokenizer_path: Optional[str] = None,
    ) -> Path:
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
            fsync_tree(tmp)
            state = {**trainer_state, "step": step, "world_size": self.env.world_size, "time": time.time()}
            write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=2))
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
        recent = {p for _, p in found[-self.keep_last :]}
        for step, path in found:
            if path in recent or path == keep or (self.keep_every and step % self.keep_every == 0):
                continue
            trash = self.root / (TRASH_PREFIX + path.name)
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def resume_point(self, policy: str) -> tuple[Optional[Path], list[str]]:
        """The checkpoint to resume from (``None``: a fresh run) and the damage found on the way, as messages
        (collective: every rank calls it and reaches the same answer).

        ``policy`` is ``trainer.resume``. The newest checkpoint (``latest``) is verified first. If it is damaged,
        ``"strict"`` raises a ``CheckpointError`` naming the damaged file; ``"fallback"`` takes the newest intact
        older checkpoint, moves the damaged newer ones aside (``damaged_step_...``) and points ``latest`` at it."""
        damage: list[str] = []
        candidates: list[Path] = []
        try:
            pointed = latest_checkpoint(self.run_dir)
        except CheckpointError as e:
            damage.append(str(e))
            pointed = None
        if pointed is not None:
            candidates.append(pointed)
        candidates += [p for _, p in reversed(list_checkpoints(self.run_dir)) if p != pointed]
        damaged: list[Path] = []
        chosen: Optional[Path] = None
        for path in candidates:
            try:
                verify_checkpoint(path)
            except CheckpointError as e:
                damage.append(str(e))
                damaged.append(path)
                continue
            chosen = path
            break
        if not damage:
            return chosen, []
        if policy == "strict" or chosen is None:
            if chosen is None:
                hint = "no intact checkpoint is left to fall back to: train into a new run folder"
            else:
                hint = (
                    f"resume from the newest intact checkpoint, {chosen.name}, with trainer.resume=fallback (it "
                    "moves the damaged ones aside, deleting nothing)"
                )
            raise CheckpointError(f"cannot resume {self.run_dir}: {damage[0]}; {hint}")
        barrier()
        if self.env.is_main:
            for path in damaged:
                os.rename(path, path.with_name(DAMAGED_PREFIX + path.name))
            write_text_atomic(self.root / LATEST_FILE, chosen.name + "\n")
        barrier()
        moved = ", ".join(DAMAGED_PREFIX + p.name for p in damaged) or "nothing"
        return chosen, [*damage, f"trainer.resume=fallback: resuming from {chosen.name}; set aside: {moved}"]

    def load(
        self, engine: Engine, path: Path, *, any_world_size: bool = False, tokenizer_path: Optional[str] = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore engine state and this rank's RNG states from ``path``; returns ``(trainer_state, rank_state)``
        (the rank state holds the data position). The restored parameters must be finite. ``any_world_size``: the
        data position does not depend on the number of ranks (prepared shards), so another number may resume when
        the optimizer state is whole (ZeRO stage 0); rank ``r`` then reads the rank file of rank ``r mod saved
        world size``. ``tokenizer_path``: the data's tokenizer now, which must be the one the checkpoint saved."""
        state = read_trainer_state(path)
        _check_tokenizer(path / WEIGHTS_DIR / TOKENIZER_FILE, tokenizer_path)
        if state["world_size"] != self.env.world_size and not any_world_size:
            raise CheckpointError(
                f"{path} was written by {state['world_size']} rank(s) but this run has {self.env.world_size}: the "
                "data positions of this data kind are per rank, so resume with the same number of processes (or "
                "train on prepared shards, data=shards, which resume on any number)"
            )
        stage = engine.ds.zero_optimization_stage()
        if state["world_size"] != self.env.world_size and stage > 0:
            raise CheckpointError(
                f"{path} was written by {state['world_size']} rank(s) and this run has {self.env.world_size}: the data "
                f"position resumes on any number, but ZeRO stage {stage} partitions the optimizer state over the saved "
                "ranks (DeepSpeed refuses another number); resume with the same number of processes"
            )
        rank_file = path / _rank_file(self.env.rank % state["world_size"])
        if not rank_file.is_file():
            raise CheckpointError(f"{path} has no {rank_file.name}: the checkpoint is incomplete")
        engine.load(path)
        try:
            check_finite(dict(engine.module.named_parameters()), path / ENGINE_TAG)
        except NonFiniteWeightsError as e:
            raise CheckpointError(f"cannot resume from {path}: {e}") from e
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        restore_rng(rank_state.pop("rng"))
        self.last_saved = (state["step"], path)
        return state, rank_state
