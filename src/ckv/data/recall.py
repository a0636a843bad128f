"""Retrieval-bearing sequences for pretraining (``data.kind: pretrain``), in templates the lookup evaluation never
uses, mixed with corpus text.

The lookup evaluation of a pretrained run (``task=lookup``, ``task.vocab.source`` auto) lays out
``[pad]* k v k v ... k v [pad]* sep (k v){n_demos} k``: its keys and values are the run's ``data.recall.eval_keys``
/ ``eval_values`` (animals and names in conf/data/pretrain.yaml, as the paper's animal->name lookup), records back to
back, its pad and separator the run's ``data.recall.eval_pad`` (``"."``: a token the corpus holds, so that the
model knows it). A model pretrained here must learn retrieval without ever seeing that layout. Every sequence is
``seq_len + 1`` tokens of corpus text with one retrieval block placed at a random point (after ``text_before`` tokens
of text), trained with the language-model loss on every token, like text. Two kinds of block:

- ``list``: an associative list: ``n`` records ``k v`` each followed by a delimiter ``d`` (a random word for
  ``word_delimiter_share`` of the lists; nothing for ``bare_share`` of the records), ``list_gap`` tokens of corpus
  text (for ``filler_share`` of the lists a run of one filler token, and another before the records), then a
  separator ``s``, then
  ``q`` distinct records asked again as ``k v d`` (``d``, ``s`` drawn per sequence from ``delimiters`` /
  ``separators``; keys distinct, values with replacement). Keys and values come from the tokenizer's single-token
  words (``single_token_words``) other than the evaluation's (all of them with ``pool_eval_words``), alternately
  (``word_roles: split``), every word in either role (``shared``: a list's values are never its own keys), or
  alternately except the evaluation's words, in its roles (``eval``: its keys only keys, its values only values);
- ``repeat``: a passage of ``repeat_len`` tokens, ``repeat_gap`` tokens of other text, then the same passage again:
  corpus text (induction on natural text), or, for ``word_repeat_share`` of them, words drawn at random from the
  lists' keys and values (the repeated random tokens on which small models form induction heads); with
  ``word_fill`` such a sequence is random words throughout (``word_repeat``: no corpus text around the passage).

What the evaluation uses is held out: its pad/separator token is never a delimiter or separator (``check_held_out``,
one ``ConfigError`` line), never more than ``MAX_RECORD_RUN`` records stand back to back (its prompts hold at least
8: ``bare_share`` lets up to 7 do so; none without it), and its words serve as list keys or values only with
``pool_eval_words`` (as any other word; never as a delimiter or separator).
``longest_record_run`` measures how much of an evaluation prompt's record block a token stream contains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ckv.config import ConfigError
from ckv.data.config import RecallConfig
from ckv.data.stream import IGNORE, rng_for
from ckv.data.tokenizer import TextTokenizer, one_token_problem, single_token_words

RECALL_SALT = 2  # keeps recall draws apart from text shuffles (0) and lookup draws (1) made with the same seed
MAX_RECORD_RUN = 7  # records a list may hold back to back: the evaluation's prompts hold runs of at least 8
WORD_PREFIX = " "  # a key/value token is " " + an ASCII word, as the evaluation's task.vocab.word_prefix


@dataclass(frozen=True)
class RecallVocab:
    """The token ids the list blocks draw from, and what the evaluation would use (held out)."""

    keys: np.ndarray  # (K,) key ids
    values: np.ndarray  # (V,) value ids
    delimiters: tuple[int, ...]
    separators: tuple[int, ...]
    fillers: tuple[int, ...]
    eval_keys: np.ndarray  # the evaluation's key ids (data.recall.eval_keys)
    eval_values: np.ndarray
    eval_structural: int  # the evaluation's pad and separator (data.recall.eval_pad)


def _one_token_ids(tok: TextTokenizer, texts: list[str], field: str) -> tuple[int, ...]:
    ids = []
    for text in texts:
        enc = tok.encode(text)
        problem = one_token_problem(tok, text, enc)
        if problem:
            raise ConfigError(f"{field}: {problem} in the tokenizer; each must be one token")
        ids.append(enc[0])
    return tuple(ids)


def recall_vocab(cfg: RecallConfig, tok: TextTokenizer, vocab_size: int) -> RecallVocab:
    """Resolve ``cfg``'s words and structural texts for ``tok``; ``ConfigError`` (one line) when one is not one
    token, when there are too few words, or when anything the evaluation uses would appear (``check_held_out``)."""
    o = "data.recall"
    eval_keys = _one_token_ids(tok, [WORD_PREFIX + w for w in cfg.eval_keys or []], f"{o}.eval_keys")
    eval_values = _one_token_ids(tok, [WORD_PREFIX + w for w in cfg.eval_values or []], f"{o}.eval_values")
    held = set() if cfg.pool_eval_words else set(eval_keys) | set(eval_values)
    words = [w for w in single_token_words(tok, vocab_size, WORD_PREFIX) if w not in held][: cfg.word_pool]
    if len(words) < 2 * cfg.n_records[1]:
        pool = f"data.recall.word_pool={cfg.word_pool} leaves" if cfg.word_pool else "the tokenizer has"
        fix = "raise data.recall.word_pool" if cfg.word_pool else "raise data.text.vocab_size"
        raise ConfigError(
            f"{o}: {pool} {len(words)} single-token words besides the evaluation's; a list needs "
            f"{2 * cfg.n_records[1]} (n_records hi {cfg.n_records[1]} keys and as many values): {fix} or lower "
            "data.recall.n_records"
        )
    (pad,) = _one_token_ids(tok, [cfg.eval_pad], f"{o}.eval_pad")
    keys, values = word_roles(cfg.word_roles, np.asarray(words, dtype=np.int64), eval_keys, eval_values)
    vocab = RecallVocab(
        keys=keys,
        values=values,
        delimiters=_one_token_ids(tok, cfg.delimiters, f"{o}.delimiters"),
        separators=_one_token_ids(tok, cfg.separators, f"{o}.separators"),
        fillers=_one_token_ids(tok, cfg.fillers, f"{o}.fillers"),
        eval_keys=np.asarray(eval_keys, dtype=np.int64),
        eval_values=np.asarray(eval_values, dtype=np.int64),
        eval_structural=pad,
    )
    check_held_out(cfg, vocab, tok)
    return vocab


def word_roles(
    roles: str, words: np.ndarray, eval_keys: tuple[int, ...], eval_values: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """The pool ``words`` (W,) (ids in order) as list keys and values under ``data.recall.word_roles``: ``split``
    alternately; ``shared`` every word both; ``eval`` alternately except the evaluation's keys (only keys) and values
    (only values) among them, each part in id order."""
    if roles == "shared":
        return words, words
    if roles == "split":
        return words[0::2], words[1::2]
    is_key, is_value = np.isin(words, eval_keys), np.isin(words, eval_values)
    other = words[~(is_key | is_value)]
    return np.sort(np.concatenate([other[0::2], words[is_key]])), np.sort(
        np.concatenate([other[1::2], words[is_value]])
    )


def values_besides(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The ``values`` (V,) that are none of a list's ``keys`` (its candidate values when every word may be both,
    ``word_roles: shared``), in id order."""
    return np.setdiff1d(values, keys)


