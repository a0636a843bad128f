"""Training data: packed text, synthetic key->value lookups, and mixtures of the two.

``build_batches(cfg, batch_size=..., seed=...)`` returns a ``BatchStream``: an endless, deterministic,
resumable iterator of ``{"input_ids", "labels"}`` batches (labels already shifted, ``-100`` = no loss).
Different ranks get disjoint data; ``kind: shards`` reads prepared token shards (``ckv.data.shards``), in an order
independent of the number of ranks. ``split="val"`` gives held-out text documents and a different lookup seed
stream.

Vocabulary of a mixture: the lookup layout must sit inside the text vocabulary. By default (``lookup.offset:
null``) ckv's own BPE reserves one special token per layout id right after the end-of-document token
(``<|endoftext|>`` = 0, ``<|lookup_i|>`` = 1 + i), so text never produces lookup ids. With a user tokenizer,
``lookup.offset`` must place the layout on ordinary ids that text then shares; it is validated to fit the
vocabulary and to avoid the end-of-document id.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from tokenizers import Tokenizer

from ckv.config import ConfigError
from ckv.data.config import DataConfig, LookupConfig, RecallConfig, TextConfig
from ckv.data.corpus import DataError
from ckv.data.lookup import LookupExample, LookupFormat, RecordCodec, assemble_lookup, make_lookup_example
from ckv.data.mixture import Mixture
from ckv.data.recall import RecallSequences, recall_vocab
from ckv.data.shards import ShardBatches, build_shard_batches
from ckv.data.stream import IGNORE, SPLITS, BatchStream
from ckv.data.synthetic import LookupSequences
from ckv.data.text import PackedText, TextSource, build_text_source
from ckv.data.tokenizer import TokenizersTokenizer, lookup_special_tokens

__all__ = [
    "IGNORE",
    "BatchStream",
    "DataConfig",
    "DataError",
    "LookupConfig",
    "LookupExample",
    "LookupFormat",
    "RecallConfig",
    "RecordCodec",
    "ShardBatches",
    "TextConfig",
    "assemble_lookup",
    "budget_note",
    "build_batches",
    "default_cache_dir",
    "lookup_format_for",
    "make_lookup_example",
]


def default_cache_dir() -> str:
    """``$CKV_CACHE`` or ``~/.cache/ckv``: where trained tokenizers are kept."""
    return os.environ.get("CKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ckv")


def _flat(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def lookup_format_for(cfg: DataConfig, tokenizer: Optional[Tokenizer] = None) -> Optional[LookupFormat]:
    """Where the lookup records of ``cfg`` live in the vocabulary (``None`` for pure text), validated.

    A mixture's layout depends on its tokenizer (the run's ``tokenizer.json``): with ``lookup.offset: null`` it
    starts at the reserved ``<|lookup_0|>`` token, whose ``layout_size`` reserved tokens must have consecutive
    ids; it must fit the vocabulary and avoid the end-of-document id. Evaluation calls this too, so a trained
    model is always probed with the layout it was trained on.
    """
    if not cfg.uses_lookup:  # text, pretrain (its retrieval blocks are text), shards without a lookup entry
        return None
    if cfg.kind == "lookup":
        return cfg.lookup.format(cfg.lookup.offset or 0)
    if tokenizer is None:
        raise ValueError("the lookup layout of a mixture depends on its tokenizer: pass the run's tokenizer")
    offset = cfg.lookup.offset
    if offset is None:
        names = lookup_special_tokens(cfg.lookup.format(0).layout_size)
        ids = [tokenizer.token_to_id(name) for name in names]
        if ids[0] is None or ids != list(range(ids[0], ids[0] + len(ids))):
            raise DataError(
                f"the tokenizer does not hold the reserved lookup tokens {names[0]}..{names[-1]} with "
                "consecutive ids; was it trained by ckv for this data.lookup layout?"
            )
        offset = ids[0]
    fmt = cfg.lookup.format(offset)
    eod = tokenizer.token_to_id(cfg.text.eod_token)
    fmt.validate(tokenizer.get_vocab_size(with_added_tokens=True), reserved_ids=[] if eod is None else [eod])
    return fmt


def pretrain_source(cfg: DataConfig, text: TextSource, **where: int) -> Mixture:
    """``data.kind: pretrain``'s stream: corpus text and retrieval blocks (``ckv.data.recall``) at ``data.shares``.
    The blocks draw their text from the same packed split, so the corpus must be held in memory."""
    if not isinstance(text, PackedText):
        raise ConfigError(
            "data.kind=pretrain draws retrieval blocks from the packed corpus: set data.text.streaming=false"
        )
    vocab = recall_vocab(cfg.recall, TokenizersTokenizer(text.tok), text.vocab_size)
    recall = RecallSequences(cfg.recall, vocab, text.tokens, cfg.seq_len, **where)
    return Mixture(text, recall, cfg.shares["recall"])


def budget_note(cfg: DataConfig, stream: BatchStream, rows: int) -> Optional[str]:
    """For ``data.kind: pretrain``: how often ``rows`` sequences of one rank read each part (the log's line; a small
    corpus may be repeated many times), else ``None``."""
    if cfg.kind != "pretrain":
        return None
    mixture = stream.source
    recall_rows = math.floor(rows * mixture.ratio)
    text_rows = rows - recall_rows
    windows = mixture.text.per_rank
    r = cfg.recall
    words_only = r.repeat_share * r.word_repeat_share if r.word_fill else 0.0  # the share of all-word sequences
    drawn = "text drawn at random offsets of the same split"
    if words_only == 1:
        where = "random words throughout: data.recall.word_fill"
    elif words_only:
        where = f"{words_only:.0%} of them random words throughout: data.recall.word_fill; the others' {drawn}"
    else:
        where = f"their {drawn}"
    if r.loss == "answers":
        where += "; the loss on their blocks' answers only: data.recall.loss"
    where += f"; keys, values and random passages from {len(mixture.lookup.pool.words):,} words"
    if r.pool_eval_words:
        where += " (the evaluation's among them: data.recall.pool_eval_words)"
    if r.word_roles != "split":
        roles = {"shared": "each a key or a value", "eval": "the evaluation's in its roles"}[r.word_roles]
        where += f", {roles} (data.recall.word_roles)"
    if r.warmup_words is not None:
        where += f", the first {r.warmup_sequences:,} from the first {r.warmup_words:,} only (data.recall.warmup_words)"
    if r.list_gap[1]:
        where += f"; {r.list_gap[0]}-{r.list_gap[1]} text tokens between a list's records and its separator"
        if r.filler_share:
            where += f" ({r.filler_share:.0%} of the lists: a run of one filler there and before the records)"
    if r.word_delimiter_share:
        where += f"; {r.word_delimiter_share:.0%} of the lists with a random word after each record"
    if r.bare_share:
        where += f"; {r.bare_share:.0%} of the records bare (data.recall.bare_share)"
        if r.bare_from:
            where += f" from retrieval sequence {r.bare_from:,} on"
    return (
        f"data: {text_rows:,} text sequences = {text_rows / windows:.2f} epochs of the corpus' {windows:,} windows "
        f"of {cfg.seq_len + 1} tokens ({len(mixture.text.tokens):,} tokens in its train split), and {recall_rows:,} "
        f"sequences with a retrieval block ({where})"
    )


def build_batches(
    cfg: DataConfig,
    *,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    split: str = "train",
    cache_dir: Optional[str] = None,
    total_samples: Optional[int] = None,
) -> BatchStream:
    """The batch stream of one rank for ``cfg``; see the module docstring. ``total_samples``: the run's global
    samples, with which prepared shards check up front that no source exceeds its ``max_epochs``."""
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is not allowed; choose one of {list(SPLITS)}")
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ConfigError(f"rank={rank!r} must be in [0, world_size={world_size!r})")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed={seed!r} must be an integer >= 0")
    cache_dir = cache_dir or default_cache_dir()
    where = dict(seed=seed, split=SPLITS[split], rank=rank, world_size=world_size)
    used = {
        k: v
        for k, v in json.loads(json.dumps(cfg.to_dict())).items()  # the fields this kind reads
        if k in ("kind", "seq_len")
        or k == cfg.kind
        or (cfg.kind == "mixture" and k in ("text", "lookup", "mixture_ratio"))
        or (cfg.kind == "pretrain" and k in ("text", "recall", "shares"))
        or (k == "lookup" and cfg.uses_lookup)
    }
    identity = {"seed": seed, "rank": rank, "world_size": world_size, "split": split, **_flat(used, "data.")}

    if cfg.kind == "shards":  # the same samples on any number of ranks: rank and world size are no identity
        identity = {k: v for k, v in identity.items() if k not in ("rank", "world_size", "data.shards.prefetch")}
        return build_shard_batches(
            cfg,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            split=SPLITS[split],
            identity=identity,
            total_samples=total_samples,
        )

    if cfg.kind == "lookup":
        fmt = lookup_format_for(cfg)
        source = LookupSequences(cfg.lookup, fmt, cfg.seq_len, **where)
        return BatchStream(
            source, batch_size=batch_size, identity=identity, vocab_size=fmt.vocab_size, lookup_format=fmt
        )

    reserve = cfg.kind == "mixture" and cfg.lookup.offset is None
    if reserve and cfg.text.tokenizer is not None:
        raise ConfigError(
            "data.lookup.offset is null (reserve ids for lookups in ckv's own BPE) but data.text.tokenizer is "
            "given; with a user tokenizer set data.lookup.offset to the first id of the lookup layout"
        )
    extra = lookup_special_tokens(cfg.lookup.format(0).layout_size) if reserve else []
    text = build_text_source(cfg.text, cfg.seq_len, extra_special_tokens=extra, cache_dir=cache_dir, **where)
    if cfg.kind == "pretrain":
        return BatchStream(
            pretrain_source(cfg, text, **where),
            batch_size=batch_size,
            identity=identity,
            vocab_size=text.vocab_size,
            tokenizer_path=text.tokenizer_path,
        )
    if cfg.kind == "text":
        return BatchStream(
            text,
            batch_size=batch_size,
            identity=identity,
            vocab_size=text.vocab_size,
            tokenizer_path=text.tokenizer_path,
        )

    fmt = lookup_format_for(cfg, text.tok)
    lookups = LookupSequences(cfg.lookup, fmt, cfg.seq_len, **where)
    source = Mixture(text, lookups, cfg.mixture_ratio)
    return BatchStream(
        source,
        batch_size=batch_size,
        identity=identity,
        vocab_size=text.vocab_size,
        tokenizer_path=text.tokenizer_path,
        lookup_format=fmt,
    )
