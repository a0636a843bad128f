"""End-to-end check of the foundation on a CPU: every attention variant under conf/attention builds a tiny model,
runs forward and backward, decodes incrementally (compared with a full forward) and reports its cache memory.

Run: ``python -m ckv.apps.smoke [conf/attention]``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ckv import ModelConfig, Transformer


def load_variant(conf_dir: str | Path, name: str) -> dict:
    """Attention option ``name`` of ``conf_dir`` composed by Hydra: the option it starts from (its ``defaults``,
    e.g. ``w8s8``) with its own fields merged over it."""
    with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name=name))


def check_variant(attention: dict, seq_len: int = 61, seed: int = 0) -> dict:
    """Forward/backward, decode-vs-prefill error and cache bytes of one attention variant on a tiny model."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, mlp_dim=128,
                      max_seq_len=256, attention=attention)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)).item()
    model.eval()
    with torch.no_grad():
        cache = model.new_cache(2)
        steps = [model(ids[:, :5], cache)] + [model(ids[:, t:t + 1], cache) for t in range(5, seq_len)]
        err = (torch.cat(steps, 1) - logits.detach()).abs().max().item()
    return {"loss": loss.item(), "grad_norm": grad_norm, "decode_err": err, "cache_bytes": cache.nbytes()["total"]}


def main(conf_dir: str = "conf/attention") -> int:
    files = sorted(Path(conf_dir).glob("*.yaml"))
    if not files:
        print(f"no attention configs in {conf_dir}", file=sys.stderr)
        return 2
    print(f"{'variant':26s} {'loss':>7s} {'|grad|':>8s} {'decode err':>11s} {'cache KiB':>10s} {'time s':>7s}")
    worst = 0.0
    for f in files:
        t0 = time.perf_counter()
        r = check_variant(load_variant(conf_dir, f.stem))
        worst = max(worst, r["decode_err"])
        print(f"{f.stem:26s} {r['loss']:7.3f} {r['grad_norm']:8.3f} {r['decode_err']:11.2e} "
              f"{r['cache_bytes'] / 1024:10.1f} {time.perf_counter() - t0:7.2f}")
    ok = worst < 1e-4
    print(f"{len(files)} variants: forward+backward ran; incremental decoding matches the full forward "
          f"(max |diff| {worst:.1e}) -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
