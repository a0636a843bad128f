"""Plan a training run before it runs: ``python -m ckv.train.plan [hydra overrides] [--gpus 8 --gpu-mem 80 ...]``.

The config is composed exactly as ``train.py`` composes it (Hydra's compose API over ``conf/``, then
``TrainConfig.from_dict``); mandatory values left unset (``???``, e.g. the corpus paths) do not matter here and
stay unset. Printed: parameters, model FLOPs per token (``ckv.flops``: linear, attention, compressor, indexer),
the KV cache per token by part of the cache at ``--kv-precision``'s dtypes (``deepseek_v4``: DeepSeek's inference
dtypes), per-GPU memory by ZeRO stage, the largest micro-batch that fits, and the time to the configured token
budget at a given MFU.

Memory model (an estimate; bytes per parameter from the ZeRO paper, Rajbhandari et al. 2020, section 3.1):
- bf16 mixed precision: weights 2, gradients 2, optimizer states 12 (fp32 master weights, Adam m and v);
  fp32: 4, 4, 8. ZeRO stage >= 1 partitions the optimizer states over the GPUs, >= 2 also the gradients, 3 also
  the weights;
- activations per token and layer, in the compute dtype (what autograd saves with the fused attention kernels:
  impl=triton or flash-attn): both pre-norms' inputs and outputs (4 d), the SwiGLU's gate, up, silu and product
  (4 mlp_dim), and the attention's share as its backend declares it (Q/K/V before and after their norms and the
  output, 4 H D + 4 KV D, plus for compressed attention each token's share of the pooled windows,
  window/stride x (d + branches x 2 KV D)); for full
  attention this lies within 25% of what autograd saves on CPU (tests/train/test_plan.py). Full activation
  checkpointing keeps each block's input (d per token and layer) plus one block's activations twice over
  (its recompute and its gradients);
- logits (``ckv.train.loss.logits_bytes``): today's path holds the micro-batch's logits in bf16 plus two fp32 copies
  (the fp32 cast and the saved log-softmax); the chunked loss one chunk's, plus an fp32 weight-gradient buffer;
- working memory per sequence, one layer's part at a time (``AttentionBackend.working_bytes``, fp32, the largest
  part counted): compressed attention's score blocks (none with the Triton kernels; one query block's
  ``blocked.working_bytes`` on the fast torch path; the reference's score copies), the lightning indexer's scores
  (``index_bytes``) and its loss's logits (``kl_bytes``); printed by part under the table;
- a fraction ``--reserve`` of the GPU memory is left for the CUDA context, communication buffers and
  fragmentation.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ckv.attention import layer_backends
from ckv.config import ConfigError, ModelConfig
from ckv.flops import KV_PRECISIONS, PEAK_BF16_FLOPS, flops_per_token, kv_bytes_by_part, parameter_count, peak_flops
from ckv.train.loss import DEFAULT_CHUNK_TOKENS, logits_bytes

GIB = 2**30
CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
STAGES = (0, 1, 2, 3)


def compose_train_config(overrides: list[str], config_dir: Path = CONF_DIR) -> Any:
    """The ``TrainConfig`` that ``python train.py <overrides>`` would train (``???`` values left unset)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ckv.train.config import TrainConfig

    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name="plan"):
        cfg = compose(config_name="config", overrides=overrides)
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    return TrainConfig.from_dict(plain, run_dir="unused-by-plan")


def model_config(train_cfg: Any, vocab_size: Optional[int] = None) -> ModelConfig:
    """The run's ``ModelConfig``; ``vocab_size`` stands in for the data's vocabulary when the model takes it
    (``model.vocab_size=auto``), which only the tokenizer knows."""
    spec = train_cfg.model
    if spec.vocab_size == "auto":
        if vocab_size is None:
            raise ConfigError(
                "model.vocab_size=auto takes the tokenizer's size, which the plan cannot read: pass --vocab-size N"
            )
        return spec.build(train_cfg.attention, data_vocab_size=vocab_size)
    return spec.build(train_cfg.attention, data_vocab_size=spec.vocab_size)


