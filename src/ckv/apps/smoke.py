"""End-to-end check of the foundation on a CPU: every attention option (``ckv.apps.variants.option_names``: each
conf/attention/*.yaml, and each option of each group folder conf/attention/<group>/ composed onto the group bases)
builds a tiny model, runs forward and backward, decodes incrementally (compared with a full forward) and reports its
cache memory.
With ``--triton`` every compressed variant runs a second time with ``impl=triton`` (on a CPU under the Triton
interpreter, which this sets up: slow, minutes per variant) and is compared with the config's impl (``auto``:
the reference at these sizes).

Run: ``python -m ckv.apps.smoke [conf/attention] [--triton] [--only NAME ...]``."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ckv import ModelConfig, Transformer
from ckv.apps.variants import load_variant, option_names
from ckv.attention import REGISTRY


def check_variant(attention: dict, seq_len: int = 61, seed: int = 0) -> dict:
    """Forward/backward, decode-vs-prefill error and cache bytes of one attention variant on a tiny model; the
    sequence is lengthened to ``window + 29`` tokens where the window is longer, so that entries close."""
    torch.manual_seed(seed)
    seq_len = max(seq_len, attention.get("window", 0) + 29)
    cfg = ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        max_seq_len=max(256, seq_len),
        attention=attention,
    )
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)).item()
    model.eval()
    with torch.no_grad():
        cache = model.new_cache(2)
        steps = [model(ids[:, :5], cache)] + [model(ids[:, t : t + 1], cache) for t in range(5, seq_len)]
        err = (torch.cat(steps, 1) - logits.detach()).abs().max().item()
    return {
        "loss": loss.item(),
        "grad_norm": grad_norm,
        "decode_err": err,
        "cache_bytes": cache.nbytes()["total"],
        "logits": logits.detach(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckv.apps.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("conf_dir", nargs="?", default="conf/attention")
    parser.add_argument("--triton", action="store_true", help="also run compressed variants with impl=triton")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="only these options (file stems, or base+group=option)"
    )
    args = parser.parse_args(argv)
    if args.triton and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when ckv_kernels is first imported (not yet)
    names = [n for n in option_names(args.conf_dir) if not args.only or n in args.only]
    if not names:
        print(
            f"no attention configs in {args.conf_dir}" + (f" named {args.only}" if args.only else ""), file=sys.stderr
        )
        return 2
    print(
        f"{'variant':34s} {'loss':>7s} {'|grad|':>8s} {'decode err':>11s} {'vs torch':>9s} {'cache KiB':>10s} "
        f"{'time s':>7s}"
    )
    worst, runs = 0.0, 0
    for stem in names:
        attention = load_variant(args.conf_dir, stem)
        backend = REGISTRY.get(attention.get("kind", "full"))
        impls = ["triton"] if args.triton and backend is not None and "triton" in backend.impls else []
        reference = None
        for impl in [None, *impls]:
            t0 = time.perf_counter()
            r = check_variant(attention if impl is None else dict(attention, impl=impl))
            vs_torch = 0.0 if reference is None else (r["logits"] - reference["logits"]).abs().max().item()
            vs = "" if reference is None else f"{vs_torch:9.2e}"
            worst = max(worst, r["decode_err"], vs_torch)
            reference, runs = reference or r, runs + 1
            name = stem if impl is None else f"{stem} [{impl}]"
            print(
                f"{name:34s} {r['loss']:7.3f} {r['grad_norm']:8.3f} {r['decode_err']:11.2e} {vs:>9s} "
                f"{r['cache_bytes'] / 1024:10.1f} {time.perf_counter() - t0:7.2f}"
            )
    ok = worst < 1e-4
    print(
        f"{len(names)} options, {runs} runs: forward+backward ran; incremental decoding matches the full forward"
        f"{' and triton matches torch' if args.triton else ''} (max |diff| {worst:.1e}) -> "
        f"{'OK' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