def check_held_out(cfg: RecallConfig, vocab: RecallVocab, tok: TextTokenizer) -> None:
    """``ConfigError`` naming the clash when a list block could use what the evaluation uses: its pad/separator
    or one of its words as a delimiter or separator (its words are list keys or values only with
    ``pool_eval_words``)."""
    eval_words = set(vocab.eval_keys.tolist()) | set(vocab.eval_values.tolist())
    for name in ("delimiters", "separators", "fillers"):
        for tid, text in zip(getattr(vocab, name), getattr(cfg, name)):
            if tid == vocab.eval_structural:
                raise ConfigError(
                    f"data.recall.{name} holds {text!r}, the lookup evaluation's pad and separator "
                    f"({tok.decode([vocab.eval_structural])!r}): an evaluation template would be in the training data; "
                    "choose other texts"
                )
            if tid in eval_words:
                raise ConfigError(
                    f"data.recall.{name} holds {text!r}, one of the lookup evaluation's key/value words: an "
                    "evaluation template would be in the training data; choose other texts"
                )


def longest_record_run(tokens: np.ndarray, keys: np.ndarray, values: np.ndarray) -> int:
    """The most records ``k v`` (``k`` in ``keys``, ``v`` in ``values``) that lie back to back anywhere in
    ``tokens`` (N,): an evaluation prompt's record block and demonstrations are one such run (records + demos)."""
    t = np.asarray(tokens)
    if len(t) < 2:
        return 0
    pair = np.isin(t[:-1], keys) & np.isin(t[1:], values)  # (N-1,) a record starts at i
    best = 0
    for parity in (0, 1):
        p = pair[parity::2].astype(np.int8)
        if not p.any():
            continue
        edges = np.diff(np.concatenate(([0], p, [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        best = max(best, int((ends - starts).max()))
    return best


@dataclass(frozen=True)
class WordPool:
    """The words a block draws from: list keys (K,), list values (V,) and both, for random passages (K + V,; the
    one array when ``shared``: every word both a key and a value)."""

    keys: np.ndarray
    values: np.ndarray
    words: np.ndarray
    shared: bool = False

    @classmethod
    def of(cls, keys: np.ndarray, values: np.ndarray, shared: bool = False) -> WordPool:
        return cls(keys, values, keys if shared else np.concatenate([keys, values]), shared)


class RecallSequences:
    """Endless pretraining sequences with one retrieval block each (a ``SequenceSource``). Sequence ``g`` of a split
    is drawn from its own generator ``(seed, split, RECALL_SALT, g)``; its text comes from ``text_tokens`` (the
    split's packed corpus, (N,)), at offsets that generator draws. State: one counter. ``DataConfig`` checks that
    the longest block fits ``seq_len``."""

    def __init__(
        self,
        cfg: RecallConfig,
        vocab: RecallVocab,
        text_tokens: np.ndarray,
        seq_len: int,
        *,
        seed: int,
        split: int,
        rank: int,
        world_size: int,
    ) -> None:
        if len(text_tokens) < 2 * (seq_len + 1):
            raise ConfigError(
                f"data.recall: the corpus split has {len(text_tokens)} tokens, fewer than two sequences of "
                f"{seq_len + 1}; add text or lower data.seq_len"
            )
        self.cfg, self.vocab, self.text, self.seq_len = cfg, vocab, text_tokens, seq_len
        shared = cfg.word_roles == "shared"
        self.pool = WordPool.of(vocab.keys, vocab.values, shared)
        self.warm_pool = None  # the first warmup_sequences sequences' words (the first warmup_words of the pool)
        if cfg.warmup_words is not None:
            w = cfg.warmup_words
            if not 2 * cfg.n_records[1] <= w <= len(self.pool.words):
                raise ConfigError(
                    f"data.recall.warmup_words={w} must lie in [{2 * cfg.n_records[1]}, {len(self.pool.words)}]: a "
                    f"list needs n_records hi {cfg.n_records[1]} keys and as many values, and the warm-up draws from "
                    f"the pool's {len(self.pool.words)} words"
                )
            if shared:  # the first w words, each a key or a value
                self.warm_pool = WordPool.of(vocab.keys[:w], vocab.values[:w], shared)
            else:  # the first w words of the pool, alternately keys and values
                self.warm_pool = WordPool.of(vocab.keys[: (w + 1) // 2], vocab.values[: w // 2])
        self.seed, self.split, self.rank, self.world_size = seed, split, rank, world_size
        self.index = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        self.index += 1
        return self.sample((self.index - 1) * self.world_size + self.rank)

    def _text(self, rng: np.random.Generator, n: int) -> np.ndarray:
        start = int(rng.integers(0, len(self.text) - n + 1))
        return np.asarray(self.text[start : start + n], dtype=np.int64)

    def _fill(self, rng: np.random.Generator, n: int, kind: str, pool: WordPool) -> np.ndarray:
        """``n`` tokens around or inside a block: random words for a ``word_repeat`` block, else corpus text."""
        return rng.choice(pool.words, n) if kind == "word_repeat" else self._text(rng, n)

    def pool_of(self, g: int) -> WordPool:
        """The words sequence ``g`` draws from: the warm-up's for the first ``warmup_sequences``, else the pool."""
        return self.warm_pool if self.warm_pool is not None and g < self.cfg.warmup_sequences else self.pool

    def block(
        self, rng: np.random.Generator, pool: Optional[WordPool] = None, bare_share: Optional[float] = None
    ) -> tuple[str, np.ndarray, np.ndarray]:
        """One retrieval block drawn with ``rng`` from ``pool`` (default: the run's pool): its kind (``list``,
        ``repeat``, or ``word_repeat`` when ``word_fill`` makes a random-word passage's sequence all words: the
        module docstring), tokens (L,) and which of them are answers (L,) bool: the asked records' values of a
        list, the second passage after its first token (what retrieval predicts; ``loss: answers`` trains on these
        only). ``bare_share``: the share of bare records (default: the run's ``bare_share``)."""
        c, v = self.cfg, self.vocab
        pool = self.pool if pool is None else pool
        bare = c.bare_share if bare_share is None else bare_share
        if rng.random() < c.repeat_share:
            n = int(rng.integers(c.repeat_len[0], c.repeat_len[1] + 1))
            words = rng.random() < c.word_repeat_share
            kind = "word_repeat" if words and c.word_fill else "repeat"
            passage = rng.choice(pool.words, n) if words else self._text(rng, n)
            gap = self._fill(rng, int(rng.integers(c.repeat_gap[0], c.repeat_gap[1] + 1)), kind, pool)
            tokens = np.concatenate([passage, gap, passage])
            answers = np.zeros(len(tokens), dtype=bool)
            answers[len(tokens) - n + 1 :] = True
            return kind, tokens, answers
        n = int(rng.integers(c.n_records[0], c.n_records[1] + 1))
        q = min(int(rng.integers(c.n_queries[0], c.n_queries[1] + 1)), n)
        keys = rng.choice(pool.keys, n, replace=False)
        values = rng.choice(values_besides(pool.values, keys) if pool.shared else pool.values, n, replace=True)
        delim = v.delimiters[int(rng.integers(len(v.delimiters)))]
        sep = v.separators[int(rng.integers(len(v.separators)))]
        asked = rng.choice(n, q, replace=False)
        # the token after each record: the list's delimiter, or (word_delimiter_share of lists) a random word each
        if c.word_delimiter_share and rng.random() < c.word_delimiter_share:
            after, after_q = rng.choice(pool.words, n), rng.choice(pool.words, q)
        else:
            after, after_q = np.full(n, delim), np.full(q, delim)
        records, _ = self._records(rng, keys, values, after, bare)  # k v d ... (bare records: k v)
        queries, asked_values = self._records(rng, keys[asked], values[asked], after_q, bare)
        # corpus text between the records and the separator, or (filler_share) a run of one filler token there and
        # another before the records; drawn only when list_gap allows some (the draws of a run without it unchanged)
        before, gap = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        lo, hi = c.list_gap[0], c.list_gap[1] + 1
        if c.list_gap[1]:
            if c.filler_share and rng.random() < c.filler_share:
                f = v.fillers[int(rng.integers(len(v.fillers)))]
                before, gap = np.full(int(rng.integers(lo, hi)), f), np.full(int(rng.integers(lo, hi)), f)
            else:
                gap = self._text(rng, int(rng.integers(lo, hi)))
        tokens = np.concatenate([before, records, gap, [sep], queries]).astype(np.int64)
        lead = len(before) + len(records) + len(gap) + 1  # everything before the queries
        answers = np.concatenate([np.zeros(lead, dtype=bool), asked_values])  # each asked record's value
        return "list", tokens, answers

    @staticmethod
    def _records(
        rng: np.random.Generator, keys: np.ndarray, values: np.ndarray, after: np.ndarray, bare_share: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Records ``k v a`` (L,) and which tokens are their values (L,) bool; ``bare_share`` of them (each drawn
        on its own) lose their ``a``, at most ``MAX_RECORD_RUN - 1`` bare records in a row and never the last (so no
        more than ``MAX_RECORD_RUN`` records back to back, none running into the text after the block)."""
        n = len(keys)
        keep = np.ones(n, dtype=bool)  # (n,) the record keeps its trailing token
        if bare_share:
            bare, run = rng.random(n) < bare_share, 0
            for i in range(n):
                run = run + 1 if bare[i] and run < MAX_RECORD_RUN - 1 else 0
                keep[i] = run == 0
            keep[-1] = True
        grid = np.stack([keys, values, after], axis=1)  # (n, 3) k v a
        used = np.ones((n, 3), dtype=bool)
        used[:, 2] = keep  # a bare record drops its trailing token
        is_value = np.zeros((n, 3), dtype=bool)
        is_value[:, 1] = True
        return grid[used], is_value[used]

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence number ``g`` of the split counted over all ranks: text, a block, more text (random words
        instead of text around a ``word_repeat`` block); the LM loss on every token, or on the block's answers
        only (``loss: answers``; the others' labels ``IGNORE``)."""
        rng = rng_for(self.seed, self.split, RECALL_SALT, g)
        before = int(rng.integers(self.cfg.text_before[0], self.cfg.text_before[1] + 1))
        pool = self.pool_of(g)
        kind, block, answers = self.block(rng, pool, 0.0 if g < self.cfg.bare_from else None)
        after = self.seq_len + 1 - before - len(block)
        fill = [self._fill(rng, before, kind, pool), block, self._fill(rng, after, kind, pool)]
        tokens = np.concatenate(fill)  # (T+1,)
        labels = tokens[1:].copy()  # (T,) label i is token i + 1
        if self.cfg.loss == "answers":
            scored = np.zeros(len(tokens), dtype=bool)
            scored[before : before + len(block)] = answers
            labels[~scored[1:]] = IGNORE
        return tokens[:-1], labels

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])
