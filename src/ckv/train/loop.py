"""``train(cfg) -> run_dir``: one training run from a fresh or existing run folder to its last step.

The same function runs a laptop smoke test and a multi-node job: the process group comes from
``ckv.train.distributed``, the engine from ``ckv.train.engine`` (DeepSpeed), the data from ``ckv.data``.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ckv.config import ConfigError
from ckv.data import BatchStream, build_batches
from ckv.model import Transformer
from ckv.io.layout import MODEL_DIR, latest_checkpoint
from ckv.train.checkpoint import CheckpointManager, export_model
from ckv.train.config import TrainConfig
from ckv.train.distributed import DistEnv, all_reduce_max, all_reduce_mean, barrier, distributed, resolve_device
from ckv.train.engine import Engine, accumulation_steps
from ckv.train.metrics import MetricsLogger, truncate_metrics
from ckv.train.run import check_resumable, plain, provenance, write_run_files
from ckv.train.signals import StopRequest, TrainingInterrupted


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped without saving over its last good checkpoint."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _streams(cfg: TrainConfig, env: DistEnv) -> tuple[BatchStream, BatchStream]:
    """Train and validation streams of this rank. Rank 0 builds first, so that a tokenizer it trains and caches
    is reused by the others rather than trained by all of them at once."""
    def build(split: str) -> BatchStream:
        return build_batches(cfg.data, batch_size=cfg.trainer.micro_batch_size, seed=cfg.seed, rank=env.rank,
                             world_size=env.world_size, split=split, cache_dir=cfg.trainer.data_cache_dir)

    streams: tuple[BatchStream, BatchStream] | None = None
    if env.is_main:
        streams = build("train"), build("val")
    barrier()
    return streams or (build("train"), build("val"))


class _Loop:
    """The state of one invocation: engine, streams, checkpoints, logger, counters."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, info: Optional[dict[str, Any]]) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(cfg.run_dir)
        t = cfg.trainer
        check_resumable(cfg)
        accumulation_steps(t.global_batch_size, t.micro_batch_size, env.world_size)  # fail before any work
        seed_everything(cfg.seed)
        self.train_stream, self.val_stream = _streams(cfg, env)
        self.val_start = self.val_stream.state_dict()
        model_cfg = cfg.model.build(cfg.attention, self.train_stream.vocab_size)
        if cfg.data.seq_len > model_cfg.max_seq_len:
            raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len="
                              f"{model_cfg.max_seq_len}; raise model.max_seq_len or lower data.seq_len")
        torch.manual_seed(cfg.seed)
        self.engine = Engine(Transformer(model_cfg), cfg, env)
        self.ckpts = CheckpointManager(self.run_dir, env, t.keep_last, t.keep_every)
        self.step, self.tokens = 0, 0
        self.tokens_per_step = t.global_batch_size * cfg.data.seq_len
        if env.is_main:
            write_run_files(cfg, provenance({
                **(info or {}), "world_size": env.world_size, "device": env.device.type,
                "precision": self.engine.precision, "accumulation_steps": self.engine.accumulation_steps,
                "parameters": sum(p.numel() for p in self.engine.module.parameters()),
            }))
        self.ckpts.clean_leftovers()
        self._resume()
        self.target = min(t.max_steps, t.stop_at_step or t.max_steps)
        self.log = MetricsLogger(self.run_dir, env.is_main, cfg.wandb, f"{cfg.name}/{self.run_dir.name}",
                                 plain(cfg.to_dict()), self.step, t.max_steps, t.progress)
        self.log.message(
            f"{self.run_dir} | {model_cfg.n_layers} layers, d={model_cfg.d_model}, {cfg.attention.get('kind')} "
            f"attention, vocab {model_cfg.vocab_size} | {env.world_size} rank(s) on {env.device.type}, "
            f"{self.engine.precision}, {self.engine.accumulation_steps} accumulation step(s) | "
            + (f"resumed at step {self.step}" if self.step else "fresh start")
        )

    def _resume(self) -> None:
        latest = latest_checkpoint(self.run_dir)
        if latest is None:
            return
        state, rank_state = self.ckpts.load(self.engine, latest)
        self.train_stream.load_state_dict(rank_state["data"])
        self.step, self.tokens = state["step"], state["tokens"]
        if self.env.is_main:
            truncate_metrics(self.run_dir, self.step)

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(self.engine.accumulation_steps):
            yield next(self.train_stream)

    def save(self) -> Path:
        """Checkpoint the current step."""
        return self.ckpts.save(self.engine, self.step, {"tokens": self.tokens},
                               {"data": self.train_stream.state_dict()}, self.train_stream.tokenizer_path)

    def validate(self) -> float:
        """Mean loss over ``trainer.val_batches`` held-out batches per rank (the same batches every time)."""
        self.val_stream.load_state_dict(self.val_start)
        self.engine.train(False)
        losses = [self.engine.eval_loss(next(self.val_stream)) for _ in range(self.cfg.trainer.val_batches)]
        self.engine.train(True)
        return all_reduce_mean([torch.stack(losses).mean().item()], self.env.device)[0]

    def train_step(self) -> float:
        """One optimizer step over all accumulation micro-batches; returns the loss averaged over ranks."""
        losses = [self.engine.micro_step(batch) for batch in self._batches()]
        self.step += 1
        self.tokens += self.tokens_per_step
        loss = all_reduce_mean([torch.stack(losses).mean().item()], self.env.device)[0]
        if not math.isfinite(loss):
            latest = latest_checkpoint(self.run_dir)
            raise NonFiniteLossError(
                f"the training loss is {loss} at step {self.step}; stopping without saving. The last good "
                f"checkpoint is {latest or 'none (no checkpoint was written yet)'}. Rerunning resumes from it with "
                "the same batches; a changed optimisation (e.g. a lower optim.lr, longer optim.warmup_steps) "
                "needs a new run folder"
            )
        return loss

    def run(self) -> Path:
        t = self.cfg.trainer
        last_time, last_step = time.perf_counter(), self.step
        with StopRequest() as stop:
            while self.step < self.target:
                lr = self.engine.lr
                loss = self.train_step()
                if self.step % t.log_every == 0 or self.step == self.target:
                    now = time.perf_counter()
                    tok_s = (self.step - last_step) * self.tokens_per_step / max(now - last_time, 1e-9)
                    last_time, last_step = now, self.step
                    self.log.log({"step": self.step, "loss": loss, "lr": lr, "grad_norm": self.engine.grad_norm,
                                  "tokens": self.tokens, "tokens_per_s": tok_s})
                    self.log.progress(self.step, **{"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}",
                                                    "lr": f"{lr:.2e}"})
                if t.val_every and (self.step % t.val_every == 0 or self.step == t.max_steps):
                    val = self.validate()
                    self.log.log({"step": self.step, "val_loss": val})
                    self.log.message(f"step {self.step}: val_loss {val:.4f}")
                if t.save_every and self.step % t.save_every == 0:
                    self.save()
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
        self.log.close(ok)


def train(cfg: TrainConfig, info: Optional[dict[str, Any]] = None) -> Path:
    """Train (or resume) the run in ``cfg.run_dir`` and return that folder. ``info`` (e.g. the Hydra overrides)
    is added to the run's provenance record. Raises ``TrainingInterrupted`` after a signal-triggered
    checkpoint and ``NonFiniteLossError`` on a NaN/inf loss."""
    with distributed(resolve_device(cfg.trainer.device)) as env:
        loop = _Loop(cfg, env, info)
        ok = False
        try:
            run_dir = loop.run()
            ok = True
            return run_dir
        finally:
            loop.close(ok)
