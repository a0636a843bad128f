"""Key and value vocabularies of the lookup task: ckv's synthetic layout, word lists, token-id ranges, or words
drawn from the model's own tokenizer.

``VocabSpec`` says where keys and values come from; ``build_codec`` turns it into a ``RecordCodec`` for one
model, checking that every word is a single token of the model's tokenizer and every id fits its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

from ckv.config import ConfigError
from ckv.data.lookup import LookupFormat, RecordCodec
from ckv.eval.codec import TokenCodec

SOURCES = ("auto", "format", "words", "ids", "tokenizer")
TokenSpec = Union[int, str, None]


class TextTokenizer(Protocol):
    """What evaluation needs from a tokenizer."""

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


class HFTokenizer:
    """A transformers tokenizer behind the ``TextTokenizer`` protocol (special tokens are never added)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.bos_id: Optional[int] = tok.bos_token_id
        self.unk_id: Optional[int] = tok.unk_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


@dataclass(frozen=True)
class VocabSpec:
    """Where lookup keys and values come from.

    ``source``:
      - ``format``: ckv's synthetic layout; ``format`` holds ``LookupFormat`` fields, or ``None`` to take the
        layout the model's run trained on.
      - ``words``: ``keys``/``values`` are word lists; each ``word_prefix + word`` must be ONE token.
      - ``ids``: ``keys``/``values`` are ``[start, stop)`` token-id ranges.
      - ``tokenizer``: ``n_tokens`` keys and as many values drawn from the model's own tokenizer: the tokens, in
        id order (a BPE's most frequent merges first), that decode to ``word_prefix`` + an ASCII word of at
        least two letters and encode back to themselves; alternately a key and a value.
      - ``auto``: ``format`` when the model trained on lookups (or ``format`` is given), else ``tokenizer``
        (a text-trained model has no synthetic layout).
    For ``words``/``ids``/``tokenizer``: ``pad`` (a single-token string or an id) fills padding, ``separator`` (a
    string or
    a list of ids) separates records from queries, ``bos`` is ``"auto"`` (the tokenizer's BOS, if any), an id
    or ``None``.
    """

    source: str = "format"
    format: Optional[dict] = None
    keys: Optional[list] = None
    values: Optional[list] = None
    word_prefix: str = " "
    pad: TokenSpec = None
    separator: Union[str, list, None] = None
    bos: TokenSpec = "auto"
    n_tokens: int = 64

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"task.vocab.source={self.source!r} is not allowed; choose one of {list(SOURCES)}")
        if not isinstance(self.n_tokens, int) or isinstance(self.n_tokens, bool) or self.n_tokens < 2:
            raise ConfigError(f"task.vocab.n_tokens={self.n_tokens!r} must be an integer >= 2")
        if self.source in ("format", "auto", "tokenizer") and (self.keys is not None or self.values is not None):
            raise ConfigError(
                f"task.vocab.keys/values are for source 'words' or 'ids'; source {self.source!r} "
                "takes keys and values from the lookup layout or the tokenizer"
            )
        if self.source == "format":
            return
        for name in ("keys", "values"):
            if self.source == "words" and not getattr(self, name):
                raise ConfigError(f"task.vocab.{name} is empty: give a non-empty word list")
        if self.pad is None:
            raise ConfigError(f"task.vocab.pad is required for source {self.source!r} (a single-token string or an id)")


def _one_token_problem(tok: TextTokenizer, text: str, ids: list[int]) -> Optional[str]:
    """Why ``text`` (encoded as ``ids``) is not one known token, or ``None`` when it is."""
    if len(ids) != 1:
        return f"{text!r} -> {len(ids)} tokens {ids}"
    if tok.unk_id is not None and ids[0] == tok.unk_id:
        return f"{text!r} -> the unknown token"
    return None


def _single_token(tok: TextTokenizer, text: str, what: str) -> int:
    ids = tok.encode(text)
    problem = _one_token_problem(tok, text, ids)
    if problem:
        raise ConfigError(f"{what}: {problem} in the model's tokenizer; it must be one token")
    return ids[0]


def _word_ids(tok: TextTokenizer, words: list, prefix: str, what: str) -> tuple[int, ...]:
    bad, ids = [], []
    for w in words:
        enc = tok.encode(prefix + str(w))
        problem = _one_token_problem(tok, prefix + str(w), enc)
        if problem:
            bad.append(problem)
        else:
            ids.append(enc[0])
    if bad:
        raise ConfigError(
            f"task.vocab.{what}: {len(bad)} of {len(words)} words are not single tokens in the "
            f"model's tokenizer (each must be one token): " + "; ".join(bad[:10])
        )
    dup = sorted({w for w, i in zip(words, ids) if ids.count(i) > 1})
    if dup:
        raise ConfigError(f"task.vocab.{what}: words map to the same token: {dup}")
    return tuple(ids)


def _id_range(spec: Any, what: str, vocab_size: int) -> tuple[int, ...]:
    if not (isinstance(spec, (list, tuple)) and len(spec) == 2 and all(isinstance(v, int) for v in spec)):
        raise ConfigError(f"task.vocab.{what}={spec!r} must be a [start, stop) pair of token ids")
    start, stop = spec
    if stop <= start:
        raise ConfigError(f"task.vocab.{what}=[{start}, {stop}) is an empty vocabulary")
    if start < 0 or stop > vocab_size:
        raise ConfigError(
            f"task.vocab.{what}=[{start}, {stop}) does not fit the model's vocabulary of {vocab_size} ids"
        )
    return tuple(range(start, stop))


