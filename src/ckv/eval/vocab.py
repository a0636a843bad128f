"""Key and value vocabularies of the lookup-style tasks: ckv's synthetic layout, word lists, token-id ranges, or
words drawn from the model's own tokenizer.

``VocabSpec`` says where keys and values come from and checks every field's type, range and disjointness on its
own; ``build_codec`` turns it into a ``RecordCodec`` for one model (its vocabulary size and tokenizer, no weights
needed), checking that every word is a single token of the model's tokenizer and every id fits its vocabulary.
Settings left at ``auto`` are picked from the model's tokenizer, deterministically; the codec says which
(``describe()["picked"]``) and how to repeat the run with them (``describe()["repeat"]``: eval.py overrides).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional, Union

from ckv.config import ConfigError, check_choice, check_int, field_names, reject_unknown
from ckv.data.lookup import LookupFormat, RecordCodec
from ckv.data.tokenizer import TextTokenizer, one_token_problem, single_token_words
from ckv.eval.codec import TokenCodec

log = logging.getLogger(__name__)
SOURCES = ("auto", "format", "words", "ids", "tokenizer")
AUTO = "auto"
TokenSpec = Union[int, str, None]
# the pad/filler and separator texts ``auto`` tries, in order: the first that is one known token of the tokenizer
STRUCTURAL_TEXTS = ("\n", ".", ",", ";", ":", "-", "|", "/", "=", "#")


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


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token(field: str, value: Any, *, none: bool = True) -> None:
    """A one-token setting: an id >= 0, a non-empty string (one token of the tokenizer, or ``"auto"``), or
    ``None`` when ``none``."""
    if value is None and none or _is_id(value) and value >= 0 or isinstance(value, str) and value:
        return
    allowed = ["a token id >= 0", "a one-token string", "auto"] + (["null"] if none else [])
    raise ConfigError(f"{field}={value!r} is not allowed; give {' or '.join(allowed)}")


def _check_words(field: str, words: Any) -> None:
    if isinstance(words, list) and not words:
        raise ConfigError(f"{field} is empty: give a non-empty word list")
    if not isinstance(words, list) or not all(isinstance(w, str) and w or _is_id(w) for w in words):
        raise ConfigError(f"{field}={words!r} must be a non-empty list of words (strings)")


def _check_range(field: str, value: Any) -> None:
    if not (isinstance(value, list) and len(value) == 2 and all(_is_id(v) for v in value)):
        raise ConfigError(f"{field}={value!r} must be a [start, stop) pair of token ids")
    if value[1] <= value[0]:
        raise ConfigError(f"{field}=[{value[0]}, {value[1]}) is an empty vocabulary; give 0 <= start < stop")
    if value[0] < 0:
        raise ConfigError(f"{field}=[{value[0]}, {value[1]}) starts below 0; give 0 <= start < stop")


@dataclass(frozen=True)
class VocabSpec:
    """Where lookup keys and values come from (docs/evaluation.md, "Vocabularies").

    ``source``:
      - ``format``: ckv's synthetic layout; ``format`` holds ``LookupFormat`` fields, or ``None`` to take the
        layout the model's run trained on.
      - ``words``: ``keys``/``values`` are word lists; each ``word_prefix + word`` must be ONE token.
      - ``ids``: ``keys``/``values`` are ``[start, stop)`` token-id ranges.
      - ``tokenizer``: ``n_tokens`` keys and as many values drawn from the model's own tokenizer: the tokens, in
        id order (a BPE's most frequent merges first), whose text is (a space and) an ASCII word of at least two
        letters and for which ``word_prefix + word`` encodes to that one token; alternately a key and a value.
      - ``auto``: ``format`` when the model trained on lookups (or ``format`` is given); ``words`` with the
        run's ``data.recall.eval_keys`` / ``eval_values`` for a pretraining run (``data.kind: pretrain``: the words
        its training held out for this evaluation; ``pad`` and ``separator`` left at auto: its
        ``data.recall.eval_pad``; ``bos`` left at auto: its end-of-document token, as a document opens in
        training); else ``tokenizer`` (a text-trained or transformers model).
    For ``words``/``ids``/``tokenizer``: ``pad`` (a one-token string or an id) fills padding and the gaps between
    records, ``separator`` (a string, an id or a list of ids; ``None``: none) separates records from queries,
    ``bos`` is an id, a one-token string or ``None``; each may be ``"auto"``: ``pad`` and ``separator`` the first
    of ``STRUCTURAL_TEXTS`` that is one token of the tokenizer, ``bos`` the tokenizer's BOS if it has one.
    """

    source: str = AUTO
    format: Optional[dict] = None
    keys: Optional[list] = None
    values: Optional[list] = None
    word_prefix: str = " "
    pad: TokenSpec = AUTO
    separator: Union[str, int, list, None] = AUTO
    bos: TokenSpec = AUTO
    n_tokens: int = 64

    def __post_init__(self) -> None:
        v = "task.vocab"
        check_choice(f"{v}.source", self.source, SOURCES)
        check_int(f"{v}.n_tokens", self.n_tokens, 2)
        if not isinstance(self.word_prefix, str):
            raise ConfigError(f"{v}.word_prefix={self.word_prefix!r} must be a string (e.g. ' ')")
        if self.format is not None:
            if not isinstance(self.format, dict):
                raise ConfigError(f"{v}.format={self.format!r} must be null or a mapping of LookupFormat fields")
            lookup_format(self.format)  # checks its fields now
            if self.source not in ("format", AUTO):
                raise ConfigError(f"{v}.format is for source 'format' or 'auto', not {self.source!r}")
        if self.source in ("format", AUTO, "tokenizer"):
            for name in ("keys", "values"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"{v}.{name} is for source 'words' or 'ids'; source {self.source!r} takes keys and values "
                        "from the lookup layout or the tokenizer"
                    )
        else:
            for name in ("keys", "values"):
                if getattr(self, name) is None:
                    raise ConfigError(f"{v}.{name} is required for source {self.source!r}")
                (_check_words if self.source == "words" else _check_range)(f"{v}.{name}", getattr(self, name))
        check_token(f"{v}.pad", self.pad)  # null only for source format (checked where the source is resolved)
        check_token(f"{v}.bos", self.bos)
        sep = self.separator
        if isinstance(sep, list):
            if not all(_is_id(i) and i >= 0 for i in sep):
                raise ConfigError(f"{v}.separator={sep!r}: a list must hold token ids >= 0")
        elif not (sep is None or isinstance(sep, str) or _is_id(sep) and sep >= 0):
            raise ConfigError(f"{v}.separator={sep!r} is not allowed; give a string, an id >= 0, a list of ids or null")
        if self.source == "ids":
            self._check_disjoint_ids()

    def _check_disjoint_ids(self) -> None:
        keys, values = range(*self.keys), range(*self.values)  # type: ignore[misc]
        if keys.start < values.stop and values.start < keys.stop:
            shared = [max(keys.start, values.start), min(keys.stop, values.stop)]
            raise ConfigError(
                f"task.vocab: keys and values share token ids {shared} (task.vocab.keys={self.keys}, "
                f"task.vocab.values={self.values}); a lookup needs disjoint sets"
            )
        sep = self.separator if isinstance(self.separator, list) else [self.separator]
        taken = {
            name: [i for i in ids if _is_id(i) and (i in keys or i in values)]
            for name, ids in (("pad", [self.pad]), ("separator", sep), ("bos", [self.bos]))
        }
        clash = sorted({i for ids in taken.values() for i in ids})
        if clash:
            names = "/".join(f"task.vocab.{name}" for name, ids in taken.items() if ids)
            raise ConfigError(f"{names}: the pad/separator/bos ids {clash} are also keys or values")


def vocab_spec(value: Any) -> VocabSpec:
    """``value`` (a ``VocabSpec`` or the ``task.vocab`` mapping) as a ``VocabSpec``; unknown keys are an error."""
    if isinstance(value, VocabSpec):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"task.vocab={value!r} must be a mapping of vocabulary settings (source, keys, ...)")
    reject_unknown(value, field_names(VocabSpec), "task.vocab")
    return VocabSpec(**value)


def lookup_format(fields: dict) -> LookupFormat:
    """``LookupFormat(**fields)``, its errors naming ``task.vocab.format``."""
    reject_unknown(fields, field_names(LookupFormat), "task.vocab.format")
    try:
        return LookupFormat(**fields)
    except ConfigError as e:
        raise ConfigError(f"task.vocab.format: {e}") from e


def single_token(tok: TextTokenizer, text: str, what: str) -> int:
    ids = tok.encode(text)
    problem = one_token_problem(tok, text, ids)
    if problem:
        raise ConfigError(f"{what}: {problem} in the model's tokenizer; it must be one token")
    return ids[0]


def _word_ids(tok: TextTokenizer, words: list, prefix: str, what: str) -> tuple[int, ...]:
    bad, ids = [], []
    for w in words:
        enc = tok.encode(prefix + str(w))
        problem = one_token_problem(tok, prefix + str(w), enc)
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


def _fits(what: str, ids: Any, vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"task.vocab.{what}: id {bad[0]} does not fit the model's vocabulary of {vocab_size} ids")


def _token(spec: TokenSpec, tok: Optional[TextTokenizer], what: str, vocab_size: int) -> Optional[int]:
    if spec is None:
        return None
    if _is_id(spec):
        _fits(what, [spec], vocab_size)
        return int(spec)  # type: ignore[arg-type]
    if tok is None:
        raise ConfigError(f"task.vocab.{what}={spec!r} is text but the model has no tokenizer; give a token id")
    return single_token(tok, str(spec), f"task.vocab.{what}")


def _separator(spec: Union[str, int, list, None], tok: Optional[TextTokenizer], vocab_size: int) -> list[int]:
    if spec is None:
        return []
    if isinstance(spec, str):
        if tok is None:
            raise ConfigError("task.vocab.separator is text but the model has no tokenizer; give a list of ids")
        return tok.encode(spec)
    ids = [spec] if _is_id(spec) else list(spec)
    _fits("separator", ids, vocab_size)
    return ids


def tokenizer_words(
    tok: TextTokenizer, vocab_size: int, prefix: str, n: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``n`` key and ``n`` value ids drawn from ``tok`` (see ``VocabSpec``, source ``tokenizer``), disjoint: the
    first ``2 n`` of ``ckv.data.tokenizer.single_token_words`` (in id order), keys at even and values at odd
    places. ``data.kind: pretrain`` holds the same words out of its retrieval sequences."""
    found = single_token_words(tok, vocab_size, prefix, limit=2 * n)
    if len(found) < 2 * n:
        raise ConfigError(
            f"task.vocab.source='tokenizer': the model's tokenizer has only {len(found)} single-token words "
            f"{prefix!r} + letters, {2 * n} needed; lower task.vocab.n_tokens (and task.n_records)"
        )
    return tuple(found[0::2]), tuple(found[1::2])


