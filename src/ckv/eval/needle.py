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

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from ckv.config import ConfigError, ModelConfig, check_float
from ckv.data.lookup import RecordCodec, assemble_lookup
from ckv.device import resolve_device
from ckv.eval.chunking import ChunkCheck, chunk_check
from ckv.eval.codec import needle_codec
from ckv.eval.design import base_offsets, make_design, slot_pads
from ckv.eval.hf_models import HFLastLogits, hf_memory
from ckv.eval.lookup import LookupKind, LookupOutcome, LookupTask, check_task_fields, codec_for, resolve_stride
from ckv.eval.memory import (
    GB,
    MIN_CHUNK,
    ChunkEstimate,
    ModelMemory,
    chunk_candidates,
    ckv_model_memory,
    device_budget,
    estimate,
    gb,
    needed,
    pick_chunk,
)
from ckv.eval.models import LoadedModel, ModelFacts
from ckv.eval.registry import RunOptions, TaskResult, register_task
from ckv.eval.scoring import CkvChunkedLastLogits, LazyPrompts, LogitsFn
from ckv.eval.stats import StatsOptions
from ckv.eval.vocab import AUTO, VocabSpec
from ckv.geometry import phase
from ckv.model import Transformer

log = logging.getLogger(__name__)
DEFAULT_CHUNK = 4096  # prefill_chunk=auto where the device's free memory cannot be read


@dataclass(frozen=True)
class NeedleSpec:
    """Settings of the needle test (defaults: the paper's 128K setting).

    ``context_tokens``: every prompt's exact length. ``n_records``: records in the haystack (``None``:
    ``context_tokens // (2 * record_len)``). ``record_len``: tokens per record (key ``record_len - 1`` tokens +
    value; a layout with records of its own keeps them). ``modulus``: residue groups ``t_K mod modulus``.
    ``stride``: phase period (``None``: the model's stride; none for a model without one, whose phase gap is then
    not defined). ``prompts_per_residue``: base examples, each scored at every residue (a multiple of
    ``modulus**2`` matches mean and variance of t_K exactly). ``padding``: ``in_sequence`` (filler spread over the
    gaps between records, re-drawn per prompt) or ``prefix`` (all filler before the first record and after the
    last). ``prefill_chunk``: tokens per forward of the chunked prefill (bounds activation and attention memory);
    ``"auto"``: the largest chunk whose estimated peak memory (``ckv.eval.memory``) fits ``memory_budget_gb``
    (``None``: 90% of the device's free memory). ``chunk_check``: for a transformers model scored in chunks,
    this many prompts are also run as one full forward and compared with their scored logits
    (``ckv.eval.chunking``; 0: off).
    """

    name: str = "needle"
    context_tokens: int = 131072
    n_records: Optional[int] = None
    record_len: int = 4
    modulus: int = 8
    stride: Optional[int] = None
    prompts_per_residue: int = 256
    padding: str = "in_sequence"
    prefill_chunk: Union[int, str] = AUTO
    memory_budget_gb: Optional[float] = None
    chunk_check: int = 4
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
                ("chunk_check", 0),
                ("seed", 0),
            ),
            optional=(("n_records", 2), ("stride", 1)),
        )
        chunk = self.prefill_chunk
        if chunk != AUTO and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ConfigError(f"task.prefill_chunk={chunk!r} must be an integer >= 1 or 'auto'")
        if self.memory_budget_gb is not None:
            check_float("task.memory_budget_gb", self.memory_budget_gb, 0, low_open=True)
        if self.records < 2 or self.records * self.record_len >= self.context_tokens:
            raise ConfigError(
                f"task.n_records={self.records} records of task.record_len={self.record_len} tokens do not fit a "
                f"haystack of task.context_tokens={self.context_tokens} (at least 2 records, and room for filler)"
            )

    @property
    def records(self) -> int:
        """The record count: ``n_records`` or half the context's worth of records."""
        return self.n_records if self.n_records is not None else self.context_tokens // (2 * self.record_len)


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
        self.memory: Optional[dict] = None  # the prefill chunk and its memory estimate, once scored
        self.full_forward_skip: Optional[str] = None  # why the chunk check cannot run a full forward, once scored

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


