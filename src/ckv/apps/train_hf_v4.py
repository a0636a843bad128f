"""A thin trainer for transformers' own ``DeepseekV4ForCausalLM`` on ckv's data, for ``make demo-v4``.

The data, optimiser, learning-rate schedule, batch and step budget come from a composed ckv experiment (the same
Hydra overrides ``train.py`` takes, e.g. ``experiment=demo_gate_s4 seed=0``): the batches are ``ckv.data``'s stream
for that config and seed, the optimiser is AdamW over ``ckv.train``'s parameter groups, the schedule is
``ckv.train``'s, the loss is ``ckv.train``'s next-token loss on the shifted labels. Only the model differs: a
``DeepseekV4ForCausalLM`` built from ``conf/hf/deepseek_v4_demo.yaml`` (its ``DeepseekV4Config`` fields) with the
data's vocabulary. The result is a transformers model folder (``save_pretrained``) that ``eval.py model=hf`` loads,
plus ``config.yaml`` (the ckv settings it trained with and the V4 fields, under ``hf_model``) and ``metrics.jsonl``.

    python -m ckv.apps.train_hf_v4 experiment=demo_gate_s4 seed=0 hydra.run.dir=outputs/v4/seed=0

transformers is imported only here (and in ``ckv.eval.hf_models``). An older transformers without DeepSeek-V4
ends the program with one line and exit code 3 (``NO_V4_EXIT``), which ``make demo-v4`` reports.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ckv.config import ConfigError
from ckv.data import build_batches
from ckv.io.atomic import write_text_atomic
from ckv.io.layout import CONFIG_FILE, METRICS_FILE
from ckv.train.config import TrainConfig
from ckv.train.engine import accumulation_steps, lm_loss, param_groups
from ckv.train.schedule import build_scheduler

ROOT = Path(__file__).resolve().parents[3]  # the checkout: conf/ lives here
ARCH = ROOT / "conf" / "hf" / "deepseek_v4_demo.yaml"
NO_V4_EXIT = 3
RUN_DIR_KEY = "hydra.run.dir="


def has_deepseek_v4() -> bool:
    """Whether the installed transformers ships ``DeepseekV4ForCausalLM``."""
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        return False
    return True


def compose_train_config(overrides: list[str], run_dir: str) -> TrainConfig:
    """The validated ckv ``TrainConfig`` that ``python train.py <overrides>`` would train with."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3", job_name="train_hf_v4"):
        cfg = compose(config_name="config", overrides=overrides)
    return TrainConfig.from_dict(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True), run_dir=run_dir)


def build_v4(arch: dict[str, Any], vocab_size: int, seed: int) -> torch.nn.Module:
    """A freshly initialised ``DeepseekV4ForCausalLM`` (``arch``: ``DeepseekV4Config`` fields, no vocab_size)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    if "vocab_size" in arch:
        raise ConfigError("the V4 architecture file must not set vocab_size: it comes from the data")
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(DeepseekV4Config(vocab_size=vocab_size, attn_implementation="eager", **arch))


def train_v4(cfg: TrainConfig, arch: dict[str, Any], out: Path) -> dict[str, Any]:
    """Train a V4 model with ``cfg``'s data, optimiser, schedule and budget; save it to ``out``. Returns the
    record written to ``config.yaml``."""
    if cfg.trainer.max_steps < 1:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} must be >= 1 for the V4 trainer")
    accum = accumulation_steps(cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size, 1)
    stream = build_batches(
        cfg.data,
        batch_size=cfg.trainer.micro_batch_size,
        seed=cfg.seed,
        split="train",
        cache_dir=cfg.trainer.data_cache_dir,
    )
    model = build_v4(arch, stream.vocab_size, cfg.seed).train()
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    sched = build_scheduler(opt, o, cfg.trainer.max_steps)
    out.mkdir(parents=True, exist_ok=True)
    log_every = max(cfg.trainer.log_every, 1)
    t0, lines = time.monotonic(), []
    for step in range(cfg.trainer.max_steps):
        total = 0.0
        for _ in range(accum):
            batch = next(stream)  # input_ids, labels: (B, T); labels already shifted, -100 where no loss
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits  # (B, T, V)
            loss = lm_loss(logits, batch["labels"]) / accum
            loss.backward()
            total += loss.item()
        if not math.isfinite(total):
            raise FloatingPointError(f"the V4 model's loss is {total} at step {step + 1}")
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0 or step + 1 == cfg.trainer.max_steps:
            lines.append(
                json.dumps(
                    {"step": step + 1, "loss": total, "lr": sched.get_last_lr()[0], "seconds": time.monotonic() - t0}
                )
            )
            print(lines[-1], flush=True)
    model.save_pretrained(out)
    write_text_atomic(out / METRICS_FILE, "\n".join(lines) + "\n")
    # ckv's model and attention sections describe no model here: the V4 fields take their place
    record = {k: v for k, v in cfg.to_dict().items() if k not in ("model", "attention")}
    record.update(
        hf_model={"architecture": "DeepseekV4ForCausalLM", **arch},
        train_seconds=time.monotonic() - t0,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    write_text_atomic(out / CONFIG_FILE, yaml.safe_dump(record, sort_keys=False))
    return record


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    dirs = [a for a in args if a.startswith(RUN_DIR_KEY)]
    if len(dirs) != 1:
        print(
            "usage: python -m ckv.apps.train_hf_v4 <train.py overrides> hydra.run.dir=<model folder>", file=sys.stderr
        )
        return 2
    if not has_deepseek_v4():
        import transformers

        print(
            f"ckv: error: transformers {transformers.__version__} has no DeepseekV4ForCausalLM "
            "(transformers >= 5.x ships it)",
            file=sys.stderr,
        )
        return NO_V4_EXIT
    out = Path(dirs[0][len(RUN_DIR_KEY) :].strip("'\""))
    overrides = [a for a in args if not a.startswith(RUN_DIR_KEY)]
    try:
        cfg = compose_train_config(overrides, str(out))
        arch = yaml.safe_load(ARCH.read_text())
        record = train_v4(cfg, arch, out)
    except ConfigError as e:
        print(f"ckv: error: {e}", file=sys.stderr)
        return 2
    print(
        f"DeepseekV4ForCausalLM ({record['parameters']:,} parameters) trained for {cfg.trainer.max_steps} steps "
        f"in {record['train_seconds']:.0f} s -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