def structural_token(tok: Optional[TextTokenizer], exclude: set[int], what: str) -> tuple[int, str]:
    """The id and text of the first of ``STRUCTURAL_TEXTS`` that is one known token of ``tok`` outside
    ``exclude`` (for ``task.vocab.<what>=auto``)."""
    if tok is None:
        raise ConfigError(f"task.vocab.{what}=auto needs the model's tokenizer, but it has none; give an id")
    for text in STRUCTURAL_TEXTS:
        ids = tok.encode(text)
        if one_token_problem(tok, text, ids) is None and ids[0] not in exclude:
            return ids[0], text
    raise ConfigError(
        f"task.vocab.{what}=auto: none of {list(STRUCTURAL_TEXTS)} is one token of the model's tokenizer "
        f"outside the keys and values; give task.vocab.{what}=<id>"
    )


def resolve_format(spec: VocabSpec, run_format: Optional[LookupFormat], vocab_size: int) -> LookupFormat:
    """The synthetic layout to evaluate: the spec's, else the run's; it must fit the model's vocabulary."""
    if spec.format is not None:
        fmt = lookup_format(spec.format)
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


def _quoted(words: list[str]) -> str:
    return "[" + ",".join(f"'{w}'" for w in words) + "]"


def _repeat(
    source: str, spec: VocabSpec, labels: dict, pad: int, separator: list[int], bos: Optional[int]
) -> list[str]:
    """Hydra overrides of eval.py that give the same vocabulary without any ``auto`` setting."""
    out = [f"task.vocab.source={source}"]
    if source == "words":  # the words without the one leading space a decoded token may carry
        words = {k: [w[1:] if w.startswith(" ") else w for w in labels[k]] for k in ("keys", "values")}
        out += [f"task.vocab.keys={_quoted(words['keys'])}", f"task.vocab.values={_quoted(words['values'])}"]
        if spec.word_prefix != " ":
            out.append(f"task.vocab.word_prefix={spec.word_prefix!r}")
    else:
        out += [
            f"task.vocab.keys=[{spec.keys[0]},{spec.keys[1]}]",
            f"task.vocab.values=[{spec.values[0]},{spec.values[1]}]",
        ]  # type: ignore[index]
    sep = ",".join(map(str, separator))
    return out + [
        f"task.vocab.pad={pad}",
        f"task.vocab.separator=[{sep}]",
        f"task.vocab.bos={'null' if bos is None else bos}",
    ]


