"""Training batches from prepared token shards (``data.kind: shards``; see ``ckv.data.prepare``).

Sample order. A split's shards are one token sequence cut into windows of ``seq_len + 1`` tokens (consecutive
windows share one token). Global sample ``g`` is window ``perm_e[g mod n]`` of epoch ``e = g // n``, where ``perm_e``
is a permutation drawn from ``(seed, split, epoch)``. A mixture (``data.shards.sources``) deals each block of
``MIX_BLOCK`` global samples to its sources in exact proportion to their ratios (largest remainder on the running
totals), in an order drawn from ``(seed, split, block)``; a source's ``k``-th sample is its own global sample ``k``.

Dealing. Rank ``r`` of ``W`` ranks with micro-batch ``B`` fills row ``j`` of its ``b``-th micro-batch with global
sample ``(b * W + r) * B + j``. Optimizer step ``s`` with ``A`` accumulation steps therefore consumes exactly the
samples ``[s * G, (s + 1) * G)`` with ``G = A * W * B`` the global batch, whatever ``W``, ``A`` and ``B`` are:
1 rank x 2 accumulation steps and 2 ranks x 1 train on the same samples at every step. The state is the number of global
samples consumed, so a resume is O(1) and may use another number of ranks (or micro-batch size): it continues with
exactly the samples that were next.

A background thread prepares the next ``data.shards.prefetch`` batches (in pinned memory when CUDA is available,
so the engine's ``non_blocking`` copy overlaps with compute).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from typing import Any, Optional, Protocol

import numpy as np
import torch

from ckv.config import ConfigError
from ckv.data.config import MANIFEST_FILE, TOKENIZER_FILE, DataConfig
from ckv.data.corpus import DataError
from ckv.data.lookup import LookupFormat
from ckv.data.stream import BatchStream, check_identity, rng_for

SHARD_SALT = 2  # keeps window permutations apart from the other sources' draws with the same seed
MIX_SALT = 3
MIX_BLOCK = 1024  # global samples per mixture block: each source's count is exact within one per block
SPLIT_NAMES = ("train", "val")


class GlobalSource(Protocol):
    """Random access to the samples of one split counted over all ranks."""

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray]: ...


def read_manifest(path: str) -> dict[str, Any]:
    """The ``manifest.json`` of a prepared folder; a one-line ``DataError`` when it is missing or unreadable."""
    file = os.path.join(os.path.expanduser(path), MANIFEST_FILE)
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"data.shards: cannot read {file} ({e}); prepare it with python -m ckv.data.prepare") from e


class ShardSet:
    """The token files of one split of a prepared folder, memory-mapped and read as one sequence."""

    def __init__(self, path: str, split: str) -> None:
        self.path = os.path.expanduser(path)
        self.manifest = read_manifest(path)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.arrays = []
        for shard in self.manifest["splits"][split]["shards"]:
            file = os.path.join(self.path, shard["tokens"])
            if not os.path.isfile(file) or os.path.getsize(file) != shard["n_tokens"] * self.dtype.itemsize:
                raise DataError(f"data.shards: {file} is missing or not {shard['n_tokens']} tokens: prepare it again")
            self.arrays.append(np.memmap(file, dtype=self.dtype, mode="r"))
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])  # (n_shards + 1,) first token of each shard
        self.n_tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the split (across shard boundaries) as int64."""
        out = np.empty(length, dtype=np.int64)  # (length,)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            at = start + done - int(self.starts[k])
            take = min(length - done, len(self.arrays[k]) - at)
            out[done : done + take] = self.arrays[k][at : at + take]
            done, k = done + take, k + 1
        return out


class ShardWindows:
    """Windows of ``seq_len + 1`` tokens of one ``ShardSet``, permuted per epoch (see the module docstring)."""

    def __init__(self, shards: ShardSet, seq_len: int, *, seed: int, split: int, max_epochs: Optional[float]) -> None:
        self.shards, self.seq_len, self.seed, self.split = shards, seq_len, seed, split
        self.n_windows = max(shards.n_tokens - 1, 0) // seq_len
        if self.n_windows == 0:
            raise DataError(
                f"the {SPLIT_NAMES[split]!r} split of {shards.path} has {shards.n_tokens} tokens, not one window of "
                f"{seq_len + 1}; prepare more text (or a larger --val-fraction) or lower data.seq_len"
            )
        self.max_samples = None if max_epochs is None else int(max_epochs * self.n_windows)
        self._perm: tuple[int, Optional[np.ndarray]] = (-1, None)

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        if self.max_samples is not None and g >= self.max_samples:
            raise DataError(
                f"{self.shards.path} ran out: sample {g} exceeds its max_epochs ({self.max_samples} samples of "
                f"{self.n_windows} windows); raise max_epochs in data.shards.sources or add data"
            )
        epoch, i = divmod(g, self.n_windows)
        if self._perm[0] != epoch:
            perm = rng_for(self.seed, self.split, SHARD_SALT, epoch).permutation(self.n_windows)
            self._perm = (epoch, perm.astype(np.uint32 if self.n_windows < 1 << 32 else np.int64))
        window = self.shards.read(int(self._perm[1][i]) * self.seq_len, self.seq_len + 1)  # (T+1,)
        return window[:-1], window[1:]


