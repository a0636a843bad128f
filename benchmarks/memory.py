"""Peak memory of one training step (forward + backward) on CPU: today's path against activation
checkpointing plus the chunked, fused cross-entropy, side by side, with the loss difference.

- ``today``: ``model(ids)`` materialises the logits (B, T, V), ``ckv.train.engine.lm_loss`` takes their fp32
  cross-entropy, no checkpointing;
- ``lean``: ``ckv.train.checkpointing.apply_activation_checkpointing(model, "full")`` and
  ``ckv.train.loss.chunked_cross_entropy(model.hidden_states(ids), model.lm_head.weight, labels)``.

Method (Linux): each (attention, variant) runs in a fresh Python process with the same seed, model and batch,
and with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every allocation of 64 KiB or more on its own and
unmaps it when freed, so the resident set follows the live tensors instead of keeping freed memory in the heap.
The child builds everything, runs one warm-up step (first-call costs such as lazily loaded code are not the
step's memory; one-time ~100 MiB for the first checkpointed backward), drops the gradients, resets the kernel's
high-water mark of its resident set (writing ``5`` to
``/proc/self/clear_refs`` sets ``VmHWM`` to the current ``VmRSS``), reads ``VmRSS`` as the baseline, runs the
step and reads ``VmHWM`` from ``/proc/self/status``. The step's peak is ``VmHWM - baseline``: everything the step
allocated and touched at its worst moment, parameter gradients included. Where the mark cannot be reset, the
child falls back to ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` and reports the number as not measurable when
the step did not raise the mark above the one left by imports and model construction. Loss and gradient norm
are printed so that the two variants can be compared (same to 1e-5 is the issue's bar).

    python benchmarks/memory.py                        # 32K vocabulary, 1,024 tokens, batch 2, full + compressed
    python benchmarks/memory.py --attention compressed --batch 1 --json /tmp/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("today", "lean")
ATTENTION = {
    "full": {"kind": "full"},
    "compressed": {"kind": "compressed", "window": 8, "stride": 8, "local_window": 16},
}


def _status_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(variant: str, attention: str, vocab: int, seq_len: int, batch: int, chunk: int, threads: int) -> dict:
    """One training step in this process; returns peak bytes above the pre-step baseline, loss, gradient norm."""
    import torch

    torch.set_num_threads(threads)
    from ckv import ModelConfig, Transformer
    from ckv.train.checkpointing import apply_activation_checkpointing
    from ckv.train.engine import lm_loss
    from ckv.train.loss import chunked_cross_entropy

    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("small", vocab_size=vocab, max_seq_len=seq_len, attention=ATTENTION[attention])
    model = Transformer(cfg)
    ids = torch.randint(0, vocab, (batch, seq_len))
    labels = torch.randint(0, vocab, (batch, seq_len))
    if variant == "lean":
        apply_activation_checkpointing(model, "full")

    def step() -> torch.Tensor:
        if variant == "today":
            loss = lm_loss(model(ids), labels)
        else:
            loss = chunked_cross_entropy(model.hidden_states(ids), model.lm_head.weight, labels, chunk_tokens=chunk)
        loss.backward()
        return loss

    step()  # warm-up: first-call costs (lazily loaded code, thread pools) are not the step's memory
    model.zero_grad(set_to_none=True)
    reset = _reset_high_water_mark()
    baseline, high_before = _status_bytes("VmRSS"), _status_bytes("VmHWM")
    loss = step()
    peak = _status_bytes("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    return {
        "variant": variant,
        "attention": attention,
        "peak_bytes": peak - baseline,
        "measurable": reset or peak > high_before,
        "loss": loss.item(),
        "grad_norm": grad_norm,
        "parameters": model.num_parameters(),
    }


def run_child(variant: str, attention: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        variant,
        attention,
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--chunk",
        str(args.chunk),
        "--threads",
        str(args.threads),
    ]
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", nargs="+", default=list(ATTENTION), choices=list(ATTENTION))
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the fused cross-entropy")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "ATTENTION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.vocab, args.seq_len, args.batch, args.chunk, args.threads)))
        return []
    rows = []
    print(
        f"model: ckv 'small' preset, vocab {args.vocab}, {args.batch} x {args.seq_len} tokens, "
        f"loss chunk {args.chunk} tokens, fp32 on CPU"
    )
    print("attention  | today MiB | lean MiB | lean/today | |loss diff| | |grad-norm diff| | measurable")
    for attention in args.attention:
        today, lean = (run_child(v, attention, args) for v in VARIANTS)
        row = {
            "attention": attention,
            "today": today,
            "lean": lean,
            "ratio": lean["peak_bytes"] / today["peak_bytes"],
            "loss_diff": abs(lean["loss"] - today["loss"]),
            "grad_norm_diff": abs(lean["grad_norm"] - today["grad_norm"]),
        }
        rows.append(row)
        print(
            f"{attention:10} | {today['peak_bytes'] / 2**20:9.1f} | {lean['peak_bytes'] / 2**20:8.1f} | "
            f"{row['ratio']:10.2f} | {row['loss_diff']:11.2e} | {row['grad_norm_diff']:16.2e} | "
            f"{today['measurable'] and lean['measurable']}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k not in ("json", "child")}, "rows": rows}, indent=1
            )
        )
    return rows


if __name__ == "__main__":
    main()