def activation_bytes_per_token(cfg: ModelConfig, compute_bytes: int, checkpointing: bool) -> float:
    """Activation bytes per token of a training micro-batch (see the module docstring); the attention's share
    comes from each layer's backend (``AttentionBackend.activation_elements_per_token``; under a layer schedule the
    layers' differ, and with checkpointing the largest layer is the one recomputed)."""
    per_layer = [
        4 * cfg.d_model + backend.activation_elements_per_token(layer) + 4 * cfg.mlp_dim
        for backend, layer in layer_backends(cfg)
    ]
    if checkpointing:
        return compute_bytes * (cfg.n_layers * cfg.d_model + 2 * max(per_layer))
    return compute_bytes * sum(per_layer)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for weights, gradients and optimizer states, and per activation element."""

    name: str
    weights: int
    grads: int
    optimizer: int
    compute: int


PRECISIONS = {"bf16": Precision("bf16", 2, 2, 12, 2), "fp32": Precision("fp32", 4, 4, 8, 4)}


def state_bytes(params: int, precision: Precision, stage: int, gpus: int) -> dict[str, float]:
    """Per-GPU bytes of weights, gradients and optimizer states under ZeRO ``stage`` on ``gpus`` GPUs."""
    if stage not in STAGES:
        raise ConfigError(f"ZeRO stage {stage} must be one of {list(STAGES)}")
    return {
        "weights": params * precision.weights / (gpus if stage >= 3 else 1),
        "grads": params * precision.grads / (gpus if stage >= 2 else 1),
        "optimizer": params * precision.optimizer / (gpus if stage >= 1 else 1),
    }


def plan(
    train_cfg: Any,
    *,
    gpus: int = 8,
    gpu_mem_gib: float = 80.0,
    mfu: float = 0.4,
    gpu: str = "H100",
    peak: Optional[float] = None,
    vocab_size: Optional[int] = None,
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    reserve: float = 0.1,
    kv_precision: str = "bf16",
) -> dict[str, Any]:
    """Every number ``python -m ckv.train.plan`` prints, as a dict (bytes, FLOPs, seconds)."""
    for name, value, ok in (
        ("--gpus", gpus, gpus >= 1),
        ("--gpu-mem", gpu_mem_gib, gpu_mem_gib > 0),
        ("--mfu", mfu, 0 < mfu <= 1),
        ("--reserve", reserve, 0 <= reserve < 1),
    ):
        if not ok:
            raise ConfigError(f"{name}={value} is out of range")
    cfg = model_config(train_cfg, vocab_size)
    t, seq_len = train_cfg.trainer, train_cfg.data.seq_len
    precision = PRECISIONS["fp32" if t.precision == "fp32" else "bf16"]  # auto: bf16 on GPUs
    peak_per_gpu = peak_flops(gpu, override=peak)
    if peak_per_gpu is None:
        raise ConfigError(
            f"no known bf16 peak for --gpu {gpu!r} (known: {sorted(PEAK_BF16_FLOPS)}); pass --peak FLOP/s"
        )
    params = parameter_count(cfg)
    flops = flops_per_token(cfg, seq_len)
    usable = gpu_mem_gib * GIB * (1 - reserve)
    micro = t.micro_batch_size
    stage_cfg = train_cfg.deepspeed.get("zero_optimization", {}).get("stage", 0)
    setups = {"plain": (False, None), "checkpointed+chunked": (True, loss_chunk_tokens)}
    per_seq = {
        name: activation_bytes_per_token(cfg, precision.compute, ckpt) * seq_len for name, (ckpt, _) in setups.items()
    }

    # one layer's transient working memory per sequence (the attention's score blocks, the indexer's scores, its
    # loss's logits; fp32, one part at a time), on a GPU as the backend runs there; the largest layer's under a
    # layer schedule (the layers run one after another)
    layer_parts = [
        backend.working_bytes(layer, seq_len, torch.device("cuda")) for backend, layer in layer_backends(cfg)
    ]
    working_parts = max(layer_parts, key=lambda parts: max(parts.values(), default=0.0))
    working = max(working_parts.values(), default=0.0)

    def logits(name: str, m: int) -> float:
        chunk = setups[name][1]
        extra = 0 if chunk is None else cfg.vocab_size * cfg.d_model * 4
        return logits_bytes(m * seq_len, cfg.vocab_size, chunk, precision.compute) + extra

    stages = []
    for stage in STAGES:
        states = state_bytes(params, precision, stage, gpus)
        row: dict[str, Any] = {"stage": stage, **states, "states": sum(states.values())}
        for name in setups:
            row[name] = {
                "activations": micro * per_seq[name],
                "logits": logits(name, micro),
                "working": micro * working,
            }
            row[name]["total"] = row["states"] + row[name]["activations"] + row[name]["logits"] + micro * working
            fits, m = 0, 1
            while row["states"] + m * (per_seq[name] + working) + logits(name, m) <= usable and m <= 4096:
                fits, m = m, m + 1
            row[name]["max_micro_batch"] = fits
        stages.append(row)
    tokens = t.max_steps * t.global_batch_size * seq_len
    seconds = tokens * flops.training / (gpus * peak_per_gpu * mfu)
    return {
        "model": {
            "preset": train_cfg.model.preset,
            "attention": cfg.describe_attention()["kind"],
            "vocab_size": cfg.vocab_size,
            "seq_len": seq_len,
            "parameters": params,
        },
        "flops_per_token": {
            "linear": flops.linear,
            "attention": flops.attention,
            "compressor": flops.compressor,
            "indexer": flops.indexer,
            "forward": flops.forward,
            "training": flops.training,
        },
        "hardware": {
            "gpus": gpus,
            "gpu": gpu,
            "gpu_mem_gib": gpu_mem_gib,
            "usable_gib": usable / GIB,
            "peak_flops": peak_per_gpu,
            "mfu": mfu,
            "precision": precision.name,
        },
        "batch": {
            "micro_batch_size": micro,
            "global_batch_size": t.global_batch_size,
            "configured_zero_stage": stage_cfg,
            "loss_chunk_tokens": loss_chunk_tokens,
        },
        "working_memory": {"per_sequence": working, "parts": working_parts},
        "kv_cache_per_token": {  # the long-sequence figure per part of the cache, each at its dtype
            "precision": kv_precision,
            "parts": {k: {"bytes": b, "dtype": d} for k, (b, d) in kv_bytes_by_part(cfg, None, kv_precision).items()},
        },
        "memory_by_stage": stages,
        "budget": {
            "max_steps": t.max_steps,
            "tokens": tokens,
            "seconds": seconds,
            "days": seconds / 86400,
            "gpu_hours": seconds * gpus / 3600,
        },
    }


def format_plan(p: dict[str, Any]) -> str:
    m, f, hw, b, bud = p["model"], p["flops_per_token"], p["hardware"], p["batch"], p["budget"]
    lines = [
        f"model: {m['preset']} ({m['attention']} attention), vocab {m['vocab_size']:,}, seq_len {m['seq_len']:,}: "
        f"{m['parameters']:,} parameters",
        f"FLOPs per token: {f['training'] / 1e9:.3f} G training (3x forward {f['forward'] / 1e9:.3f} G = linear "
        f"{f['linear'] / 1e9:.3f} + attention {f['attention'] / 1e9:.3f} + compressor {f['compressor'] / 1e9:.3f} "
        f"+ indexer {f['indexer'] / 1e9:.3f})",
        f"hardware: {hw['gpus']} x {hw['gpu']} ({hw['gpu_mem_gib']:g} GiB, {hw['usable_gib']:.1f} usable), "
        f"peak {hw['peak_flops'] / 1e12:.0f} TFLOP/s bf16 each, {hw['precision']}",
        f"per-GPU memory in GiB at micro_batch_size={b['micro_batch_size']} (config's ZeRO stage: "
        f"{b['configured_zero_stage']}; chunked loss: {b['loss_chunk_tokens']} tokens per chunk):",
        "stage | weights | grads | optim | states | plain: act + logits + working = total (max micro) | "
        "ckpt+chunked: act + logits + working = total (max micro)",
    ]
    for r in p["memory_by_stage"]:
        cells = [f"{r['stage']:5}"] + [f"{r[k] / GIB:7.2f}" for k in ("weights", "grads", "optimizer", "states")]
        for name in ("plain", "checkpointed+chunked"):
            s = r[name]
            cells.append(
                f"{s['activations'] / GIB:.2f} + {s['logits'] / GIB:.2f} + {s['working'] / GIB:.2f} = "
                f"{s['total'] / GIB:.2f} "
                f"({s['max_micro_batch']})"
            )
        lines.append(" | ".join(cells))
    kv = p["kv_cache_per_token"]
    parts = ", ".join(f"{k} {v['bytes']:,.1f} ({v['dtype']})" for k, v in kv["parts"].items() if v["bytes"])
    lines.append(f"KV cache per token, long sequences, {kv['precision']} (bytes): {parts}")
    w = p["working_memory"]
    if w["parts"]:
        parts = ", ".join(f"{k} {v / GIB:.3f}" for k, v in w["parts"].items())
        lines.append(f"working memory per sequence (GiB, the largest counted): {parts}")
    lines.append(
        f"budget: {bud['max_steps']:,} steps = {bud['tokens'] / 1e9:.1f} B tokens: {bud['days']:.2f} days "
        f"({bud['gpu_hours']:,.0f} GPU-hours) at MFU {hw['mfu']:g}"
    )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m ckv.train.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (e.g. experiment=paper_base)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--gpu", default="H100", help=f"a name containing one of {sorted(PEAK_BF16_FLOPS)}")
    p.add_argument("--peak", type=float, help="dense bf16 peak FLOP/s per GPU (overrides --gpu's table entry)")
    p.add_argument("--vocab-size", type=int, help="the tokenizer's size, for model.vocab_size=auto")
    p.add_argument("--loss-chunk", type=int, default=DEFAULT_CHUNK_TOKENS, help="tokens per chunk of the fused loss")
    p.add_argument("--reserve", type=float, default=0.1, help="fraction of GPU memory kept free")
    p.add_argument(
        "--kv-precision", default="bf16", choices=sorted(KV_PRECISIONS), help="dtypes of the KV cache's parts"
    )
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead")
    p.add_argument("--config-dir", type=Path, default=CONF_DIR, help="the Hydra config folder (default: conf/)")
    args = p.parse_args(argv)
    from hydra.errors import HydraException

    try:
        result = plan(
            compose_train_config(args.overrides, args.config_dir),
            gpus=args.gpus,
            gpu_mem_gib=args.gpu_mem,
            mfu=args.mfu,
            gpu=args.gpu,
            peak=args.peak,
            vocab_size=args.vocab_size,
            loss_chunk_tokens=args.loss_chunk,
            reserve=args.reserve,
            kv_precision=args.kv_precision,
        )
    except (ConfigError, HydraException) as e:  # Hydra's: an unknown config group or option, a bad override
        sys.exit(f"ckv.train.plan: error: {' '.join(str(e).split())}")
    print(json.dumps(result, indent=1) if args.json else format_plan(result))
    return result


if __name__ == "__main__":
    main()