class TokenMixture:
    """Several sources dealt by target ratio, block by block (see the module docstring)."""

    def __init__(self, sources: list[GlobalSource], ratios: list[float], *, seed: int, split: int) -> None:
        total = float(sum(ratios))
        self.sources, self.ratios = sources, np.asarray(ratios, dtype=np.float64) / total
        if (self.ratios * MIX_BLOCK < 1).any():
            raise ConfigError(f"data.shards.sources: every ratio must be at least 1/{MIX_BLOCK} of their sum")
        self.seed, self.split = seed, split
        self._block: tuple[int, Any, Any, Any] = (-1, None, None, None)  # block, totals before it, owner, rank

    def totals(self, samples: int) -> np.ndarray:
        """How many of the first ``samples`` global samples (a multiple of ``MIX_BLOCK``) each source gets: the
        largest-remainder rounding of ``samples * ratio``, so the counts sum to ``samples``."""
        want = samples * self.ratios
        counts = np.floor(want).astype(np.int64)
        short = samples - int(counts.sum())
        counts[np.argsort(-(want - counts), kind="stable")[:short]] += 1
        return counts

    def _owners(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """The totals before block ``b`` (sources,) and the source of each of its samples (MIX_BLOCK,)."""
        before = self.totals(b * MIX_BLOCK)
        n = self.totals((b + 1) * MIX_BLOCK) - before  # (sources,) samples of each source in block b
        order = rng_for(self.seed, self.split, MIX_SALT, b).permutation(MIX_BLOCK)
        return before, np.repeat(np.arange(len(n)), n)[order]

    def counts(self, samples: int) -> np.ndarray:
        """How many of the first ``samples`` global samples each source gets (sources,)."""
        b, p = divmod(samples, MIX_BLOCK)
        before, owner = self._owners(b)
        return before + np.bincount(owner[:p], minlength=len(self.sources))

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        b, p = divmod(g, MIX_BLOCK)
        if self._block[0] != b:
            before, owner = self._owners(b)
            rank = np.empty(MIX_BLOCK, dtype=np.int64)  # (MIX_BLOCK,) position among the same source's samples
            for i in range(len(self.sources)):
                rank[owner == i] = np.arange((owner == i).sum())
            self._block = (b, before, owner, rank)
        _, before, owner, rank = self._block
        s = int(owner[p])
        return self.sources[s].sample(int(before[s] + rank[p]))


class _Prefetch:
    """A daemon thread computing batches ``first, first + 1, ...`` into a bounded queue."""

    def __init__(self, make: Any, first: int, depth: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.error: Optional[Exception] = None  # what the thread raised, once the consumer has seen it
        self.thread = threading.Thread(target=self._run, args=(make, first), daemon=True)
        self.thread.start()

    def _run(self, make: Any, b: int) -> None:
        while not self.stop.is_set():
            try:
                item: Any = make(b)
            except Exception as e:  # handed to the consumer, raised there
                item = e
            self.queue.put(item)  # blocks while the queue is full; close() drains it
            if isinstance(item, Exception):
                return
            b += 1

    def get(self) -> dict[str, torch.Tensor]:
        if self.error is not None:  # the thread has ended: raise again rather than wait on an empty queue
            raise self.error
        item = self.queue.get()
        if isinstance(item, Exception):
            self.error = item
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self.queue.get_nowait()
            self.thread.join(timeout=0.01)


class ShardBatches(BatchStream):
    """Batches of one rank over a ``GlobalSource`` (see the module docstring for the dealing). Its state holds the
    global samples consumed, and may be loaded by a stream with any rank, world size or micro-batch size."""

    elastic = True

    def __init__(
        self,
        source: GlobalSource,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        prefetch: int,
        identity: dict[str, Any],
        vocab_size: int,
        tokenizer_path: Optional[str],
        lookup_format: Optional[LookupFormat] = None,
    ) -> None:
        super().__init__(
            source,  # type: ignore[arg-type]
            batch_size=batch_size,
            identity=identity,
            vocab_size=vocab_size,
            tokenizer_path=tokenizer_path,
            lookup_format=lookup_format,
        )
        self.identity.pop("batch_size")
        self.rank, self.world_size, self.depth = rank, world_size, prefetch
        self.pin = torch.cuda.is_available()
        self._prefetch: Optional[_Prefetch] = None

    def batch(self, b: int) -> dict[str, torch.Tensor]:
        """This rank's micro-batch number ``b`` (0-based)."""
        first = (b * self.world_size + self.rank) * self.batch_size
        out = self.collate([self.source.sample(first + j) for j in range(self.batch_size)], b + 1)
        return {k: v.pin_memory() for k, v in out.items()} if self.pin else out

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.depth and self._prefetch is None:
            self._prefetch = _Prefetch(self.batch, self.batches, self.depth)
        out = self._prefetch.get() if self._prefetch is not None else self.batch(self.batches)
        self.batches += 1
        return out

    def close(self) -> None:
        """Stop the prefetch thread (a later ``next`` starts a new one)."""
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None

    def state_dict(self) -> dict[str, Any]:
        return {"identity": dict(self.identity), "samples": self.batches * self.world_size * self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the ``state["samples"]`` global samples consumed; refuses another data config, and a
        count that this rank layout cannot continue from (not a multiple of ``world_size * batch_size``)."""
        check_identity(state["identity"], self.identity)
        samples, per_batch = int(state["samples"]), self.world_size * self.batch_size
        if samples % per_batch:
            raise ValueError(
                f"the data state is at global sample {samples}, not a multiple of world_size x micro_batch_size "
                f"= {per_batch}: resume with a layout whose micro-batch over all ranks divides it"
            )
        self.close()
        self.batches = samples // per_batch


def build_shard_batches(
    cfg: DataConfig,
    *,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    split: int,
    identity: dict[str, Any],
    total_samples: Optional[int] = None,
) -> ShardBatches:
    """The ``ShardBatches`` of one rank and split for ``cfg.kind == "shards"``; with ``total_samples`` (the
    run's global samples) a source that would be repeated more than its ``max_epochs`` fails here, not mid-run."""
    from ckv.data import lookup_format_for  # the package entry point imports this module
    from ckv.data.synthetic import LookupSequences
    from ckv.data.tokenizer import load_tokenizer

    cfg.shards.check_prepared()
    entries = cfg.shards.entries()
    folders = [e for e in entries if not e.get("lookup")]
    manifests = [read_manifest(e["path"]) for e in folders]
    hashes = {m["tokenizer"]["sha256"] for m in manifests}
    if len(hashes) > 1:
        raise ConfigError(
            "data.shards.sources were prepared with different tokenizers: "
            + ", ".join(f"{e['path']}: {m['tokenizer']['sha256'][:12]}" for e, m in zip(folders, manifests))
        )
    tokenizer_path = os.path.join(os.path.expanduser(folders[0]["path"]), TOKENIZER_FILE)
    vocab_size = int(manifests[0]["tokenizer"]["vocab_size"])
    fmt = lookup_format_for(cfg, load_tokenizer(tokenizer_path)) if cfg.shards.uses_lookup else None
    sources: list[GlobalSource] = []
    for e in entries:
        if e.get("lookup"):
            assert fmt is not None
            sources.append(LookupSequences(cfg.lookup, fmt, cfg.seq_len, seed=seed, split=split, rank=0, world_size=1))
        else:
            shard_set = ShardSet(e["path"], SPLIT_NAMES[split])
            sources.append(
                ShardWindows(
                    shard_set,
                    cfg.seq_len,
                    seed=seed,
                    split=split,
                    max_epochs=e.get("max_epochs") if split == 0 else None,
                )
            )
    if len(sources) == 1:
        source: GlobalSource = sources[0]
    else:
        source = TokenMixture(sources, [float(e.get("ratio", 1.0)) for e in entries], seed=seed, split=split)
    if total_samples is not None and split == 0:
        need = source.counts(total_samples) if isinstance(source, TokenMixture) else [total_samples]
        for e, s, n in zip(entries, sources, need):
            limit = getattr(s, "max_samples", None)
            if limit is not None and n > limit:
                raise ConfigError(
                    f"data.shards: {e['path']} would be read {n / s.n_windows:.2f} times over the run ({n} of its "  # type: ignore[attr-defined]
                    f"{s.n_windows} windows), more than its max_epochs={e['max_epochs']}; add data or raise it"  # type: ignore[attr-defined]
                )
    identity = {
        **identity,
        "shards": [
            {k: m[k] for k in ("tokenizer", "seed", "val_fraction", "dtype")}
            | {"tokens": m["splits"]["train"]["tokens"]}
            for m in manifests
        ],
    }
    return ShardBatches(
        source,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        prefetch=cfg.shards.prefetch,
        identity=identity,
        vocab_size=max(vocab_size, fmt.vocab_size if fmt else 0),
        tokenizer_path=tokenizer_path,
        lookup_format=fmt,
    )
