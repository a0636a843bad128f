"""The filler-length probe (the paper's code-completion probe, generalised), one task in one file: its spec,
prompts, scoring and report.

A prompt ``before + filler(n) + after`` is scored for every filler length ``n`` (in TOKENS, exact under the
model's own tokenizer) of a range: the full-vocabulary top-1 next token and the log-probability of each
candidate answer, a multi-token candidate (``"32"`` is two tokens in Qwen's vocabulary) scored as a whole
sequence (teacher-forced: the sum of its tokens' log-probabilities). With chunked compression the filler length
moves everything after it across compression boundaries, so a phase-sensitive model flips its top-1 with period
S. A flip is a change of the full-vocabulary top-1 between consecutive lengths: a swap of the two candidates'
order below some third token is not a flip (``candidate_flips`` counts those separately).

Two sources: ``text`` (a template with a ``{filler}`` slot, a filler unit repeated until the filler has exactly
``n`` tokens, and candidate strings; e.g. ``conf/eval/task/probe_fp8.yaml``, a reconstruction of the paper's FP8
prompt) and ``lookup`` (one synthetic lookup prompt with ``n`` pad tokens of prefix padding as the filler;
candidates are the target's value and the values of its neighbouring records).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ckv.config import ConfigError, check_choice, check_int
from ckv.data.lookup import RecordCodec, assemble_lookup
from ckv.eval.lookup import PAPER_N_RECORDS, codec_for
from ckv.eval.models import ModelFacts
from ckv.eval.periodicity import dominant_period, periodicity_chance, periodicity_score
from ckv.eval.plots import plot_probe
from ckv.eval.registry import EvalTask, RunOptions, TaskResult, check_name, register_task
from ckv.eval.scoring import LogitsFn, score_next_token
from ckv.eval.vocab import AUTO, TextTokenizer, TokenSpec, VocabSpec, check_token, single_token, vocab_spec
from ckv.geometry import phase

SOURCES = ("text", "lookup")
SLOT = "{filler}"
MAX_REPEATS_PER_TOKEN = 64  # the longest filler searched: 64 units per token asked (a 16-char "=" token is 16)


@dataclass(frozen=True)
class ProbeSpec:
    """Settings of the filler-length probe.

    ``lengths``: ``[first, last]`` filler lengths in tokens (inclusive). ``stride``: phase period (``None``: the
    model's, else 1). Text source: ``template`` (with one ``{filler}``), ``unit`` (the filler text, repeated
    until the filler tokenises to exactly the length asked; a length no repeat count reaches is an error),
    ``candidates`` (answer strings, each scored as a whole token sequence; the first is the expected answer;
    their first tokens must differ, so that the top-1 names at most one of them), ``bos`` (``"auto"``, an id or
    ``None``). Lookup source: ``vocab`` (as the lookup task's), ``n_records`` (``None``: the run's),
    ``n_distractors`` neighbouring records' values as extra candidates.
    """

    name: str = "probe"
    source: str = "text"
    lengths: tuple[int, int] = (0, 15)
    stride: Optional[int] = None
    template: Optional[str] = None
    unit: Optional[str] = None
    candidates: tuple[str, ...] = ()
    bos: TokenSpec = "auto"
    vocab: VocabSpec = field(default_factory=VocabSpec)
    n_records: Optional[int] = None
    n_distractors: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        check_name(self)
        object.__setattr__(self, "vocab", vocab_spec(self.vocab))
        check_choice("task.source", self.source, SOURCES)
        lengths = self.lengths
        if not (
            isinstance(lengths, (list, tuple))
            and len(lengths) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)
            and 0 <= lengths[0] <= lengths[1]
        ):
            raise ConfigError(f"task.lengths={lengths!r} must be [first, last] filler lengths with 0 <= first <= last")
        object.__setattr__(self, "lengths", tuple(lengths))
        cands = self.candidates
        if not isinstance(cands, (list, tuple)) or not all(
            isinstance(c, str) and c or isinstance(c, int) and not isinstance(c, bool) for c in cands
        ):
            raise ConfigError(f"task.candidates={cands!r} must be a list of answer strings, e.g. ['8', '32']")
        object.__setattr__(self, "candidates", tuple(str(c) for c in cands))
        if len(set(self.candidates)) < len(self.candidates):
            raise ConfigError(f"task.candidates={list(self.candidates)} holds the same answer twice")
        for name in ("template", "unit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"task.{name}={value!r} must be null or a non-empty string")
        if self.stride is not None:
            check_int("task.stride", self.stride)
        if self.n_records is not None:
            check_int("task.n_records", self.n_records, 3)
        check_int("task.n_distractors", self.n_distractors, 0)
        check_int("task.seed", self.seed, 0)
        check_token("task.bos", self.bos)
        if self.source == "text":
            if not self.template or self.template.count(SLOT) != 1:
                raise ConfigError(f"task.template must contain {SLOT} exactly once")
            if not self.unit:
                raise ConfigError("task.unit (the filler text) must be a non-empty string")
            if len(self.candidates) < 1:
                raise ConfigError("task.candidates is empty: give at least one answer string")


@dataclass(frozen=True)
class ProbePrompt:
    """The parts of a probe prompt as token ids: ``fillers[n]`` holds the filler of exactly ``n`` tokens (with its
    text in ``filler_texts`` for a text probe), ``candidates`` each answer's token sequence, ``labels`` their
    names; ``canonical[n]`` says whether the whole prompt's text tokenises to the same ids (the parts are
    tokenised separately so that the filler never merges with its neighbours; ``None`` without a tokenizer), and
    ``candidates_canonical[n]`` for each candidate whether the prompt's text followed by the candidate's tokenises
    to the prompt's ids followed by the candidate's (else the teacher-forced score is of a tokenisation the
    tokenizer never produces)."""

    before: list[int]
    fillers: dict[int, list[int]]
    after: list[int]
    candidates: list[list[int]]
    labels: list[str]
    filler_texts: dict[int, str] = field(default_factory=dict)
    canonical: dict[int, Optional[bool]] = field(default_factory=dict)
    candidates_canonical: dict[int, list[bool]] = field(default_factory=dict)
    codec: dict = field(default_factory=dict)  # a lookup prompt's vocabulary (``RecordCodec.describe()``)

    def __post_init__(self) -> None:
        bad = {n: len(f) for n, f in self.fillers.items() if len(f) != n}
        if bad:
            raise ConfigError(f"fillers of the wrong length (asked: got) {bad}")
        if any(not c for c in self.candidates):
            raise ConfigError(f"task.candidates: a candidate of {self.labels} is empty after tokenization")
        firsts = [c[0] for c in self.candidates]
        dup = sorted({i for i in firsts if firsts.count(i) > 1})
        if dup:
            raise ConfigError(
                f"task.candidates={self.labels} share first tokens {dup}; the top-1 cannot tell them apart"
            )

    def ids(self, n: int) -> np.ndarray:
        """The prompt with the filler of ``n`` tokens. (T,)"""
        return np.asarray(self.before + self.fillers[n] + self.after, dtype=np.int64)


def exact_fillers(tokenizer: TextTokenizer, unit: str, lengths: range) -> dict[int, tuple[str, list[int]]]:
    """For each length ``n``, the shortest repeat ``unit * k`` that tokenises to exactly ``n`` tokens, with its ids.

    BPE merges runs (``"===="`` may be one token), so ``k`` repeats need not give ``k`` tokens; raises
    ``ConfigError`` naming the lengths that no repeat count up to ``MAX_REPEATS_PER_TOKEN * (last + 1)``
    reaches."""
    lo, hi = lengths.start, lengths.stop - 1
    found: dict[int, tuple[str, list[int]]] = {}
    k, below = 0, 0
    # stop 8 repeats after the count passed the range, or when even 64 repeats per token would not reach it
    while len(found) < len(lengths) and below < 8 and k <= MAX_REPEATS_PER_TOKEN * (hi + 1):
        text = unit * k
        ids = tokenizer.encode(text) if k else []
        n = len(ids)
        if lo <= n <= hi and n not in found:
            found[n] = (text, ids)
        below = below + 1 if n > hi else 0
        k += 1
    missing = [n for n in lengths if n not in found]
    if missing:
        raise ConfigError(
            f"task.unit={unit!r}: no repeat of it tokenises to exactly {missing} tokens in the model's "
            "tokenizer; choose another unit (or lengths)"
        )
    return found


def text_prompt(spec: ProbeSpec, tokenizer: Optional[TextTokenizer]) -> ProbePrompt:
    """Tokenize a text probe: before, filler and after separately (so the filler never merges with its
    neighbours); every filler exactly its length in tokens; candidates as whole token sequences."""
    if tokenizer is None:
        raise ConfigError("task.source='text' needs a tokenizer but the model has none; use source 'lookup'")
    before, after = spec.template.split(SLOT)  # type: ignore[union-attr]
    if spec.bos == AUTO:
        bos = tokenizer.bos_id
    else:
        bos = (
            spec.bos if spec.bos is None or isinstance(spec.bos, int) else single_token(tokenizer, spec.bos, "task.bos")
        )
    lo, hi = spec.lengths
    fillers = exact_fillers(tokenizer, spec.unit, range(lo, hi + 1))  # type: ignore[arg-type]
    head = [] if bos is None else [int(bos)]
    before_ids, after_ids = tokenizer.encode(before), tokenizer.encode(after)
    candidates = [tokenizer.encode(c) for c in spec.candidates]
    canonical = {
        n: tokenizer.encode(before + text + after) == before_ids + ids + after_ids for n, (text, ids) in fillers.items()
    }
    candidates_canonical = {
        n: [
            tokenizer.encode(before + text + after + c) == before_ids + ids + after_ids + c_ids
            for c, c_ids in zip(spec.candidates, candidates)
        ]
        for n, (text, ids) in fillers.items()
    }
    return ProbePrompt(
        head + before_ids,
        {n: ids for n, (_, ids) in fillers.items()},
        after_ids,
        candidates,
        list(spec.candidates),
        filler_texts={n: text for n, (text, _) in fillers.items()},
        canonical=canonical,
        candidates_canonical=candidates_canonical,
    )


def lookup_prompt(spec: ProbeSpec, codec: RecordCodec, n_records: int) -> ProbePrompt:
    """One synthetic lookup prompt whose prefix padding (``n`` pad tokens) is the filler; the target is the
    middle record."""
    if not 3 <= n_records <= codec.n_keys:
        raise ConfigError(f"task.n_records={n_records} must lie in [3, {codec.n_keys} keys]")
    rng = np.random.default_rng(spec.seed)
    keys = rng.choice(codec.n_keys, n_records, replace=False)
    values = rng.integers(0, codec.n_values, n_records)
    t = n_records // 2
    ex = assemble_lookup(codec, keys, values, np.zeros(n_records + 1, dtype=np.int64), np.array([t]), rng)
    cands, labels = [codec.answer_tokens(int(values[t]))], ["target"]
    for d in sorted(range(-t, n_records - t), key=lambda x: (abs(x), x))[1:]:  # nearest records first
        if len(cands) > spec.n_distractors:
            break
        cand = codec.answer_tokens(int(values[t + d]))
        if cand[0] not in [c[0] for c in cands]:
            cands.append(cand)
            labels.append(f"record {d:+d}")
    k = len(codec.prefix)
    tokens = ex.prompt.tolist()
    lo, hi = spec.lengths
    fillers = {n: [codec.pad_id] * n for n in range(lo, hi + 1)}
    return ProbePrompt(tokens[:k], fillers, tokens[k:], cands, labels, codec=codec.describe())


def _log(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p)


class ProbeTask:
    """The built probe prompts (one per filler length)."""

    def __init__(
        self,
        spec: ProbeSpec,
        prompt: ProbePrompt,
        *,
        max_len: int,
        model_stride: Optional[int] = None,
        tokenizer: Optional[TextTokenizer] = None,
        limit: Optional[int] = None,
    ) -> None:
        self.spec, self.prompt, self.tokenizer = spec, prompt, tokenizer
        self.stride = spec.stride or model_stride or 1
        lo, hi = spec.lengths
        self.filler_tokens = np.arange(lo, hi + 1)[:limit] if limit else np.arange(lo, hi + 1)
        self.prompts = [prompt.ids(int(n)) for n in self.filler_tokens]
        longest = max(len(p) for p in self.prompts) + max(len(c) for c in prompt.candidates) - 1
        if longest > max_len:
            raise ConfigError(
                f"probe prompts need up to {longest} tokens but the model's context is {max_len}; lower task.lengths"
            )

    def evaluate(
        self, model: LogitsFn, *, batch_size: int = 64, device: torch.device | str = "cpu", progress: bool = True
    ) -> dict:
        """Score every length: full-vocabulary top-1 and each candidate's sequence log-probability; returns the
        report (``report``)."""
        cands = self.prompt.candidates
        run = dict(batch_size=batch_size, device=device, progress=progress, desc=self.spec.name)
        first = np.tile(np.array([c[0] for c in cands])[None, :], (len(self.prompts), 1))  # (L, C)
        scores = score_next_token(model, self.prompts, first, **run)
        logp = _log(scores.probs)  # (L, C)
        # teacher forcing: token j of a candidate after the prompt and the candidate's first j tokens
        later = [(i, c, j) for i in range(len(self.prompts)) for c, seq in enumerate(cands) for j in range(1, len(seq))]
        if later:
            extended = [
                np.concatenate([self.prompts[i], np.asarray(cands[c][:j], dtype=np.int64)]) for i, c, j in later
            ]
            targets = np.array([[cands[c][j]] for _, c, j in later])
            rest = score_next_token(model, extended, targets, **run)
            rows, cols = np.array([i for i, _, _ in later]), np.array([c for _, c, _ in later])
            np.add.at(logp, (rows, cols), _log(rest.probs[:, 0]))
        return self.report(logp, scores.top1)

    def _kept(self) -> tuple[np.ndarray, list[int]]:
        """(L,) bool: the lengths the statistics use, and the lengths left out: those whose prompt or candidates
        do not tokenise as the tokenizer itself would (all are kept when none or all are such)."""
        prompt = self.prompt
        ok = np.array(
            [
                prompt.canonical.get(int(f)) is not False and all(prompt.candidates_canonical.get(int(f), [True]))
                for f in self.filler_tokens
            ]
        )
        if ok.all() or not ok.any():
            return np.ones(len(ok), dtype=bool), [int(f) for f in self.filler_tokens[~ok]]
        return ok, [int(f) for f in self.filler_tokens[~ok]]

    def report(self, logp: np.ndarray, top1: np.ndarray) -> dict:
        """``logp`` (L, C) candidate sequence log-probabilities and ``top1`` (L,) full-vocabulary top-1 ids ->
        the JSON-ready report: per length (top-1 token, which candidate it is, each candidate's log-probability,
        whether prompt and candidates tokenise as the tokenizer's own), per phase, flips of the top-1, and the
        periodicity of p(expected). Lengths whose prompt or candidates are not the tokenizer's own tokenisation are
        left out of the per-phase table, the flips, the share and the periodicity (unless every length is; then all
        are kept) and listed in ``headline.non_canonical_lengths``."""
        labels, S = self.prompt.labels, self.stride
        firsts = [c[0] for c in self.prompt.candidates]
        phases = phase(self.filler_tokens, S)
        top1_is = [labels[firsts.index(int(t))] if int(t) in firsts else None for t in top1]  # a candidate or None
        best = logp.argmax(1)  # the more probable candidate, whatever the top-1
        text = bool(self.prompt.filler_texts)
        rows = [
            {
                "filler_tokens": int(f),
                "phase": int(ph),
                "top1_id": int(t),
                "top1_token": self.tokenizer.decode([int(t)]) if self.tokenizer else None,
                "top1_is": ti,
                "expected_is_top1": ti == labels[0],
                "best_candidate": labels[int(b)],
                **{f"logp[{lab}]": (float(v) if math.isfinite(v) else None) for lab, v in zip(labels, lp)},
                **(
                    {
                        "filler_text": self.prompt.filler_texts[int(f)],
                        "canonical": self.prompt.canonical[int(f)],
                        **{
                            f"canonical[{lab}]": ok
                            for lab, ok in zip(labels, self.prompt.candidates_canonical.get(int(f), []))
                        },
                    }
                    if text
                    else {}
                ),
            }
            for f, ph, t, ti, b, lp in zip(self.filler_tokens, phases, top1, top1_is, best, logp)
        ]
        kept, left_out = self._kept()
        n = int(kept.sum())
        expected_top = np.array([r["expected_is_top1"] for r in rows])
        per_phase = []
        for ph in range(S):
            sel = (phases == ph) & kept
            if not sel.any():
                continue
            per_phase.append(
                {
                    "phase": ph,
                    "n_lengths": int(sel.sum()),
                    "expected_top1_share": float(expected_top[sel].mean()),
                    **{
                        f"logp[{lab}]": {
                            "mean": float(logp[sel, c].mean()),
                            "min": float(logp[sel, c].min()),
                            "max": float(logp[sel, c].max()),
                        }
                        for c, lab in enumerate(labels)
                    },
                }
            )
        curve = np.exp(logp[kept, 0])  # p(expected answer), a whole-sequence probability
        periodicity = None
        if n >= 2 and S <= n:
            dom = dominant_period(curve)
            periodicity = {
                "of": f"p({labels[0]})",
                "period": S,
                "score": periodicity_score(curve, S),
                "chance": periodicity_chance(n, S),
                "dominant_period": dom.period,
                "dominant_p_value": dom.p_value,
            }
        top, bst = top1[kept], best[kept]
        flips = int(np.sum(top[1:] != top[:-1]))
        headline = {
            "flips": flips,
            "candidate_flips": int(np.sum(bst[1:] != bst[:-1])),
            "expected_top1_share": float(expected_top[kept].mean()),
            "expected_best_share": float((bst == 0).mean()),  # lengths where it beats every other candidate
            "top1_by_length": {r["filler_tokens"]: r["top1_token"] if self.tokenizer else r["top1_id"] for r in rows},
            "dominant_period": (periodicity or {}).get("dominant_period"),
            "non_canonical_lengths": left_out,
            "non_canonical_left_out": bool(left_out) and n < len(rows),
        }
        return {
            "task": "probe",
            "name": self.spec.name,
            "stride": S,
            "labels": labels,
            "candidate_ids": self.prompt.candidates,
            "spec": asdict(self.spec),
            "headline": headline,
            "lengths": rows,
            "phases": per_phase,
            "flips": flips,
            "periodicity": periodicity,
            **({"codec": self.prompt.codec} if self.prompt.codec else {}),
        }


def probe_summary(report: dict) -> list[str]:
    """The one-screen summary of a probe report: flips, the expected answer's top-1 share per phase, the
    periodicity of its probability, and the lengths left out as not the tokenizer's own tokenisation."""
    h, labels = report["headline"], report["labels"]
    per = "  ".join(f"{p['phase']}: {100 * p['expected_top1_share']:.0f}" for p in report["phases"])
    lines = [
        f"{report['flips']} flips of the full-vocabulary top-1 over {len(report['lengths'])} filler lengths "
        f"({h['candidate_flips']} swaps of the candidates' order)",
        f"'{labels[0]}' is the top-1 at {100 * h['expected_top1_share']:.0f}% of lengths; per phase "
        f"(filler tokens mod {report['stride']}, %): {per}",
        f"'{labels[0]}' is more probable than every other candidate at {100 * h['expected_best_share']:.0f}% of "
        "lengths",
    ]
    per_ = report["periodicity"]
    if per_ is not None:
        dom, score = per_["dominant_period"], per_["score"]
        lines.append(
            f"periodicity of {per_['of']} at period {per_['period']}: {'n/a' if score is None else f'{score:.2f}'}"
            f" (chance {per_['chance']:.2f}); dominant period: {'none' if dom is None else dom}"
        )
    if h["non_canonical_lengths"]:
        lines.append(
            f"{len(h['non_canonical_lengths'])} lengths are not the tokenizer's own tokenisation "
            f"{h['non_canonical_lengths']}: "
            + ("left out of the statistics" if h["non_canonical_left_out"] else "all lengths are, so none is left out")
        )
    return lines


@register_task
class ProbeKind(EvalTask):
    """``task.kind=probe``: the filler-length probe (``ProbeTask``), a text template (``text_prompt``) or one
    synthetic lookup prompt (``lookup_prompt``); plot ``plot_probe``."""

    kind = "probe"
    spec = ProbeSpec

    def build(self, spec: ProbeSpec, model: ModelFacts, limit: Optional[int] = None) -> ProbeTask:
        if spec.lengths[1] >= model.max_len:
            raise ConfigError(
                f"task.lengths={list(spec.lengths)}: fillers must be shorter than the model's context of "
                f"{model.max_len} tokens"
            )
        if spec.source == "text":
            if isinstance(spec.bos, int) and not 0 <= spec.bos < model.vocab_size:
                raise ConfigError(f"task.bos={spec.bos} is outside the model's vocabulary of {model.vocab_size} ids")
            prompt = text_prompt(spec, model.tokenizer)
        else:
            n = spec.n_records or (model.lookup.n_records if model.lookup else PAPER_N_RECORDS)
            prompt = lookup_prompt(spec, codec_for(spec.vocab, model), n)
        return ProbeTask(
            spec, prompt, max_len=model.max_len, model_stride=model.stride, tokenizer=model.tokenizer, limit=limit
        )

    def run(self, built: ProbeTask, logits: LogitsFn, options: RunOptions, device: Any) -> TaskResult:
        report = built.evaluate(logits, batch_size=options.batch_size, device=device, progress=options.progress)
        return TaskResult(report, report["lengths"])

    def plot(self, report: dict, path: Path, title: str) -> Optional[Path]:
        return plot_probe(report, path, title)

    def summary(self, report: dict) -> list[str]:
        return probe_summary(report)
