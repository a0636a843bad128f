"""The position-matched needle test (the paper's headline measurement of DeepSeek-V4), for ckv and HF models.

A prompt of exactly ``context_tokens`` tokens: ``prefix`` then a haystack of N records of ``record_len`` tokens
(a key of ``record_len - 1`` tokens and a one-token value; or the run's own layout when its records have that
length, e.g. ckv's ``kkvv``) with filler tokens between them, then the separator and the question (the target
record's key). Score: full-vocabulary top-1 of the target's (first) value token at the last position. Keys are
distinct within a prompt. The paper's setting (128K context, about 16,000 four-token records, 256 prompts per
residue of the target position mod 8) is the default; the record count defaults to ``context_tokens //
(2 * record_len)`` (16,384 at 128K: records fill half the haystack, filler the rest), our reading of "about
16,000" (the paper does not state its filler).

Position design: the paired, moment-matched schedule of ``ckv.eval.design`` (``base_offsets``): base example
``i`` (one key->value mapping, ``prompts_per_residue`` of them) is scored at every shift ``k = 0..M-1`` (``k``
filler tokens moved from after the target to before it), so every residue group ``t_K mod M`` holds one prompt
per base example and comparisons between groups are paired. Here each base offset is moved deeper into the
haystack by ``M * level``, where the depth level depends only on the block of ``M^2`` base examples and on the
schedule's ``u`` index: for a fixed residue ``s``, ``u`` still runs over ``0..M-1`` in every block, so
``E[B | B mod M]`` stays the same for every residue and the design's proof (docs/evaluation.md) holds
unchanged: mean and variance of the target position are exactly equal across residues when
``prompts_per_residue`` is a multiple of ``M^2`` (64 for M = 8). The target record is the one whose share of
the haystack matches its depth, so records and filler are spread evenly in front of and behind it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from ckv.config import ConfigError
from ckv.data.lookup import RecordCodec, assemble_lookup
from ckv.eval.codec import TokenCodec
from ckv.eval.design import base_offsets, make_design, slot_pads
from ckv.eval.lookup import LookupOutcome, LookupTask, check_task_fields, resolve_stride
from ckv.eval.scoring import LazyPrompts
from ckv.eval.stats import StatsOptions
from ckv.eval.vocab import VocabSpec
from ckv.geometry import phase


@dataclass(frozen=True)
class NeedleSpec:
    """Settings of the needle test (defaults: the paper's 128K setting).

    ``context_tokens``: every prompt's exact length. ``n_records``: records in the haystack (``None``:
    ``context_tokens // (2 * record_len)``). ``record_len``: tokens per record (key ``record_len - 1`` tokens +
    value; a layout with records of its own keeps them). ``modulus``: residue groups ``t_K mod modulus``.
    ``stride``: phase period (``None``: the model's stride; none for a model without one, whose phase gap is then
    not defined). ``prompts_per_residue``: base
    examples, each scored at every residue (a multiple of ``modulus**2`` matches mean and variance of t_K
    exactly). ``padding``: ``in_sequence`` (filler spread over the gaps between records, re-drawn per prompt)
    or ``prefix`` (all filler before the first record and after the last). ``prefill_chunk``: tokens per
    forward of the chunked prefill (bounds activation and attention memory).
    """

    name: str = "needle"
    context_tokens: int = 131072
    n_records: Optional[int] = None
    record_len: int = 4
    modulus: int = 8
    stride: Optional[int] = None
    prompts_per_residue: int = 256
    padding: str = "in_sequence"
    prefill_chunk: int = 4096
    seed: int = 0
    vocab: VocabSpec = field(default_factory=VocabSpec)

    def __post_init__(self) -> None:
        check_task_fields(
            self,
            required=(
                ("context_tokens", 8),
                ("record_len", 2),
                ("modulus", 1),
                ("prompts_per_residue", 1),
                ("prefill_chunk", 1),
                ("seed", 0),
            ),
            optional=(("n_records", 2), ("stride", 1)),
        )

    @property
    def records(self) -> int:
        """The record count: ``n_records`` or half the context's worth of records."""
        return self.n_records if self.n_records is not None else self.context_tokens // (2 * self.record_len)


