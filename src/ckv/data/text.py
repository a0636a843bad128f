"""Packed text sequences: documents tokenised, each followed by the end-of-document token, concatenated and cut
into windows of ``seq_len + 1`` tokens (inputs ``[:-1]``, targets ``[1:]``; consecutive windows share one
token, so every token is a target exactly once). A window never exceeds the configured length; documents may
continue from one window into the next.

Two sources share this packing:

- ``PackedText`` (default): the whole split is tokenised once (cached on disk, memory-mapped); the windows
  of each epoch are shuffled globally by ``(seed, epoch)`` and dealt round-robin to ranks. State: one counter.
- ``StreamingText`` (``streaming: true``): documents are read lazily, dealt round-robin to ranks, shuffled
  within blocks of ``shuffle_block`` documents by ``(seed, epoch, block)``, tokenised and packed on the fly.
  State: ``(epoch, block, document, position in it, last token)``, so a resume re-reads (without tokenising)
  up to the block and re-tokenises only that block's remaining documents.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Optional

import numpy as np
from tokenizers import Tokenizer

from ckv.data.config import TextConfig
from ckv.data.corpus import Corpus, DataError, iter_documents, load_corpus
from ckv.data.stream import rng_for
from ckv.data.tokenizer import text_tokenizer, token_id, train_bpe
from ckv.io.atomic import atomic_path

TEXT_SALT = 0
ENCODE_BATCH = 256  # documents per tokenizer call
SPLIT_NAMES = {0: "train", 1: "val"}


def _blocks(it: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(it)
    while block := list(islice(it, size)):
        yield block


class TextSource:
    """What both text sources share: the corpus, its tokenizer, and where this stream reads from."""

    def __init__(
        self,
        cfg: TextConfig,
        seq_len: int,
        ds: Corpus,
        tok: Tokenizer,
        tokenizer_path: str,
        *,
        seed: int,
        split: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.cfg, self.seq_len, self.ds, self.tok = cfg, seq_len, ds, tok
        self.tokenizer_path = tokenizer_path
        self.eod_id = token_id(tok, cfg.eod_token, tokenizer_path, "data.text.eod_token")
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.seed, self.split, self.rank, self.world_size = seed, split, rank, world_size
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def documents(self, rank: int = 0, world_size: int = 1) -> Iterator[str]:
        return iter_documents(
            self.ds,
            self.cfg.text_field,
            split=self.split,
            val_every=self.cfg.val_every,
            rank=rank,
            world_size=world_size,
            max_skipped_fraction=self.cfg.max_skipped_fraction,
        )

    def encode(self, texts: Iterator[str]) -> Iterator[np.ndarray]:
        """Token ids of each text followed by the end-of-document id, tokenised ``ENCODE_BATCH`` at a time."""
        for batch in _blocks(texts, ENCODE_BATCH):
            for e in self.tok.encode_batch(batch, add_special_tokens=False):
                yield np.asarray(e.ids + [self.eod_id], dtype=self.dtype)

    def _no_data(self, what: str) -> DataError:
        return DataError(
            f"the {SPLIT_NAMES[self.split]!r} split of {self.cfg.paths or 'the shipped corpus'} has {what} for rank "
            f"{self.rank} of {self.world_size} at seq_len={self.seq_len}; add documents or lower data.seq_len "
            "(every data.text.val_every-th document is held out for val: lower val_every for a bigger val split)"
        )


class PackedText(TextSource):
    """The whole split tokenised once; windows shuffled per epoch (see the module docstring). The token array is
    cached under ``cache_dir/tokens`` by a hash of the tokenizer file and the split's documents, and memory-mapped
    from there."""

    def __init__(self, *args: Any, cache_dir: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with open(self.tokenizer_path, "rb") as f:
            h = hashlib.sha256(f.read())
        h.update(b"literal special tokens stay text")  # arrays cached before that fix are not reused
        for text in self.documents():
            h.update(text.encode())
            h.update(b"\x00")
        path = os.path.join(cache_dir, "tokens", f"{h.hexdigest()[:24]}.npy")
        if not os.path.isfile(path):
            parts = list(self.encode(self.documents()))
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.save(f, np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype))
        self.tokens = np.load(path, mmap_mode="r")  # (N,)
        self.n_windows = max(len(self.tokens) - 1, 0) // self.seq_len
        self.per_rank = self.n_windows // self.world_size
        if self.per_rank == 0:
            raise self._no_data(f"{len(self.tokens)} tokens, not one full window of {self.seq_len + 1} tokens")
        self.index = 0
        self._perm: tuple[int, Optional[np.ndarray]] = (-1, None)

    def _window(self, epoch: int, i: int) -> int:
        if self._perm[0] != epoch:
            self._perm = (epoch, rng_for(self.seed, self.split, TEXT_SALT, epoch).permutation(self.n_windows))
        return int(self._perm[1][i * self.world_size + self.rank])

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        epoch, i = divmod(self.index, self.per_rank)
        self.index += 1
        start = self._window(epoch, i) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].astype(np.int64)  # (T+1,)
        return window[:-1], window[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


class StreamingText(TextSource):
    """Documents read lazily and packed on the fly (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_state_dict({"epoch": 0, "block": 0, "doc": 0, "pos": 0, "last": None})

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        window = next(self._windows)  # (T+1,)
        return window[:-1], window[1:]

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = {k: state[k] for k in ("epoch", "block", "doc", "pos", "last")}
        self._windows = self._generate(dict(self._state))

    def _generate(self, s: dict[str, Any]) -> Iterator[np.ndarray]:
        """Windows from state ``s`` on; keeps ``self._state`` equal to the state after the last window."""
        size = self.seq_len + 1
        buf = np.empty(size, dtype=np.int64)
        fill = 0
        if s["last"] is not None:
            buf[0], fill = s["last"], 1
        while True:
            blocks = _blocks(self.documents(self.rank, self.world_size), self.cfg.shuffle_block)
            seen_any = False
            for b, texts in enumerate(blocks):
                seen_any = True
                if b < s["block"]:
                    continue
                order = rng_for(self.seed, self.split, TEXT_SALT, s["epoch"], b).permutation(len(texts))
                first = s["doc"]
                for d, doc in enumerate(self.encode(texts[k] for k in order[first:]), start=first):
                    pos = s["pos"] if d == first else 0
                    while pos < len(doc):
                        take = min(size - fill, len(doc) - pos)
                        buf[fill : fill + take] = doc[pos : pos + take]
                        fill, pos = fill + take, pos + take
                        if fill == size:
                            window = buf.copy()
                            buf[0], fill = window[-1], 1
                            at_end = pos == len(doc)
                            self._state = {
                                "epoch": s["epoch"],
                                "block": b,
                                "doc": d + 1 if at_end else d,
                                "pos": 0 if at_end else pos,
                                "last": int(window[-1]),
                            }
                            yield window
                s["doc"], s["pos"] = 0, 0
            if not seen_any:
                raise self._no_data("no documents")
            s["epoch"], s["block"] = s["epoch"] + 1, 0


def build_text_source(
    cfg: TextConfig,
    seq_len: int,
    *,
    extra_special_tokens: list[str],
    cache_dir: str,
    seed: int,
    split: int,
    rank: int,
    world_size: int,
) -> TextSource:
    """Load the corpus, load or train its tokenizer, and return the packed source of one rank and split.

    A trained BPE's special tokens are ``[eod_token, *extra_special_tokens]`` with ids ``0, 1, ...``; it is
    trained on at most ``cfg.bpe_max_chars`` characters of the train split (never on held-out documents)."""
    ds = load_corpus(cfg, cache_dir=cache_dir)
    if cfg.tokenizer is None:
        texts, chars = [], 0
        train_docs = iter_documents(
            ds, cfg.text_field, split=0, val_every=cfg.val_every, max_skipped_fraction=cfg.max_skipped_fraction
        )
        for text in train_docs:
            texts.append(text[: cfg.bpe_max_chars - chars])
            chars += len(texts[-1])
            if chars >= cfg.bpe_max_chars:
                break
        path = train_bpe(
            texts, vocab_size=cfg.vocab_size, special_tokens=[cfg.eod_token, *extra_special_tokens], cache_dir=cache_dir
        )
    else:
        path = cfg.tokenizer
    tok = text_tokenizer(path)
    where = dict(seed=seed, split=split, rank=rank, world_size=world_size)
    if cfg.streaming:
        return StreamingText(cfg, seq_len, ds, tok, path, **where)
    return PackedText(cfg, seq_len, ds, tok, path, cache_dir=cache_dir, **where)