def needle_memory(model: ModelFacts, device: torch.device, module: Optional[Any] = None) -> ModelMemory:
    """The memory description of ``model`` for the chunk estimate: ckv models from their config
    (``ckv_model_memory``), transformers models from theirs (``hf_memory``; ``module`` when loaded)."""
    if model.kind == "ckv" and isinstance(model.config, ModelConfig):
        return ckv_model_memory(model.config, device)
    if model.kind == "hf":
        return hf_memory(model, module)
    raise ConfigError(f"the needle test estimates memory for ckv and transformers models, not {model.name}")


def _no_fit(memory: ModelMemory, spec: NeedleSpec, batch: int, budget: float, loaded: bool) -> str:
    """The one line that says no chunk fits, and what would."""
    smallest = estimate(memory, batch, spec.context_tokens, MIN_CHUNK)
    what = f"a device with {gb(needed(smallest, loaded))} GB free"
    if batch > 1:
        one, _ = pick_chunk(memory, 1, spec.context_tokens, budget, weights_loaded=loaded)
        if one is not None:
            what = f"batch_size=1 (fits with chunk {one.chunk})"
    return (
        f"task.prefill_chunk=auto: no prefill chunk fits: chunk {MIN_CHUNK} at batch_size={batch} needs "
        f"~{gb(needed(smallest, loaded))} GB, the device offers {gb(budget)} GB "
        f"(task.memory_budget_gb, default 90% of its free memory); use {what}, or lower task.context_tokens"
    )


def choose_chunk(
    spec: NeedleSpec, model: ModelFacts, batch: int, device: torch.device, module: Optional[Any] = None
) -> tuple[ChunkEstimate, Optional[float]]:
    """The prefill chunk to score with and its estimate, and the memory budget (bytes; ``None``: unknown):
    ``spec.prefill_chunk``, or for ``auto`` the largest chunk that fits (a ``ConfigError`` when none does). With
    ``module`` (the loaded model) the budget is what is left after its weights."""
    memory = needle_memory(model, device, module)
    loaded = module is not None
    budget = spec.memory_budget_gb * GB if spec.memory_budget_gb is not None else device_budget(device)
    T = spec.context_tokens
    if spec.prefill_chunk != AUTO:
        est = estimate(memory, batch, T, int(spec.prefill_chunk))
        if budget is not None and needed(est, loaded) > budget:
            log.warning(
                "task.prefill_chunk=%d needs ~%s GB but the device offers %s GB; task.prefill_chunk=auto picks "
                "a chunk that fits",
                est.chunk,
                gb(needed(est, loaded)),
                gb(budget),
            )
        return est, budget
    if budget is None:
        est = estimate(memory, batch, T, DEFAULT_CHUNK)
        log.warning("cannot read the device's free memory: prefill chunk %d (set task.memory_budget_gb)", est.chunk)
        return est, None
    fit, _ = pick_chunk(memory, batch, T, budget, weights_loaded=loaded)
    if fit is None:
        raise ConfigError(_no_fit(memory, spec, batch, budget, loaded))
    return fit, budget


def full_forward_skip(
    spec: NeedleSpec, memory: ModelMemory, budget: Optional[float], weights_loaded: bool
) -> Optional[str]:
    """Why the chunk check cannot run one full forward of a prompt (its estimated peak exceeds ``budget``), or
    ``None`` (it fits, or the budget is unknown)."""
    T = spec.context_tokens
    full = needed(estimate(memory, 1, T, T), weights_loaded)
    if budget is None or full <= budget:
        return None
    return f"one full forward of {T} tokens needs ~{gb(full)} GB, the device offers {gb(budget)} GB"


def dry_run_device(device: str) -> torch.device:
    """The device a dry run estimates for: ``device`` resolved, or as named when this machine lacks it (a plan for
    another machine: its free memory is then unknown unless ``task.memory_budget_gb`` says it)."""
    try:
        return resolve_device(device, "device")
    except ConfigError:
        return torch.device(device)