@dataclass(frozen=True)
class MultiTokenKeyCodec:
    """Records of ``record_len`` tokens over a ``TokenCodec``'s single-token keys and values (a
    ``ckv.data.lookup.RecordCodec``): key ``j`` is the ``record_len - 1`` key tokens of ``j``'s base-``n`` digits
    (``n`` = the base's key count), the value one value token. Distinct keys are distinct token sequences."""

    base: TokenCodec
    record_len: int

    @property
    def key_len(self) -> int:
        return self.record_len - 1

    @property
    def prefix(self) -> list[int]:
        return self.base.prefix

    @property
    def pad_id(self) -> int:
        return self.base.pad_id

    @property
    def filler_ids(self) -> tuple[int, ...]:
        return tuple(self.base.filler_ids)

    @property
    def separator(self) -> list[int]:
        return self.base.separator

    @property
    def n_keys(self) -> int:
        return self.base.n_keys**self.key_len

    @property
    def n_values(self) -> int:
        return self.base.n_values

    def record_tokens(self, key: int, value: int) -> list[int]:
        return self.query_tokens(key) + self.answer_tokens(value)

    def query_tokens(self, key: int) -> list[int]:
        digits = []
        for _ in range(self.key_len):
            key, d = divmod(key, self.base.n_keys)
            digits.append(self.base.key_ids[d])
        return digits[::-1]

    def answer_tokens(self, value: int) -> list[int]:
        return self.base.answer_tokens(value)

    def describe(self) -> dict:
        return {
            **self.base.describe(),
            "source": "multi_token_keys",
            "record_len": self.record_len,
            "key_tokens": self.key_len,
            "n_keys": self.n_keys,
        }


def needle_codec(codec: RecordCodec, record_len: int) -> RecordCodec:
    """The codec of the haystack: ``codec`` itself when its records have ``record_len`` tokens, else (for word or
    id vocabularies) keys of ``record_len - 1`` tokens over its keys."""
    if codec.record_len == record_len:
        return codec
    if isinstance(codec, TokenCodec):
        return MultiTokenKeyCodec(codec, record_len)
    raise ConfigError(
        f"task.record_len={record_len}, but the model's lookup layout has records of "
        f"{codec.record_len} tokens; set task.record_len={codec.record_len} (or use vocab source "
        f"'words'/'ids')"
    )


