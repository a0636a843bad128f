"""The DeepSpeed engine behind the few operations the training loop needs.

One code path for a laptop CPU (fp32, gloo, one process) and a GPU cluster (bf16, NCCL, ZeRO 0-3). DeepSpeed is
imported lazily (``ckv.train.distributed.import_deepspeed``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ckv.config import ConfigError
from ckv.model import Transformer
from ckv.train.checkpointing import apply_activation_checkpointing
from ckv.train.config import TrainConfig
from ckv.train.distributed import DistEnv, import_deepspeed
from ckv.train.gate_entropy import GateEntropyFloor
from ckv.train.indexer import IndexerTraining, has_indexer, indexer_parameters
from ckv.train.loss import chunked_cross_entropy
from ckv.train.schedule import build_scheduler

IGNORE_INDEX = -100
ENGINE_TAG = "engine"  # the DeepSpeed tag (sub-folder) inside a ckv checkpoint folder
# DeepSpeed config keys that ckv fills in from the trainer and optim sections
RESERVED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
)


def resolve_precision(precision: str, device: str) -> str:
    """``auto`` -> bf16 on GPU, fp32 on CPU."""
    if precision == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return precision


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step; a clear error when the global batch cannot be split."""
    per_pass = micro_batch * world_size
    if global_batch % per_pass:
        raise ConfigError(
            f"trainer.global_batch_size={global_batch} cannot be split into micro-batches of "
            f"trainer.micro_batch_size={micro_batch} on {world_size} rank(s): it must be a multiple of "
            f"micro_batch_size * world_size = {per_pass}"
        )
    return global_batch // per_pass