@register_task
class NeedleKind(LookupKind):
    """``task.kind=needle``: the position-matched needle test (``NeedleTask``), scored by chunked prefill with a
    chunk that fits the device; the lookup task's report, rows, plot and summary, plus the memory estimate."""

    kind = "needle"
    spec = NeedleSpec

    def build(self, spec: NeedleSpec, model: ModelFacts, limit: Optional[int] = None) -> NeedleTask:
        return NeedleTask(
            spec, codec_for(spec.vocab, model), max_len=model.max_len, model_stride=model.stride, limit=limit
        )

    def logits(self, spec: NeedleSpec, model: LoadedModel, built: NeedleTask, options: RunOptions) -> LogitsFn:
        """Chunked prefill through the model's own KV cache: ``CkvChunkedLastLogits`` or ``HFLastLogits``."""
        if not (isinstance(model.module, Transformer) or isinstance(model.logits, HFLastLogits)):
            raise ConfigError(
                f"the needle test needs a ckv or transformers model for chunked prefill, not {model.name}"
            )
        batch = min(options.batch_size, len(built.prompts))
        est, budget = choose_chunk(spec, model, batch, model.device, model.module)
        built.memory = {**est.to_dict(), "budget": budget, "chosen": "auto" if spec.prefill_chunk == AUTO else "given"}
        log.info(
            "needle: prefill chunk %d tokens (%s); estimated %s of %s",
            est.chunk,
            "picked: the largest that fits" if spec.prefill_chunk == AUTO else "task.prefill_chunk",
            est.line(),
            "an unknown budget" if budget is None else f"{gb(budget)} GB available",
        )
        if isinstance(model.module, Transformer):
            return CkvChunkedLastLogits(model.module, est.chunk)
        built.full_forward_skip = full_forward_skip(
            spec, needle_memory(model, model.device, model.module), budget, True
        )
        return HFLastLogits(model.module, est.chunk)

    def chunking(self, built: NeedleTask, logits: LogitsFn) -> Optional[ChunkCheck]:
        """The chunk check of a transformers model's chunked prefill on ``task.chunk_check`` prompts."""
        return chunk_check(logits, built.prompts.lengths, built.spec.chunk_check, skip=built.full_forward_skip)

    def run(self, built: NeedleTask, logits: LogitsFn, options: RunOptions, device: Any) -> TaskResult:
        result = super().run(built, logits, options, device)
        result.report["memory"] = built.memory
        return result

    def dry_run(self, spec: NeedleSpec, built: NeedleTask, model: ModelFacts, options: RunOptions) -> list[str]:
        """The memory estimate of the last prefill chunk for several chunk sizes, and the chunk the run would use."""
        device = dry_run_device(options.device)
        batch = min(options.batch_size, len(built.prompts))
        memory = needle_memory(model, device)
        lines = [
            f"{spec.name}: {len(built.prompts)} prompts of {spec.context_tokens} tokens, batch_size={batch}, "
            f"model {model.name} ({memory.name}), weights {gb(memory.weights)} GB",
            *(f"  {note}" for note in memory.notes),
            "estimated peak memory of the last prefill chunk (weights included):",
        ]
        lines += [
            f"  {estimate(memory, batch, spec.context_tokens, c).line()}" for c in chunk_candidates(spec.context_tokens)
        ]
        if spec.memory_budget_gb is None and device_budget(device) is None:
            return [
                *lines,
                f"the free memory of {device} cannot be read here: the run reads it on its machine (or "
                "set task.memory_budget_gb to see the chunk it would use)",
            ]
        try:
            est, budget = choose_chunk(spec, model, batch, device)
        except ConfigError as e:
            return [*lines, str(e)]
        lines.append(
            f"budget on {device}: {gb(budget)} GB; the run would use prefill chunk {est.chunk}: peak ~{gb(est.peak)} GB"
        )
        if model.kind == "hf" and spec.chunk_check and est.chunk < spec.context_tokens:
            skip = full_forward_skip(spec, memory, budget, False)
            lines.append(
                f"chunk check: {min(spec.chunk_check, len(built.prompts))} prompts also run as one full forward "
                + (f"(not run: {skip})" if skip else f"of {spec.context_tokens} tokens (fits)")
                + "; task.chunk_check=0 turns it off"
            )
        return lines