def depth_levels(n_base: int, modulus: int, n_depths: int) -> np.ndarray:
    """(n_base,) depth level in ``0..n_depths-1`` of each base example, a function of its block of ``M^2`` and
    of the schedule's ``u`` only (the condition of the design's proof), evenly from the shallowest to the deepest.
    Levels interleave ``u`` and the block, so the first base examples (``limit``) already span the haystack."""
    m = modulus
    n_blocks = math.ceil(n_base / (m * m))
    i = np.arange(n_base)
    rank = ((i % (m * m)) // m) * n_blocks + i // (m * m)  # u-major: 0..m*n_blocks-1
    n_ranks = m * n_blocks
    return (rank * (n_depths - 1)) // (n_ranks - 1) if n_ranks > 1 else np.zeros(n_base, dtype=np.int64)


class NeedleTask(LookupTask):
    """The built needle prompts (``LazyPrompts``: assembled when scored) and their ``table`` (the lookup
    task's columns, so ``evaluate``, ``position_moments`` and ``report`` are the lookup task's; its constructor
    and prompt builder are not used)."""

    def __init__(
        self,
        spec: NeedleSpec,
        codec: RecordCodec,
        *,
        max_len: int,
        model_stride: Optional[int] = None,
        limit: Optional[int] = None,
    ) -> None:
        self.spec, self.codec = spec, needle_codec(codec, spec.record_len)  # type: ignore[assignment]
        self.n_records, self.n_demos = spec.records, 0
        self.modulus = spec.modulus
        self.stride = resolve_stride(spec.stride, model_stride, spec.modulus)
        self.n_base = min(spec.prompts_per_residue, limit) if limit else spec.prompts_per_residue
        self._check_context(max_len)
        self.design = make_design(spec.modulus, 1, 1, 0)  # n_coarse = 1: base offsets (M - 1) + v - u
        self.prompts, self.table = self._build_haystacks()

    def _check_context(self, max_len: int) -> None:
        s, c, n = self.spec, self.codec, self.n_records
        if s.context_tokens > max_len:
            raise ConfigError(
                f"task.context_tokens={s.context_tokens} exceeds the model's context of {max_len} "
                f"tokens; lower task.context_tokens"
            )
        if n > c.n_keys:
            raise ConfigError(
                f"the haystack's {n} records need distinct keys but the vocabulary makes only "
                f"{c.n_keys}; lower task.n_records or give more keys"
            )
        question = len(c.separator) + len(c.query_tokens(0))
        self.haystack = s.context_tokens - len(c.prefix) - question  # record and filler tokens
        self.filler = self.haystack - n * c.record_len
        if self.filler < 2 * s.modulus:
            raise ConfigError(
                f"{n} records of {c.record_len} tokens leave {self.filler} filler tokens in a context of "
                f"{s.context_tokens}; the design needs >= {2 * s.modulus}: lower task.n_records"
            )
        if self.filler and not len(c.filler_ids) and s.padding == "in_sequence":
            raise ConfigError(
                "this layout has no filler ids to put between records (lookup n_filler=0); use task.padding=prefix"
            )

    def _build_haystacks(self) -> tuple[LazyPrompts, dict[str, np.ndarray]]:
        s, c, m, n, L = self.spec, self.codec, self.modulus, self.n_records, self.codec.record_len
        reach = self.haystack - L - (3 * m - 2)  # the deepest coarse start that still fits every shift
        n_depths = max(1, reach // m + 1)  # a too-small haystack fails the feasibility check below
        offsets = base_offsets(self.n_base, self.design) + m * depth_levels(self.n_base, m, n_depths)  # (n_base,)
        last = offsets + m - 1  # the largest target offset of each base example
        spacing = self.haystack / n  # record plus its share of filler
        lo = np.maximum(0, -((self.filler - last) // L))  # ceil((last - filler) / L): filler after >= 0
        hi = np.minimum(n - 1, offsets // L)  # filler before >= 0
        if np.any(lo > hi):
            raise ConfigError("the needle design has no feasible target record for some depths; lower task.n_records")
        targets = np.clip(np.round(offsets / spacing).astype(np.int64), lo, hi)
        shifts = np.arange(m)
        base, shift = np.repeat(np.arange(self.n_base), m), np.tile(shifts, self.n_base)  # (P,) each
        position = len(c.prefix) + offsets[base] + shift
        self._keys: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._offsets, self._targets = offsets, targets
        target_kv = np.array([[kv[targets[i]] for kv in self._mapping(i)] for i in range(self.n_base)])  # (n_base, 2)
        table = dict(
            base=base,
            shift=shift,
            target_record=targets[base],
            target_position=position,
            residue=position % m,
            phase=np.asarray(
                phase(position, self.stride) if self.stride else np.full_like(position, -1), dtype=np.int64
            ),
            query_position=np.full(len(base), s.context_tokens - 1),
            key=target_kv[base, 0],
            value=target_kv[base, 1],
        )
        table["answer_id"] = np.array([c.answer_tokens(int(v))[0] for v in table["value"]], dtype=np.int64)
        prompts = LazyPrompts(np.full(len(base), s.context_tokens), self._prompt)
        return prompts, {k: np.asarray(v, dtype=np.int64) for k, v in table.items()}

    def _mapping(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Base example ``i``'s distinct keys and its values (N,) each (the last one is kept for its shifts)."""
        if i not in self._keys:
            rng = np.random.default_rng([self.spec.seed, 1, i])
            keys = rng.choice(self.codec.n_keys, self.n_records, replace=False)
            values = rng.integers(0, self.codec.n_values, self.n_records)
            self._keys = {i: (keys, values)}
        return self._keys[i]

    def _prompt(self, j: int) -> np.ndarray:
        """Prompt ``j`` (base ``j // M`` at shift ``j % M``), assembled by ``ckv.data.lookup.assemble_lookup``."""
        i, k = divmod(j, self.modulus)
        keys, values = self._mapping(i)
        t = int(self._targets[i])
        pre = int(self._offsets[i]) + k - t * self.codec.record_len  # filler before the target
        rng = np.random.default_rng([self.spec.seed, 2, i, k])
        pads = slot_pads(t, pre, self.filler - pre, self.n_records, self.spec.padding, rng)
        ex = assemble_lookup(self.codec, keys, values, pads, [t], rng)
        if int(ex.record_starts[t]) != self.table["target_position"][j]:
            raise RuntimeError(
                f"needle prompt {j}: target at {ex.record_starts[t]}, planned at {self.table['target_position'][j]}"
            )
        return ex.prompt

    def describe(self) -> dict:
        """The resolved settings and the design, for results.json."""
        return {
            "spec": {
                **asdict(self.spec),
                "n_records": self.n_records,
                "stride": self.stride,
                "prompts_per_residue": self.n_base,
            },
            "codec": self.codec.describe(),
            "design": {
                "modulus": self.modulus,
                "context_tokens": self.spec.context_tokens,
                "record_len": self.codec.record_len,
                "haystack_tokens": self.haystack,
                "filler_tokens": self.filler,
                "query_position": self.spec.context_tokens - 1,
                "prompt_length": [self.spec.context_tokens] * 2,
                "target_position_by_residue": self.position_moments(),
            },
        }

    def report(self, outcome: LookupOutcome, options: StatsOptions = StatsOptions()) -> dict:
        """The lookup task's report (same keys, same statistics) marked as the needle task."""
        return {**super().report(outcome, options), "task": "needle"}
