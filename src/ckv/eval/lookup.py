"""The position-matched lookup task (the paper's design, tokenizer-agnostic).

N records (key immediately followed by value), D demonstrations (queries of other records with their answers),
then the target query; score: full-vocabulary top-1 of the target's (first) answer token. Every base example
is evaluated at shifts ``k = 0..M-1`` (see ``ckv.eval.design``), so each target is scored in every residue group
``target position mod M``; the query position is fixed and the target-position moments are equal across groups.
Phase = target position mod S (S = ``task.stride``, else the model's stride; a full-attention model has a phase
only when the task names the stride of the comparison). The target position is that of the target record's
first token. Two gaps (best minus worst group accuracy), each with a cluster-bootstrap interval over mappings,
permutation p and noise floor: the **residue gap** over the groups mod M (the paper's headline; the same M for
every model of a comparison) and the **phase gap** over the groups mod S.

``LookupTask`` holds the built prompts; ``evaluate`` scores them with any logits callable (so an analysis can
re-run the same prompts on a modified model) and ``report`` computes every statistic.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ckv.config import ConfigError, check_bool, check_choice, check_int
from ckv.data.config import LookupConfig
from ckv.data.lookup import RecordCodec, assemble_lookup
from ckv.eval.chunking import ChunkCheck, chunk_check, chunking_lines
from ckv.eval.design import PADDINGS, base_offsets, choose_targets, make_design, slot_pads
from ckv.eval.grouping import gap_headline, gap_lines, percent, percent_interval, summarize_groups
from ckv.eval.mitigation import ensemble_shifts
from ckv.eval.models import ModelFacts
from ckv.eval.plots import plot_lookup
from ckv.eval.registry import EvalTask, RunOptions, TaskResult, check_name, register_task
from ckv.eval.scoring import LazyPrompts, LogitsFn, Scores, prompt_lengths, score_next_token
from ckv.eval.stats import StatsOptions
from ckv.eval.vocab import VocabSpec, build_codec, vocab_spec
from ckv.geometry import phase

log = logging.getLogger(__name__)
PAPER_N_RECORDS, PAPER_N_DEMOS = 64, 8  # the paper's lookup, for models that did not train on lookups


@dataclass(frozen=True)
class LookupSpec:
    """Settings of the position-matched lookup.

    ``n_records``/``n_demos``: ``None`` takes the model's training settings (records; queries minus one) when
    it trained on synthetic lookups, else the paper's 64 records and 8 demonstrations. ``n_base``: base examples
    (key->value mappings), each evaluated at all ``modulus`` shifts; a multiple of ``modulus**2`` matches mean
    and variance of the target position across residue groups exactly (a multiple of ``modulus`` the means).
    ``stride``: phase period; ``None`` takes the model's stride (a model without one, full attention, then gets
    no phase groups: set the comparison's stride). ``padding``: ``prefix`` or ``in_sequence``.
    ``fixed_query``: keep the query position fixed (the pads a shift adds before the target are taken from
    after it); ``False`` only adds pads, so the query moves with the target. ``distinct_values``: values
    drawn without replacement (else with replacement, as ckv's training data).
    """

    name: str = "lookup"
    n_records: Optional[int] = None
    n_demos: Optional[int] = None
    n_base: int = 576
    modulus: int = 24
    stride: Optional[int] = None
    padding: str = "prefix"
    fixed_query: bool = True
    distinct_values: bool = False
    seed: int = 0
    vocab: VocabSpec = field(default_factory=VocabSpec)

    def __post_init__(self) -> None:
        check_task_fields(
            self,
            required=(("n_base", 1), ("modulus", 1), ("seed", 0)),
            optional=(("n_records", 2), ("n_demos", 0), ("stride", 1)),
            flags=("fixed_query", "distinct_values"),
        )


def check_task_fields(
    spec: Any,
    required: tuple[tuple[str, int], ...],
    optional: tuple[tuple[str, int], ...] = (),
    flags: tuple[str, ...] = (),
) -> None:
    """The checks every lookup-style task spec shares: ``name``; ``vocab`` given as a dict becomes a ``VocabSpec``;
    ``padding`` is one of PADDINGS; the ``required`` fields are integers >= their minimum, the ``optional`` ones
    null or such integers, the ``flags`` booleans (errors read ``task.<field>=...``); a given ``stride`` divides
    ``modulus``."""
    check_name(spec)
    object.__setattr__(spec, "vocab", vocab_spec(spec.vocab))
    check_choice("task.padding", spec.padding, PADDINGS)
    for name, low in required:
        check_int(f"task.{name}", getattr(spec, name), low)
    for name, low in optional:
        if getattr(spec, name) is not None:
            check_int(f"task.{name}", getattr(spec, name), low)
    for name in flags:
        check_bool(f"task.{name}", getattr(spec, name))
    resolve_stride(spec.stride, None, spec.modulus)


def resolve_stride(requested: Optional[int], model_stride: Optional[int], modulus: int) -> Optional[int]:
    """The phase period: the task's, else the model's; ``None`` for a model without a stride (full attention)
    when the task names none (its phase gap is then not defined: give ``task.stride``, the stride of the
    comparison). It must divide ``modulus``."""
    stride = requested or model_stride
    if stride is None:
        return None
    which = f"the stride {stride}" + (" (task.stride)" if requested else "")
    if modulus < stride:
        raise ConfigError(
            f"task.modulus={modulus} is smaller than {which}: residues mod {modulus} cannot "
            f"separate the {stride} phases; use a multiple of {stride} (the paper uses 24)"
        )
    if modulus % stride:
        raise ConfigError(
            f"task.modulus={modulus} is not a multiple of {which}: phase groups would "
            f"not be balanced; use a common multiple (the paper uses 24)"
        )
    return stride


@dataclass
class LookupOutcome:
    """Per-prompt results of one evaluation: the task's ``table`` columns plus ``predicted`` (top-1 id),
    ``correct`` (0/1) and ``p_answer`` (probability of the answer token); all arrays (P,). ``logits``: the scored
    last-position logits (V,) of the prompts the evaluation was asked to keep. ``also``: the shift ensemble's runs
    combined by other rules (``LookupTask.evaluate``), one outcome each; its rows carry their ``correct_<rule>``
    and ``p_answer_<rule>`` columns."""

    table: dict[str, np.ndarray]
    predicted: np.ndarray
    correct: np.ndarray
    p_answer: np.ndarray
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    also: dict[str, LookupOutcome] = field(default_factory=dict)

    def rows(self) -> list[dict]:
        cols = {**self.table, "predicted_id": self.predicted, "correct": self.correct, "p_answer": self.p_answer}
        for rule, other in self.also.items():
            cols.update({f"correct_{rule}": other.correct, f"p_answer_{rule}": other.p_answer})
        return [{k: v[i].item() for k, v in cols.items()} for i in range(len(self.correct))]


class LookupTask:
    """The built prompts of one lookup task. ``table`` columns (P,): base (the key->value mapping), shift,
    target_record, target_position, residue, phase (-1 without a stride), query_position, key, value, answer_id."""

    def __init__(
        self,
        spec: LookupSpec,
        codec: RecordCodec,
        *,
        max_len: int,
        model_stride: Optional[int] = None,
        training: Optional[LookupConfig] = None,
        limit: Optional[int] = None,
    ) -> None:
        self.spec, self.codec = spec, codec
        self.n_records = spec.n_records or (training.n_records if training else PAPER_N_RECORDS)
        default_demos = training.n_queries - 1 if training else PAPER_N_DEMOS
        self.n_demos = spec.n_demos if spec.n_demos is not None else default_demos
        self.modulus = spec.modulus
        self.stride = resolve_stride(spec.stride, model_stride, spec.modulus)
        self.n_base = min(spec.n_base, limit) if limit else spec.n_base
        self.design = make_design(spec.modulus, self.n_records, codec.record_len, len(codec.prefix))
        self._check(training)
        self._check_length(max_len)
        self.prompts, self.table, pads = self._build()
        outside = training.pads_outside(pads) if training else None
        if outside:  # the layouts the evaluation needs and the training stream never drew
            log.warning("%s", outside)

    # ---- validation ----------------------------------------------------------------------------------------
    def _check(self, training: Optional[LookupConfig]) -> None:
        c, n = self.codec, self.n_records
        if n > c.n_keys:
            raise ConfigError(f"task.n_records={n} exceeds the {c.n_keys} available keys (records use distinct keys)")
        if self.spec.distinct_values and n > c.n_values:
            raise ConfigError(f"task.n_records={n} exceeds the {c.n_values} values with task.distinct_values=true")
        if self.n_demos > n - 1:
            raise ConfigError(f"task.n_demos={self.n_demos} needs more than {n} records (demos ask other records)")
        if not len(c.filler_ids) and (self.spec.padding == "in_sequence" or self.spec.fixed_query):
            raise ConfigError(
                "this layout has no filler ids to put between or after records (lookup n_filler=0); "
                "use task.padding=prefix with task.fixed_query=false"
            )
        if self.spec.n_base % self.modulus:
            log.warning(
                "task.n_base=%d is not a multiple of modulus=%d: target-position means differ slightly "
                "between residue groups",
                self.spec.n_base,
                self.modulus,
            )
        if training is None:
            return
        if self.n_demos + 1 > training.n_queries:
            log.warning("this task asks %d queries; the model trained with %d", self.n_demos + 1, training.n_queries)

    def _check_length(self, max_len: int) -> None:
        c = self.codec
        query, answer = len(c.query_tokens(0)), len(c.answer_tokens(0))
        longest = (
            len(c.prefix)
            + self.n_records * c.record_len
            + self.design.pad_budget
            + len(c.separator)
            + self.n_demos * (query + answer)
            + query
        )
        if longest > max_len:
            raise ConfigError(
                f"lookup prompts need {longest} tokens ({self.n_records} records x {self.codec.record_len} tokens, "
                f"{self.design.pad_budget} pad tokens, {self.n_demos} demonstrations) but the model's context is "
                f"{max_len}: lower task.n_records or task.n_demos (or task.modulus)"
            )

    # ---- prompt construction ------------------------------------------------------------------------------
    def _build(self) -> tuple[list[np.ndarray], dict[str, np.ndarray], np.ndarray]:
        """The prompts, their table and (P, n_records + 1) their pad tokens per slot."""
        s, c, d, m = self.spec, self.codec, self.design, self.modulus
        offsets = base_offsets(self.n_base, d)
        targets, base_pads = choose_targets(offsets, d, np.random.default_rng([s.seed, 0]))
        prompts: list[np.ndarray] = []
        rows: list[dict[str, int]] = []
        layouts: list[np.ndarray] = []
        n = self.n_records
        for i in range(self.n_base):
            rng = np.random.default_rng([s.seed, 1, i])  # per base example: a limit keeps the same prefix
            keys = rng.choice(c.n_keys, n, replace=False)
            values = rng.choice(c.n_values, n, replace=False) if s.distinct_values else rng.integers(0, c.n_values, n)
            t = int(targets[i])
            others = np.delete(np.arange(n), t)
            queried = np.append(rng.choice(others, self.n_demos, replace=False), t)
            for k in range(m):
                pre = int(base_pads[i]) + k
                post = d.pad_budget - pre if s.fixed_query else 0
                layouts.append(slot_pads(t, pre, post, n, s.padding, rng))
                ex = assemble_lookup(c, keys, values, layouts[-1], queried, rng)
                position = int(ex.record_starts[t])
                prompts.append(ex.prompt)
                rows.append(
                    dict(
                        base=i,
                        shift=k,
                        target_record=t,
                        target_position=position,
                        residue=position % m,
                        phase=int(phase(position, self.stride)) if self.stride else -1,
                        query_position=len(ex.prompt) - 1,
                        key=int(keys[t]),
                        value=int(values[t]),
                        answer_id=ex.answer_id,
                    )
                )
        table = {col: np.array([r[col] for r in rows], dtype=np.int64) for col in rows[0]}
        return prompts, table, np.stack(layouts)

    # ---- the shift ensemble's prompts (ckv.eval.mitigation) -------------------------------------------------
    def shifted_prompt(self, i: int, s: int) -> np.ndarray:
        """Prompt ``i`` with its target moved by ``s`` positions modulo the stride and its length kept: ``s`` gap
        tokens (pads and fillers) after the target move to the front, right after the prefix (every record before
        the target moves with it, as prefix padding moves them); where fewer than ``s`` lie after it, ``S - s`` gap
        tokens before the target (the earliest first) move to the end of the record block. The query stays put and
        the prompt keeps its group (the target's phase in the unshifted prompt)."""
        S, c = self.require_stride("the shift ensemble"), self.codec
        p, t = np.asarray(self.prompts[i]), int(self.table["target_position"][i])
        start, end = len(c.prefix), len(p) - self.query_span  # the record block: [start, end)
        gap = np.isin(p, [c.pad_id, *c.filler_ids])
        after = np.flatnonzero(gap[t + c.record_len : end]) + t + c.record_len
        before = np.flatnonzero(gap[start:t]) + start
        if len(after) >= s:
            kept = np.delete(p, after[len(after) - s :])
            return np.concatenate([kept[:start], np.full(s, c.pad_id, dtype=p.dtype), kept[start:]])
        if len(before) >= S - s:
            kept = np.delete(p, before[: S - s])
            tail = np.full(S - s, c.filler_ids[0], dtype=p.dtype)
            return np.concatenate([kept[: end - (S - s)], tail, kept[end - (S - s) :]])
        raise RuntimeError(
            f"prompt {i} has {len(after)} gap tokens after its target and {len(before)} before it: it cannot be "
            f"shifted by {s} (mod {S}) keeping its length"
        )

    @property
    def query_span(self) -> int:
        """Tokens after the record block: the separator, the demonstrations (query, answer) and the query."""
        c = self.codec
        return (
            len(c.separator)
            + self.n_demos * (len(c.query_tokens(0)) + len(c.answer_tokens(0)))
            + len(c.query_tokens(0))
        )

    def shifted(self, s: int) -> LazyPrompts:
        """Every prompt moved by ``s`` (``shifted_prompt``), built when scored."""
        return LazyPrompts(prompt_lengths(self.prompts), lambda i: self.shifted_prompt(i, s))

    # ---- evaluation ---------------------------------------------------------------------------------------
    def evaluate(
        self,
        model: LogitsFn,
        *,
        batch_size: int = 64,
        device: torch.device | str = "cpu",
        progress: bool = True,
        keep: Sequence[int] = (),
        shifts: Sequence[int] = (),
        combine: str = "mean_logprob",
        also: Sequence[str] = (),
    ) -> LookupOutcome:
        """Score every prompt with ``model`` (``input_ids -> logits``), keeping the logits of the prompts in
        ``keep`` (indices). ``shifts``: the shift ensemble (``ckv.eval.mitigation``): each prompt also runs moved
        by each of these (``shifted``), the runs combined by ``combine`` (``scoring.combine_runs``) and the
        combined distribution scored as one prompt's; ``also``: other rules scored from the same runs
        (``LookupOutcome.also``)."""
        scores = score_next_token(
            model,
            self.prompts,
            self.table["answer_id"][:, None],
            batch_size=batch_size,
            device=device,
            progress=progress,
            desc=self.spec.name,
            keep=keep,
            variants=[self.shifted(s) for s in shifts if s],
            combine=combine,
            also=also,
        )

        def outcome(s: Scores) -> LookupOutcome:
            correct = (s.top1 == self.table["answer_id"]).astype(np.int64)
            return LookupOutcome(self.table, s.top1, correct, s.probs[:, 0], s.logits)

        result = outcome(scores)
        result.also = {rule: outcome(other) for rule, other in scores.also.items()}
        return result

    def position_moments(self) -> list[dict]:
        """Mean and variance of the target position in each residue group (the design's balance check)."""
        out = []
        for r in range(self.modulus):
            pos = self.table["target_position"][self.table["residue"] == r].astype(np.float64)
            out.append(
                {
                    "residue": r,
                    "n": len(pos),
                    "mean": float(pos.mean()) if len(pos) else None,
                    "var": float(pos.var()) if len(pos) else None,
                }
            )
        return out

    def describe(self) -> dict:
        """The resolved settings and the design, for results.json."""
        q = np.unique(self.table["query_position"])
        return {
            "spec": {
                **asdict(self.spec),
                "n_records": self.n_records,
                "n_demos": self.n_demos,
                "stride": self.stride,
                "n_base": self.n_base,
            },
            "codec": self.codec.describe(),
            "design": {
                **asdict(self.design),
                "pad_budget": self.design.pad_budget,
                "query_position": int(q[0]) if len(q) == 1 else None,
                "prompt_length": [int(min(map(len, self.prompts))), int(max(map(len, self.prompts)))],
                "target_position_by_residue": self.position_moments(),
            },
        }

    def require_stride(self, what: str) -> int:
        """The phase period, or a ``ConfigError`` naming ``what`` needs it (a model without a stride)."""
        if self.stride is None:
            raise ConfigError(
                f"{what} groups targets by phase, but the model has no stride (full attention): set "
                f"task.stride to the stride of the comparison"
            )
        return self.stride

    def report(self, outcome: LookupOutcome, options: StatsOptions = StatsOptions()) -> dict:
        """Every statistic of one evaluation: residue groups mod M, phase groups mod S (``None`` without a
        stride) and a headline with both gaps. Intervals are cluster bootstraps over the key->value mappings."""
        t = outcome.table
        residue = summarize_groups(outcome.correct, t["residue"], self.modulus, t["base"], options, period=self.stride)
        phases = summarize_groups(outcome.correct, t["phase"], self.stride, t["base"], options) if self.stride else None
        per, mean = residue.get("periodicity", {}), residue["mean"]
        headline = {
            "mean": mean["value"],
            "mean_lower": mean["lower"],
            "mean_upper": mean["upper"],
            "modulus": self.modulus,
            **gap_headline(residue, "residue"),
            "stride": self.stride,
            **gap_headline(phases, "phase"),
            "periodicity_score": per.get("score"),
            "dominant_period": per.get("dominant_period"),
        }
        return {
            "task": "lookup",
            "name": self.spec.name,
            "modulus": self.modulus,
            "stride": self.stride,
            "n_prompts": len(outcome.correct),
            "headline": headline,
            "residue": residue,
            "phase": phases,
            **self.describe(),
        }


def codec_for(vocab: VocabSpec, model: ModelFacts) -> RecordCodec:
    """The record codec of ``vocab`` for ``model`` (its vocabulary size, tokenizer, run layout or held-out words)."""
    return build_codec(
        vocab,
        vocab_size=model.vocab_size,
        tokenizer=model.tokenizer,
        run_format=model.lookup_format,
        run_words=model.eval_words,
    )


def lookup_summary(report: dict) -> list[str]:
    """The one-screen summary of a lookup-style report: mean, per-phase accuracy, worst phase and phase gap (with
    interval and noise floor), then the residue gap."""
    mean = report["residue"]["mean"]
    lines = [
        f"mean accuracy {percent(mean['value'])}% {percent_interval(mean['lower'], mean['upper'])} "
        f"over {report['n_prompts']} prompts"
    ]
    phases = report["phase"]
    if phases is None:
        lines.append(
            "no phase groups: the model has no stride; give task.stride (model.stride for transformers models)"
        )
    else:
        per = "  ".join(f"{g['group']}: {percent(g['accuracy'])}" for g in phases["groups"])
        lines += [f"accuracy per phase (mod {report['stride']}, %): {per}", *gap_lines(phases, "phase")]
    lines += gap_lines(report["residue"], f"residue (mod {report['modulus']})")[:1]
    for rule, other in (report.get("also") or {}).items():  # the shift ensemble's other combine rules
        lines += [f"combined by {rule} (the same runs):", *(f"  {line}" for line in lookup_summary(other))]
    return lines


@register_task
class LookupKind(EvalTask):
    """``task.kind=lookup``: the position-matched lookup (``LookupTask``); plot ``plot_lookup``."""

    kind = "lookup"
    spec = LookupSpec

    def build(self, spec: LookupSpec, model: ModelFacts, limit: Optional[int] = None) -> LookupTask:
        return LookupTask(
            spec,
            codec_for(spec.vocab, model),
            max_len=model.max_len,
            model_stride=model.stride,
            training=model.lookup,
            limit=limit,
        )

    def shift_stride(self, built: LookupTask) -> Optional[int]:
        """The lookup (and the needle) move each target by gap tokens (``LookupTask.shifted_prompt``), over the
        task's phase stride."""
        return built.stride

    def chunking(self, built: LookupTask, logits: LogitsFn) -> Optional[ChunkCheck]:
        """The chunk check of a transformers model's scoring (``None`` for other models): the lookup scores each
        prompt by one forward, so its record says so."""
        return chunk_check(logits, prompt_lengths(built.prompts), 0)

    def run(self, built: LookupTask, logits: LogitsFn, options: RunOptions, device: Any) -> TaskResult:
        shifts, combine, also = ensemble_shifts(options.mitigation, built.stride)
        check = None if shifts else self.chunking(built, logits)  # an ensemble's score is no single forward's
        keep = check.indices if check is not None else ()
        outcome = built.evaluate(
            logits,
            batch_size=options.batch_size,
            device=device,
            progress=options.progress,
            keep=keep,
            shifts=shifts,
            combine=combine,
            also=also,
        )
        report = built.report(outcome, options.stats)
        if outcome.also:  # the other combine rules' statistics, from the same runs
            report["also"] = {rule: built.report(other, options.stats) for rule, other in outcome.also.items()}
        if check is not None:
            report["chunking"] = check.measure(built.prompts, built.table["answer_id"], outcome.logits, device)
        return TaskResult(report, outcome.rows())

    def plot(self, report: dict, path: Path, title: str) -> Optional[Path]:
        return plot_lookup(report, path, title)

    def summary(self, report: dict) -> list[str]:
        return lookup_summary(report) + chunking_lines(report.get("chunking"))