def build_codec(
    spec: VocabSpec,
    *,
    vocab_size: int,
    tokenizer: Optional[TextTokenizer],
    run_format: Optional[LookupFormat],
    run_words: Optional[dict[str, Any]] = None,
) -> RecordCodec:
    """The codec of ``spec`` for a model with ``vocab_size`` ids and (optionally) a tokenizer. ``auto`` settings
    are picked from the tokenizer and logged in one line. ``run_words``: the keys, values and pad a pretraining run
    held out of its training for this evaluation (``data.recall.eval_keys`` / ``eval_values`` / ``eval_pad``) and its
    end-of-document token, which ``auto`` takes (the pad also as the separator, the end-of-document token as bos)."""
    source = spec.source
    if source == AUTO and run_format is None and spec.format is None and run_words is not None:
        pad, sep = (run_words["pad"] if x == AUTO else x for x in (spec.pad, spec.separator))
        bos = run_words["bos"] if spec.bos == AUTO else spec.bos
        spec = dataclasses.replace(
            spec, source="words", keys=run_words["keys"], values=run_words["values"], pad=pad, separator=sep, bos=bos
        )
        source = "words"
    if source == AUTO:
        source = "format" if spec.format is not None or run_format is not None else "tokenizer"
    if source == "format":
        return resolve_format(spec, run_format, vocab_size)
    if spec.pad is None:
        raise ConfigError(f"task.vocab.pad is required for source {source!r}: give an id, a one-token string or auto")
    picked: dict[str, Any] = {}
    if source == "tokenizer":
        if tokenizer is None:
            raise ConfigError(
                "the model has neither a lookup layout nor a tokenizer (task.vocab.source=auto needs a lookup layout "
                "or a tokenizer), so ckv cannot pick keys and values: set "
                "task.vocab.source=ids 'task.vocab.keys=[<start>,<stop>]' 'task.vocab.values=[<start>,<stop>]' "
                "task.vocab.pad=<id> 'task.vocab.separator=[<id>]' (ids of ordinary tokens), or model.tokenizer=<dir>"
            )
        keys, values = tokenizer_words(tokenizer, vocab_size, spec.word_prefix, spec.n_tokens)
        labels = {
            "keys": [tokenizer.decode([i]) for i in keys],
            "values": [tokenizer.decode([i]) for i in values],
            "drawn_from": "the model's tokenizer",
        }
        picked["keys"] = f"{len(keys)}: {', '.join(map(repr, labels['keys'][:3]))}, ..."
        picked["values"] = f"{len(values)}: {', '.join(map(repr, labels['values'][:3]))}, ..."
        repeat_source = "words"
    elif source == "words":
        if tokenizer is None:
            raise ConfigError(
                "task.vocab.source='words' needs a tokenizer, but the model has none "
                "(a ckv run keeps it in model/tokenizer.json); use source 'ids' instead"
            )
        keys = _word_ids(tokenizer, list(spec.keys), spec.word_prefix, "keys")  # type: ignore[arg-type]
        values = _word_ids(tokenizer, list(spec.values), spec.word_prefix, "values")  # type: ignore[arg-type]
        labels = {"keys": [str(k) for k in spec.keys], "values": [str(v) for v in spec.values]}  # type: ignore[union-attr]
        repeat_source = "words"
    else:
        _fits("keys", [spec.keys[1] - 1], vocab_size)  # type: ignore[index]
        _fits("values", [spec.values[1] - 1], vocab_size)  # type: ignore[index]
        keys, values = tuple(range(*spec.keys)), tuple(range(*spec.values))  # type: ignore[misc]
        labels = {}
        repeat_source = "ids"
    clash = sorted(set(keys) & set(values))
    if clash:
        raise ConfigError(f"task.vocab: keys and values share token ids {clash[:10]}; a lookup needs disjoint sets")
    taken = set(keys) | set(values)
    if spec.bos == AUTO:
        bos = tokenizer.bos_id if tokenizer is not None else None
        picked["bos"] = "none (the tokenizer has no BOS)" if bos is None else f"the tokenizer's BOS (id {bos})"
    else:
        bos = _token(spec.bos, tokenizer, "bos", vocab_size)
    if spec.pad == AUTO:
        pad, text = structural_token(tokenizer, taken, "pad")
        picked["pad"] = f"{text!r} (id {pad})"
    else:
        pad = _token(spec.pad, tokenizer, "pad", vocab_size)  # type: ignore[assignment]
    if spec.separator == AUTO:
        sep_id, text = structural_token(tokenizer, taken, "separator")
        separator = [sep_id]
        picked["separator"] = f"{text!r} (id {sep_id})"
    else:
        separator = _separator(spec.separator, tokenizer, vocab_size)
    structural = {pad, *separator} | ({bos} if bos is not None else set())
    overlap = sorted(structural & taken)
    if overlap:
        raise ConfigError(f"task.vocab: the pad/separator/bos ids {overlap} are also keys or values")
    if picked:
        labels["picked"] = picked
        labels["repeat"] = _repeat(repeat_source, spec, labels, pad, separator, bos)  # type: ignore[arg-type]
        log.info(
            "picked from the model's tokenizer: %s (results.json: results.codec.repeat repeats them)",
            "; ".join(f"{k} {v}" for k, v in picked.items()),
        )
    return TokenCodec(
        key_ids=keys,
        value_ids=values,
        pad_id=pad,  # type: ignore[arg-type]
        prefix=[] if bos is None else [bos],
        separator=separator,
        labels=labels,
    )
