"""``train(cfg) -> run_dir``: one training run from a fresh or existing run folder to its last step.

The same function runs a laptop smoke test and a multi-node job: the process group comes from
``ckv.train.distributed``, the engine from ``ckv.train.engine`` (DeepSpeed), the data from ``ckv.data``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ckv.config import ConfigError
from ckv.data import BatchStream, budget_note, build_batches
from ckv.device import resolve_device
from ckv.flops import flops_per_token, mfu, peak_flops
from ckv.io.layout import MODEL_DIR, latest_checkpoint
from ckv.io.lock import RunLock, RunLockedError
from ckv.model import Transformer
from ckv.train.checkpoint import CheckpointManager, export_model
from ckv.train.config import TrainConfig
from ckv.train.distributed import DistEnv, all_reduce_max, all_reduce_mean, barrier, distributed
from ckv.train.engine import Engine, accumulation_steps
from ckv.train.metrics import MetricsLogger, truncate_metrics
from ckv.train.run import check_resumable, plain, provenance, write_run_files
from ckv.train.signals import StopRequest, TrainingInterrupted

EXPLODED_LOSS_FACTOR = 4.0  # a loss above 4 x ln(vocab), four times a uniform guess's, counts as diverged


class DivergenceError(RuntimeError):
    """The run diverged (a NaN/inf or exploding loss, or a non-finite gradient norm): it stopped without saving over
    its last good checkpoint and without exporting."""


class DivergenceWatch:
    """The first step whose loss or gradient norm went bad, kept on the device so that training needs no host
    sync per step; ``check`` reads it (a collective) at log steps and before every save and export."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.loss_limit = EXPLODED_LOSS_FACTOR * math.log(vocab_size)
        self.first = torch.full((), -1, dtype=torch.int64, device=device)  # () first bad step, -1: none yet
        self.loss = torch.zeros((), dtype=torch.float64, device=device)  # () its loss
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=device)  # () its gradient norm
        self.device = device

    def update(self, step: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> None:
        """Record ``step`` if it is the first bad one (no host sync)."""
        loss = loss.detach().to(torch.float64)
        norm = grad_norm if grad_norm is not None else torch.zeros_like(loss)
        new = (~torch.isfinite(loss) | (loss > self.loss_limit) | ~torch.isfinite(norm)) & (self.first < 0)
        self.first = torch.where(new, step, self.first)
        self.loss = torch.where(new, loss, self.loss)
        self.grad_norm = torch.where(new, norm, self.grad_norm)

    def check(self, run_dir: Path) -> None:
        """Raise ``DivergenceError`` on every rank when any rank recorded a bad step (a collective)."""
        first = int(self.first)
        at = -all_reduce_max([-float(first) if first >= 0 else -math.inf], self.device)[0]
        if not math.isfinite(at):
            return
        if first == int(at):
            loss, norm = float(self.loss), float(self.grad_norm)
            why = (
                "the loss is not finite"
                if not math.isfinite(loss)
                else "the gradient norm is not finite"
                if not math.isfinite(norm)
                else f"the loss exploded above {self.loss_limit:.2f} = {EXPLODED_LOSS_FACTOR:g} x ln(vocab)"
            )
            seen = f"{why} (loss {loss:.6g}, grad_norm {norm:.6g})"
        else:
            seen = "another rank saw a non-finite or exploding loss or gradient norm"
        latest = latest_checkpoint(run_dir)
        raise DivergenceError(
            f"training diverged at step {int(at)}: {seen}; stopping without saving or exporting. The last good "
            f"checkpoint is {latest or 'none (no checkpoint was written yet)'}. Rerunning resumes from it with the "
            "same batches; a changed optimisation (e.g. a lower optim.lr, longer optim.warmup_steps) needs a new "
            "run folder"
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _streams(cfg: TrainConfig, env: DistEnv) -> tuple[BatchStream, Optional[BatchStream]]:
    """Train and validation streams of this rank (no validation stream when ``trainer.val_every`` is 0: a source
    without a validation split then trains). Rank 0 builds first, so that a tokenizer it trains and caches is
    reused by the others rather than trained by all of them at once."""

    def build(split: str) -> BatchStream:
        return build_batches(
            cfg.data,
            batch_size=cfg.trainer.micro_batch_size,
            seed=cfg.seed,
            rank=env.rank,
            world_size=env.world_size,
            split=split,
            cache_dir=cfg.trainer.data_cache_dir,
            total_samples=cfg.trainer.max_steps * cfg.trainer.global_batch_size,
        )

    def both() -> tuple[BatchStream, Optional[BatchStream]]:
        return build("train"), build("val") if cfg.trainer.val_every else None

    streams = both() if env.is_main else None
    barrier()
    return streams or both()


class _Loop:
    """The state of one invocation: engine, streams, checkpoints, logger, counters."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, info: Optional[dict[str, Any]], notes: list[str]) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(cfg.run_dir)
        t = cfg.trainer
        check_resumable(cfg)
        accumulation_steps(t.global_batch_size, t.micro_batch_size, env.world_size)  # fail before any work
        seed_everything(cfg.seed)
        self.train_stream, self.val_stream = _streams(cfg, env)
        self.val_start = None if self.val_stream is None else self.val_stream.state_dict()
        model_cfg = cfg.model.build(cfg.attention, self.train_stream.vocab_size)
        if cfg.data.seq_len > model_cfg.max_seq_len:
            raise ConfigError(
                f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len="
                f"{model_cfg.max_seq_len}; raise model.max_seq_len or lower data.seq_len"
            )
        torch.manual_seed(cfg.seed)
        self.engine = Engine(Transformer(model_cfg), cfg, env)
        self.watch = DivergenceWatch(env.device, model_cfg.vocab_size)
        # training FLOPs per token (attention over the visible pairs) and the per-device peak MFU divides by
        self.flops_per_token = flops_per_token(model_cfg, cfg.data.seq_len).training
        self.peak = peak_flops(override=t.peak_flops) if t.peak_flops or env.device.type == "cuda" else None
        self.ckpts = CheckpointManager(self.run_dir, env, t.keep_last, t.keep_every)
        self.step, self.tokens = 0, 0
        self.deficit: Optional[torch.Tensor] = None  # the last step's gate-entropy deficit (None: floor off)
        self.indexer: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # its indexer KL and recall (None: none)
        self.tokens_per_step = t.global_batch_size * cfg.data.seq_len
        self.ckpts.clean_leftovers()
        notes = [*notes, *self._resume()]
        if env.is_main:  # after the resume checks: a refused resume writes nothing
            write_run_files(
                cfg,
                provenance(
                    {
                        **(info or {}),
                        "world_size": env.world_size,
                        "device": env.device.type,
                        "precision": self.engine.precision,
                        "accumulation_steps": self.engine.accumulation_steps,
                        "parameters": sum(p.numel() for p in self.engine.module.parameters()),
                    }
                ),
            )
        self.target = min(t.max_steps, t.stop_at_step or t.max_steps)
        self.log = MetricsLogger(
            self.run_dir,
            env.is_main,
            cfg.wandb,
            f"{cfg.name}/{self.run_dir.name}",
            plain(cfg.to_dict()),
            self.step,
            t.max_steps,
            t.progress,
        )
        self.log.message(
            f"{self.run_dir} | {model_cfg.n_layers} layers, d={model_cfg.d_model}, "
            f"{model_cfg.describe_attention()['kind']} attention, vocab {model_cfg.vocab_size} | "
            f"{env.world_size} rank(s) on {env.device.type}, "
            f"{self.engine.precision}, {self.engine.accumulation_steps} accumulation step(s) | "
            + (f"resumed at step {self.step}" if self.step else "fresh start")
        )
        budget = budget_note(cfg.data, self.train_stream, t.max_steps * t.global_batch_size // env.world_size)
        if budget is not None:
            notes = [*notes, budget]
        if self.peak is None:
            notes = [
                *notes,
                "MFU is not reported: no dense bf16 peak is known for "
                + (torch.cuda.get_device_name() if env.device.type == "cuda" else "a CPU")
                + "; set trainer.peak_flops (FLOP/s per device) to report it",
            ]
        if t.compile:
            notes = [
                *notes,
                "trainer.compile=true: the model compiles during the first step (a minute or more; validation "
                "compiles once more); the ETA is measured from the second step",
            ]
        for note in notes:
            self.log.message(note)

    def _resume(self) -> list[str]:
        """Restore the latest intact checkpoint (see ``CheckpointManager.resume_point``); returns what it found."""
        path, notes = self.ckpts.resume_point(self.cfg.trainer.resume)
        if path is None:
            return notes
        state, rank_state = self.ckpts.load(
            self.engine, path, any_world_size=self.train_stream.elastic, tokenizer_path=self.train_stream.tokenizer_path
        )
        self.train_stream.load_state_dict(rank_state["data"])
        self.step, self.tokens = state["step"], state["tokens"]
        if self.env.is_main:
            truncate_metrics(self.run_dir, self.step)
        return notes

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(self.engine.accumulation_steps):
            yield next(self.train_stream)

    def save(self) -> Path:
        """Checkpoint the current step, after checking that no step since the last check diverged."""
        self.watch.check(self.run_dir)
        return self.ckpts.save(
            self.engine,
            self.step,
            {"tokens": self.tokens},
            {"data": self.train_stream.state_dict()},
            self.train_stream.tokenizer_path,
        )

    def validate(self) -> float:
        """Mean loss over ``trainer.val_batches`` held-out batches per rank (the same batches every time)."""
        assert self.val_stream is not None and self.val_start is not None  # built whenever val_every > 0
        self.val_stream.load_state_dict(self.val_start)
        self.engine.train(False)
        losses = [self.engine.eval_loss(next(self.val_stream)) for _ in range(self.cfg.trainer.val_batches)]
        self.engine.train(True)
        return all_reduce_mean([torch.stack(losses).mean().item()], self.env.device)[0]

    def train_step(self) -> torch.Tensor:
        """One optimizer step over all accumulation micro-batches; returns this rank's mean loss (on the device,
        no host sync) after recording it in the divergence watch."""
        losses = [self.engine.micro_step(batch) for batch in self._batches()]
        self.step += 1
        self.tokens += self.tokens_per_step
        loss = torch.stack(losses).mean()
        self.deficit = self.engine.step_deficit()
        self.indexer = self.engine.step_indexer()
        self.watch.update(self.step, loss, self.engine.grad_norm_tensor())
        return loss

    def run(self) -> Path:
        t = self.cfg.trainer
        last_time, last_step = time.perf_counter(), self.step
        first = self.step + 1
        with StopRequest() as stop:
            while self.step < self.target:
                lr = self.engine.lr
                step_loss = self.train_step()
                if self.step == first:  # compilation and warm-up happen in the first step: the ETA leaves it out
                    self.log.start_clock(self.step)
                if self.step % t.log_every == 0 or self.step == self.target:
                    # the LM loss ("loss" leaves the training-only terms out) and those terms, means over ranks
                    values = {"loss": step_loss}
                    if self.deficit is not None:
                        values["gate_entropy_deficit"] = self.deficit
                    if self.indexer is not None:
                        values["indexer_loss"], values["indexer_recall"] = self.indexer
                    extra = dict(zip(values, all_reduce_mean([v.item() for v in values.values()], self.env.device)))
                    loss = extra.pop("loss")
                    if self.deficit is not None:
                        extra["gate_entropy_penalty"] = self.engine.gate_entropy.weight * extra["gate_entropy_deficit"]
                    now = time.perf_counter()
                    tok_s = (self.step - last_step) * self.tokens_per_step / max(now - last_time, 1e-9)
                    last_time, last_step = now, self.step
                    util = (
                        None if self.peak is None else mfu(tok_s / self.env.world_size, self.flops_per_token, self.peak)
                    )
                    self.log.log(
                        {
                            "step": self.step,
                            "loss": loss,
                            "lr": lr,
                            "grad_norm": self.engine.grad_norm,
                            "tokens": self.tokens,
                            "tokens_per_s": tok_s,
                            "flops_per_token": self.flops_per_token,
                            "mfu": util,
                            **extra,
                        }
                    )
                    self.log.progress(self.step, **{"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}", "lr": f"{lr:.2e}"})
                    self.watch.check(self.run_dir)
                if t.val_every and (self.step % t.val_every == 0 or self.step == t.max_steps):
                    val = self.validate()
                    self.log.log({"step": self.step, "val_loss": val})
                    self.log.message(f"step {self.step}: val_loss {val:.4f}")
                if t.save_every and self.step % t.save_every == 0:
                    self.save()
                signum = 0
                if self.step % t.stop_check_every == 0:  # a collective: every rank checks at the same steps
                    signum = int(all_reduce_max([stop.signum or 0], self.env.device)[0])
                if signum:
                    path = self.save()
                    self.log.message(f"stop signal {signum}: checkpoint {path.name} saved")
                    stop.forward()
                    raise TrainingInterrupted(signum, path)
            self.save()
        if self.step >= t.max_steps:
            with self.engine.full_module() as module:
                if self.env.is_main:
                    export_model(module, self.run_dir / MODEL_DIR, self.train_stream.tokenizer_path)
            self.log.message(f"finished: step {self.step}; weights in {self.run_dir / MODEL_DIR}")
        else:
            self.log.message(f"stopped at step {self.step} (trainer.stop_at_step); run again to continue")
        return self.run_dir

    def close(self, ok: bool) -> None:
        self.train_stream.close()
        if self.val_stream is not None:
            self.val_stream.close()
        self.engine.close()
        self.log.close(ok)


def _lock_run(run_dir: Path, env: DistEnv) -> Optional[RunLock]:
    """Rank 0 takes the run folder's lock for the whole job; when it cannot, every rank raises (a collective)."""
    lock, error = None, None
    if env.is_main:
        try:
            lock = RunLock(run_dir).acquire()
        except RunLockedError as e:
            error = e
    if all_reduce_max([1.0 if error else 0.0], env.device)[0]:
        raise error or RunLockedError(f"rank 0 could not lock {run_dir}: another process trains into it")
    return lock


def train(cfg: TrainConfig, info: Optional[dict[str, Any]] = None) -> Path:
    """Train (or resume) the run in ``cfg.run_dir`` and return that folder. ``info`` (e.g. the Hydra overrides)
    is added to the run's provenance record. Raises ``RunLockedError`` when another process trains into the
    folder, ``TrainingInterrupted`` after a signal-triggered checkpoint and ``DivergenceError`` when the run
    diverges."""
    with distributed(resolve_device(cfg.trainer.device, "trainer.device")) as env:
        lock = _lock_run(Path(cfg.run_dir), env)
        try:
            loop = _Loop(cfg, env, info, [lock.stale] if lock and lock.stale else [])
            ok = False
            try:
                run_dir = loop.run()
                ok = True
                return run_dir
            finally:
                loop.close(ok)
        finally:
            if lock is not None:
                lock.release()
