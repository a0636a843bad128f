"""Pretraining data throughput: ``python -m ckv.data.prepare`` with 1 and 2 processes, the shard loader's tokens/s,
and the simulated GPU busy fraction of a training loop fed by streaming text vs prepared shards.

Corpus: the shipped World English Bible (``ckv.data.corpus.bible_chapters``, ~4.4 MB) written ``copies`` times as
jsonl (one chapter per row, ids ``copy-chapter``), ~53 MB by default; tokenizer: ckv's byte-level BPE
(``train_bpe``) of ``--vocab`` ids trained on one copy.

- prepare: wall time of ``ckv.data.prepare.prepare`` (read, tokenise, shuffle, write) with ``--num-proc`` 1 and 2,
  the tokenizer limited to one thread per process (``TOKENIZERS_PARALLELISM=false``); tokens/s = tokens written /
  wall time; the CPU seconds (process and workers) show whether a shared machine gave the second process a core.
- loader: micro-batches of ``--micro-batch`` x ``--seq-len`` tokens drawn from the shards in the calling thread
  (no prefetch): the rate at which one rank can read.
- busy fraction: a loop whose "GPU step" is a sleep of ``--step-ms`` per micro-batch (default: the time one H100 rank
  at 40% MFU takes for 4 x 4,096 tokens of Qwen3-0.6B, 16,384 / 109,000 tokens/s = 150 ms; a sleep, like a GPU step,
  leaves the CPU to other threads); busy = time slept / (time slept + time waiting for the next batch) over
  ``--steps`` micro-batches after one warm-up.
  Streaming tokenises in the loop's thread (``data.text.streaming``); shards prefetch in a background thread.

    python benchmarks/data.py                 # ~53 MB, 32K BPE, 200 simulated steps
    python benchmarks/data.py --quick         # ~13 MB, 8K BPE, 40 simulated steps
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: 1 vs 2 processes compares 1 vs 2 cores
H100_RANK_TOKENS_S = 109_000  # tokens/s one H100 rank consumes at 40% MFU (Qwen3-0.6B, 4K context)


def write_corpus(folder: Path, copies: int) -> Path:
    from ckv.data.corpus import bible_chapters

    path = folder / "corpus.jsonl"
    with open(path, "w") as f:
        for c in range(copies):
            for i, text in enumerate(bible_chapters()):
                f.write(json.dumps({"id": f"{c}-{i}", "text": text}) + "\n")
    return path


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the tokeniser workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def simulate(stream: Any, steps: int, step_s: float) -> tuple[float, float]:
    """Busy fraction and longest wait (s) of a loop that sleeps ``step_s`` per micro-batch drawn from ``stream``:
    busy = time slept / (time slept + time waiting for batches), so a sleep that overruns on a loaded machine
    counts as GPU time, not as a data stall."""
    next(stream)  # warm-up: first reads, thread start
    slept = waited = longest = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        next(stream)
        t1 = time.perf_counter()
        time.sleep(step_s)
        waited, longest = waited + t1 - t0, max(longest, t1 - t0)
        slept += time.perf_counter() - t1
    return slept / (slept + waited), longest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a quarter of the corpus, an 8K BPE, 40 simulated steps")
    p.add_argument("--copies", type=int, default=None, help="copies of the Bible in the corpus (default 12; quick 3)")
    p.add_argument("--vocab", type=int, default=None, help="BPE size (default 32768; quick 8192)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=None, help="simulated GPU time per micro-batch (default 150)")
    p.add_argument("--steps", type=int, default=None, help="simulated micro-batches (default 200; quick 40)")
    p.add_argument("--json", default=str(ROOT / "outputs" / "benchmarks" / "data.json"))
    a = p.parse_args()
    copies = a.copies or (3 if a.quick else 12)
    vocab = a.vocab or (8192 if a.quick else 32768)
    steps = a.steps or (40 if a.quick else 200)
    step_s = (a.step_ms or 1000 * a.micro_batch * a.seq_len / H100_RANK_TOKENS_S) / 1000

    sys.path.insert(0, str(ROOT / "src"))
    from ckv.data import DataConfig, build_batches, default_cache_dir
    from ckv.data.corpus import bible_chapters
    from ckv.data.prepare import prepare
    from ckv.data.tokenizer import train_bpe

    work = Path(tempfile.mkdtemp(prefix="ckv_data_bench_"))
    out: dict[str, Any] = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    try:
        corpus = write_corpus(work, copies)
        out["corpus_mb"] = corpus.stat().st_size / 1e6
        print(f"corpus: {out['corpus_mb']:.1f} MB ({copies} copies of the Bible); training a {vocab}-id BPE ...")
        tok = train_bpe(
            bible_chapters(), vocab_size=vocab, special_tokens=["<|endoftext|>"], cache_dir=default_cache_dir()
        )
        out["prepare"] = {}
        for n in (1, 2):
            t0, c0 = time.perf_counter(), cpu_seconds()
            m = prepare([str(corpus)], tok, str(work / f"shards{n}"), num_proc=n, val_fraction=0.01)
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
            out["prepare"][n] = {"seconds": dt, "cpu_seconds": cpu, "tokens": tokens, "tokens_per_s": tokens / dt}
        out["prepare_speedup_2_over_1"] = out["prepare"][2]["tokens_per_s"] / out["prepare"][1]["tokens_per_s"]

        shards = {"kind": "shards", "seq_len": a.seq_len, "shards": {"path": str(work / "shards1"), "prefetch": 0}}
        s = build_batches(DataConfig.from_dict(shards), batch_size=a.micro_batch, seed=0)
        next(s)
        n_batches, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 3.0:
            next(s)
            n_batches += 1
        rate = n_batches * a.micro_batch * a.seq_len / (time.perf_counter() - t0)
        out["loader_tokens_per_s"] = rate
        out["loader_over_h100_rank"] = rate / H100_RANK_TOKENS_S

        shards["shards"]["prefetch"] = 8
        text = {
            "kind": "text",
            "seq_len": a.seq_len,
            "text": {"paths": [str(corpus)], "tokenizer": tok, "streaming": True},
        }
        cache = str(work / "cache")
        out["step_ms"], out["steps"], out["busy"], out["longest_wait_s"] = step_s * 1000, steps, {}, {}
        for name, d in (("streaming", text), ("shards", shards)):
            stream = build_batches(DataConfig.from_dict(d), batch_size=a.micro_batch, seed=0, cache_dir=cache)
            out["busy"][name], out["longest_wait_s"][name] = simulate(stream, steps, step_s)
            stream.close()
        out["load_after"] = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nload average before {out['load_before'][0]:.2f}, after {out['load_after'][0]:.2f} on {out['cpus']} CPUs")
    for n, r in out["prepare"].items():
        rate, cpu = r["tokens_per_s"], r["cpu_seconds"]
        print(
            f"prepare, {n} process(es): {r['tokens']:,} tokens in {r['seconds']:.1f} s = {rate:,.0f} tokens/s "
            f"({cpu:.1f} CPU-s, {r['tokens'] / cpu:,.0f} tokens per CPU-s)"
        )
    print(f"prepare speed-up, 2 processes over 1: {out['prepare_speedup_2_over_1']:.2f}x")
    print(
        f"loader from shards: {out['loader_tokens_per_s']:,.0f} tokens/s = {out['loader_over_h100_rank']:.0f}x one "
        f"H100 rank at 40% MFU ({H100_RANK_TOKENS_S:,} tokens/s)"
    )
    for name, busy in out["busy"].items():
        print(
            f"simulated GPU busy fraction, {name}: {busy:.3f} ({steps} steps of {step_s * 1000:.0f} ms; longest wait "
            f"for a batch {1000 * out['longest_wait_s'][name]:.0f} ms)"
        )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