def deepspeed_config(cfg: TrainConfig, world_size: int, precision: str) -> dict[str, Any]:
    """The full DeepSpeed config: ``cfg.deepspeed`` (ZeRO etc.) plus batch sizes, clipping and precision."""
    clash = sorted(set(RESERVED_KEYS) & set(cfg.deepspeed))
    if clash:
        raise ConfigError(
            f"deepspeed.{clash[0]} is set by ckv (batch sizes in trainer.*, clipping in "
            f"optim.grad_clip, precision in trainer.precision, optimizer in optim.*): remove {clash}"
        )
    t = cfg.trainer
    return {
        **cfg.deepspeed,
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps(t.global_batch_size, t.micro_batch_size, world_size),
        "gradient_clipping": cfg.optim.grad_clip,
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def param_groups(
    model: torch.nn.Module, weight_decay: float, apart: Sequence[torch.nn.Parameter] = ()
) -> list[dict[str, Any]]:
    """Weight decay on matrices only; norm gains and gate biases (vectors) are not decayed. The parameters in
    ``apart`` (the lightning indexers', when their dense warm-up holds everything else still) get their own two
    groups after the others'."""

    def split(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        decay = [p for p in params if p.requires_grad and p.ndim >= 2]
        rest = [p for p in params if p.requires_grad and p.ndim < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]

    held = {id(p) for p in apart}
    main = split([p for p in model.parameters() if id(p) not in held])
    return main + split(list(apart)) if apart else main


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labels that are not ``-100`` (0 when there are none)."""
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (flat != IGNORE_INDEX).sum().clamp(min=1)


class Engine:
    """A DeepSpeed engine with the operations the loop needs: micro-steps, evaluation, save/load, export.

    Before DeepSpeed wraps the model it applies ``trainer.activation_checkpointing``, turns the model's per-forward
    token-id check off (unless ``trainer.debug_checks``) and, with ``trainer.compile``, compiles the model in place
    (``nn.Module.compile``: parameter names and checkpoints stay those of the plain model). The loss is the LM
    head's full logits through ``lm_loss`` or, with ``trainer.loss_chunk_tokens`` > 0, the fused chunked
    cross-entropy of ``ckv.train.loss`` on the final hidden states. With ``trainer.gate_entropy.floor`` > 0 it hooks
    the compressors' pooling steps (``ckv.train.gate_entropy``) and backpropagates the loss plus the gate-entropy
    penalty; ``micro_step`` still returns the LM loss and ``step_deficit`` the gate-entropy deficit of the last step.
    A model with a lightning indexer (``attention.selection``) gets ``trainer.indexer``'s hooks
    (``ckv.train.indexer``): the objective adds ``weight`` times the indexer's KL (the layers attend every visible
    entry during ``dense_steps`` and the warm-up that follows), and during the warm-up it is that term alone while
    every other parameter group's learning rate is 0; ``step_indexer`` returns the last step's KL and recall.
    """

    def __init__(self, model: Transformer, cfg: TrainConfig, env: DistEnv) -> None:
        self.env = env
        t = cfg.trainer
        self.precision = resolve_precision(t.precision, env.device.type)
        self.loss_chunk_tokens = t.loss_chunk_tokens
        model.check_token_ids = t.debug_checks
        apply_activation_checkpointing(model, t.activation_checkpointing)
        g = t.gate_entropy
        self.gate_entropy = GateEntropyFloor(model, g.floor, g.weight) if g.enabled else None
        self._deficits: list[torch.Tensor] = []  # this optimizer step's gate-entropy deficit per micro-batch
        ix = t.indexer
        self.indexer = IndexerTraining(model, ix) if has_indexer(model) else None
        self._indexer_terms: list[tuple[torch.Tensor, torch.Tensor]] = []  # (KL, recall) per micro-batch
        # the warm-up (after dense_steps) trains the indexers alone: they get their own parameter groups, the others
        # lr 0 meanwhile
        apart = indexer_parameters(model) if self.indexer is not None and ix.warmup_steps else []
        frozen = [ix.warmup_steps] * 2 + [0] * 2 if apart else None
        if t.compile:
            model.compile()
        self._deepspeed = import_deepspeed(env.device.type)
        o = cfg.optim
        optimizer = torch.optim.AdamW(
            param_groups(model, o.weight_decay, apart), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps
        )
        config = deepspeed_config(cfg, env.world_size, self.precision)
        self.accumulation_steps = config["gradient_accumulation_steps"]
        self.ds, _, _, _ = self._deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=config,
            dist_init_required=False,
            lr_scheduler=lambda opt: build_scheduler(opt, o, cfg.trainer.max_steps, frozen, ix.dense_steps),
        )

    @property
    def module(self) -> Transformer:
        return self.ds.module

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return float(self.ds.get_lr()[0])

    def grad_norm_tensor(self) -> Optional[torch.Tensor]:
        """Global gradient norm of the last optimizer step (before clipping) as a 0-d float64 tensor on the
        engine's device, without a host sync where DeepSpeed keeps it there; ``None`` where DeepSpeed does not
        compute it (ZeRO stage 0 in fp32)."""
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None
        return torch.as_tensor(norm).detach().to(device=self.env.device, dtype=torch.float64)

    @property
    def grad_norm(self) -> Optional[float]:
        """``grad_norm_tensor`` as a float (a host sync)."""
        norm = self.grad_norm_tensor()
        return None if norm is None else float(norm)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # non_blocking: asynchronous from pinned host memory (prepared shards pin it on CUDA), plain copy otherwise
        return (
            batch["input_ids"].to(self.env.device, non_blocking=True),
            batch["labels"].to(self.env.device, non_blocking=True),
        )

    def _loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss_chunk_tokens:
            hidden = self.ds(input_ids, head=False)  # (B, T, d)
            return chunked_cross_entropy(
                hidden,
                self.module.lm_head.weight,
                labels,
                chunk_tokens=self.loss_chunk_tokens,
                ignore_index=IGNORE_INDEX,
            )
        return lm_loss(self.ds(input_ids), labels)

    def micro_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward, backward and (at an accumulation boundary) the optimizer step; returns the detached LM loss."""
        input_ids, labels = self._to_device(batch)
        # the optimizer steps taken so far (DeepSpeed's count, restored with a checkpoint): this micro-batch's step
        step = self.ds.global_steps
        warmup = self.indexer is not None and self.indexer.in_warmup(step)
        if self.gate_entropy is not None:
            self.gate_entropy.start()
        if self.indexer is not None:
            self.indexer.start(dense=self.indexer.attends_densely(step))
        loss = self._loss(input_ids, labels)
        objective = loss
        if self.gate_entropy is not None:
            deficit = self.gate_entropy.finish()
            objective = objective + (self.gate_entropy.weight * deficit).to(loss.dtype)
            self._deficits.append(deficit.detach())
        if self.indexer is not None:
            kl, recall = self.indexer.finish()
            term = (self.indexer.weight * kl).to(loss.dtype)
            objective = term if warmup else objective + term  # the warm-up trains the indexers alone
            self._indexer_terms.append((kl.detach(), recall))
        self.ds.backward(objective)
        self.ds.step()
        return loss.detach()

    def step_deficit(self) -> Optional[torch.Tensor]:
        """The mean gate-entropy deficit (the penalty before ``trainer.gate_entropy.weight``) of the micro-steps
        since the last call (0-d, on the device, no host sync), or ``None`` when the floor is off or no micro-step
        ran."""
        if not self._deficits:
            return None
        deficit, self._deficits = torch.stack(self._deficits).mean(), []
        return deficit

    def step_indexer(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The lightning indexers' mean KL (before ``trainer.indexer.weight``) and recall over the micro-steps since
        the last call (0-d each, on the device, no host sync; recall NaN when no selection bound), or ``None``
        without an indexer or when no micro-step ran."""
        if not self._indexer_terms:
            return None
        kl, recall = (torch.stack(t) for t in zip(*self._indexer_terms))
        self._indexer_terms = []
        return kl.mean(), recall.nanmean()

    def close(self) -> None:
        """Take the training-only hooks off the model (evaluation of the same module object is then unaffected)."""
        for reg in (self.gate_entropy, self.indexer):
            if reg is not None:
                reg.remove()

    @torch.no_grad()
    def eval_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Loss of one batch without gradients (the caller switches train/eval mode)."""
        input_ids, labels = self._to_device(batch)
        return self._loss(input_ids, labels)

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its shards of model, optimizer and scheduler state under ``directory``."""
        self.ds.save_checkpoint(str(directory), tag=ENGINE_TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        """Collective: restore model, optimizer and scheduler state saved by ``save``."""
        path, _ = self.ds.load_checkpoint(
            str(directory), tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {directory / ENGINE_TAG}")

    @contextmanager
    def full_module(self) -> Iterator[Transformer]:
        """The model with all its parameters present on every rank (ZeRO-3 gathers them for the duration)."""
        if self.ds.zero_optimization_stage() == 3:
            with self._deepspeed.zero.GatheredParameters(list(self.module.parameters())):
                yield self.module
        else:
            yield self.module
