"""Tokenizers: load a user's ``tokenizer.json`` or train (and cache) a byte-level BPE on the corpus."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from typing import Any, Optional, Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ckv.config import ConfigError
from ckv.data.corpus import DataError
from ckv.io.atomic import atomic_path

BYTE_ALPHABET = 256  # byte-level BPE starts from every byte
LOCK_WAIT_S = 1800.0  # how long a rank waits for another process to finish training the same tokenizer


class TextTokenizer(Protocol):
    """What word and token lookups need from a tokenizer (a ckv run's or a transformers one)."""

    bos_id: Optional[int]
    unk_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TokenizersTokenizer:
    """A ``tokenizers.Tokenizer`` (a ckv run's ``tokenizer.json``) behind the ``TextTokenizer`` protocol."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.bos_id: Optional[int] = None
        unk = getattr(tok.model, "unk_token", None)
        self.unk_id: Optional[int] = tok.token_to_id(unk) if unk else None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def one_token_problem(tok: TextTokenizer, text: str, ids: list[int]) -> Optional[str]:
    """Why ``text`` (encoded as ``ids``) is not one known token, or ``None`` when it is."""
    if len(ids) != 1:
        return f"{text!r} -> {len(ids)} tokens {ids}"
    if tok.unk_id is not None and ids[0] == tok.unk_id:
        return f"{text!r} -> the unknown token"
    return None


def single_token_words(tok: TextTokenizer, vocab_size: int, prefix: str, limit: Optional[int] = None) -> list[int]:
    """The ids, in id order, whose text is an ASCII word of two or more letters (after one optional leading space)
    and for which ``prefix + word`` encodes to exactly that token; the first ``limit`` of them when given. The
    lookup evaluation's ``task.vocab.source=tokenizer`` draws its keys and values from the head of this list."""
    found: list[int] = []
    for i in range(vocab_size):
        text = tok.decode([i])
        word = text[1:] if text.startswith(" ") else text
        if len(word) >= 2 and word.isascii() and word.isalpha() and tok.encode(prefix + word) == [i]:
            if tok.unk_id is None or i != tok.unk_id:
                found.append(i)
                if limit is not None and len(found) == limit:
                    break
    return found


def lookup_special_tokens(n: int) -> list[str]:
    """Names of the ``n`` special tokens a mixture reserves for the lookup layout."""
    return [f"<|lookup_{i}|>" for i in range(n)]


def load_tokenizer(path: str) -> Tokenizer:
    """A ``tokenizers`` tokenizer from its JSON file; errors name the file and the config field."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data.text.tokenizer: {path!r} does not exist (give a tokenizer.json, or null to train a BPE)"
        )
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise DataError(f"data.text.tokenizer: {path!r} is not a readable tokenizer.json: {e}") from e


def text_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path`` set to encode special-token text inside documents as ordinary text, so a literal
    ``<|endoftext|>`` in a document never becomes the end-of-document id (``add_special_tokens=False`` alone does not
    do that: it only skips the post-processor's template)."""
    tok = load_tokenizer(path)
    tok.encode_special_tokens = True
    return tok


def token_id(tok: Tokenizer, token: str, source: str, field: str) -> int:
    """The id of ``token`` in ``tok``, or a DataError naming the tokenizer and the config field."""
    tid = tok.token_to_id(token)
    if tid is None:
        raise DataError(f"{field}={token!r} is not a token of the tokenizer {source!r}")
    return tid


def _new_bpe(vocab_size: int, special_tokens: list[str]) -> tuple[Tokenizer, trainers.BpeTrainer]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    return tok, trainer


def train_bpe(texts: Iterable[str], *, vocab_size: int, special_tokens: list[str], cache_dir: str) -> str:
    """Train a byte-level BPE on ``texts`` (special tokens get ids ``0..len-1`` in order) and return the path
    of its ``tokenizer.json``. The file is cached under ``cache_dir/tokenizers`` by a hash of the texts and
    the settings, so every rank and every rerun gets the same file; one process trains, the others wait."""
    need = BYTE_ALPHABET + len(special_tokens) + 1
    if vocab_size < need:
        raise ConfigError(
            f"data.text.vocab_size={vocab_size} is too small for a byte-level BPE with {len(special_tokens)} "
            f"special tokens: it needs at least {need} (256 bytes + specials + one merge)"
        )
    texts = list(texts)
    if not texts:
        raise DataError("no training text to learn a BPE from (the corpus' train split is empty)")
    h = hashlib.sha256(repr((1, vocab_size, special_tokens)).encode())
    for t in texts:
        h.update(t.encode())
        h.update(b"\x00")
    folder = os.path.join(cache_dir, "tokenizers", f"bpe{vocab_size}-{h.hexdigest()[:20]}")
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # someone else is training it
        deadline = time.monotonic() + LOCK_WAIT_S
        while not os.path.isfile(path):
            if time.monotonic() > deadline:
                raise DataError(
                    f"gave up waiting for {path}: remove the stale lock {lock} if no process is training it"
                ) from None
            time.sleep(0.2)
        return path
    try:
        tok, trainer = _new_bpe(vocab_size, special_tokens)
        tok.train_from_iterator(texts, trainer)
        with atomic_path(path) as tmp:
            tok.save(str(tmp))
    finally:
        os.close(fd)
        os.remove(lock)
    return path