def _token(spec: TokenSpec, tok: Optional[TextTokenizer], what: str, vocab_size: int) -> Optional[int]:
    if spec is None:
        return None
    if isinstance(spec, int) and not isinstance(spec, bool):
        if not 0 <= spec < vocab_size:
            raise ConfigError(f"task.vocab.{what}={spec} is outside the model's vocabulary of {vocab_size} ids")
        return spec
    if tok is None:
        raise ConfigError(f"task.vocab.{what}={spec!r} is text but the model has no tokenizer; give a token id")
    return _single_token(tok, str(spec), f"task.vocab.{what}")


def _separator(spec: Union[str, list, None], tok: Optional[TextTokenizer], vocab_size: int) -> list[int]:
    if spec is None:
        return []
    if isinstance(spec, str):
        if tok is None:
            raise ConfigError("task.vocab.separator is text but the model has no tokenizer; give a list of ids")
        return tok.encode(spec)
    return [_token(int(s), None, "separator", vocab_size) for s in spec]  # type: ignore[misc]


def tokenizer_words(
    tok: TextTokenizer, vocab_size: int, prefix: str, n: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``n`` key and ``n`` value ids drawn from ``tok`` (see ``VocabSpec``, source ``tokenizer``), disjoint."""
    found: list[int] = []
    for i in range(vocab_size):
        text = tok.decode([i])
        word = text[len(prefix) :]
        if (
            text.startswith(prefix)
            and len(word) >= 2
            and word.isascii()
            and word.isalpha()
            and _one_token_problem(tok, text, tok.encode(text)) is None
            and tok.encode(text)[0] == i
        ):
            found.append(i)
            if len(found) == 2 * n:
                return tuple(found[0::2]), tuple(found[1::2])
    raise ConfigError(
        f"task.vocab.source='tokenizer': the model's tokenizer has only {len(found)} single-token words "
        f"{prefix!r} + letters, {2 * n} needed; lower task.vocab.n_tokens (and task.n_records)"
    )


def resolve_format(spec: VocabSpec, run_format: Optional[LookupFormat], vocab_size: int) -> LookupFormat:
    """The synthetic layout to evaluate: the spec's, else the run's; it must fit the model's vocabulary."""
    if spec.format is not None:
        fmt = LookupFormat(**spec.format)
    elif run_format is not None:
        fmt = run_format
    else:
        raise ConfigError(
            "task.vocab.source='format' needs a lookup layout: the model's run has no lookup data "
            "config, so give task.vocab.format (LookupFormat fields) or use source 'words'/'ids'"
        )
    if fmt.vocab_size > vocab_size:
        raise ConfigError(
            f"the lookup layout needs ids up to {fmt.vocab_size - 1} but the model's vocabulary has "
            f"{vocab_size} ids: the checkpoint does not match this task's format"
        )
    return fmt


def build_codec(
    spec: VocabSpec, *, vocab_size: int, tokenizer: Optional[TextTokenizer], run_format: Optional[LookupFormat]
) -> RecordCodec:
    """The codec of ``spec`` for a model with ``vocab_size`` ids and (optionally) a tokenizer."""
    source = spec.source
    if source == "auto":
        source = "format" if spec.format is not None or run_format is not None else "tokenizer"
    if source == "format":
        return resolve_format(spec, run_format, vocab_size)
    if source == "tokenizer":
        if tokenizer is None:
            raise ConfigError(
                "task.vocab.source='tokenizer' needs a tokenizer, but the model has none and did not "
                "train on lookups; use source 'ids'"
            )
        keys, values = tokenizer_words(tokenizer, vocab_size, spec.word_prefix, spec.n_tokens)
        labels = {
            "keys": [tokenizer.decode([i]) for i in keys],
            "values": [tokenizer.decode([i]) for i in values],
            "drawn_from": "the model's tokenizer",
        }
    elif source == "words":
        if tokenizer is None:
            raise ConfigError(
                "task.vocab.source='words' needs a tokenizer, but the model has none "
                "(a ckv run keeps it in model/tokenizer.json); use source 'ids' instead"
            )
        keys = _word_ids(tokenizer, list(spec.keys), spec.word_prefix, "keys")  # type: ignore[arg-type]
        values = _word_ids(tokenizer, list(spec.values), spec.word_prefix, "values")  # type: ignore[arg-type]
        labels = {"keys": [str(k) for k in spec.keys], "values": [str(v) for v in spec.values]}  # type: ignore[union-attr]
    else:
        keys = _id_range(spec.keys, "keys", vocab_size)
        values = _id_range(spec.values, "values", vocab_size)
        labels = {}
    clash = sorted(set(keys) & set(values))
    if clash:
        raise ConfigError(f"task.vocab: keys and values share token ids {clash[:10]}; a lookup needs disjoint sets")
    if any(not 0 <= i < vocab_size for i in keys + values):
        raise ConfigError(f"task.vocab: some key/value ids lie outside the model's vocabulary of {vocab_size} ids")
    if spec.bos == "auto":
        bos = tokenizer.bos_id if tokenizer is not None else None
    else:
        bos = _token(spec.bos, tokenizer, "bos", vocab_size)
    pad = _token(spec.pad, tokenizer, "pad", vocab_size)
    separator = _separator(spec.separator, tokenizer, vocab_size)
    structural = {pad, *separator} | ({bos} if bos is not None else set())
    overlap = sorted(structural & (set(keys) | set(values)))
    if overlap:
        raise ConfigError(f"task.vocab: the pad/separator/bos ids {overlap} are also keys or values")
    return TokenCodec(
        key_ids=keys,
        value_ids=values,
        pad_id=pad,
        prefix=[] if bos is None else [bos],  # type: ignore[arg-type]
        separator=separator,
        labels=labels,
    )
