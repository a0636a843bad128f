"""The filler-length probe (the paper's code-completion probe, generalised).

A prompt ``before + unit * n + after`` is scored for ``n`` in a range of lengths: the probability of each
candidate answer's first token, the top-ranked candidate and the full-vocabulary top-1, grouped by
``filler tokens mod S``. With chunked compression the filler length moves everything after it across
compression boundaries, so a phase-sensitive model flips its answer with period S.

Two sources: ``text`` (a template with a ``{filler}`` slot, a filler unit and candidate strings, for models
with a tokenizer; e.g. the paper's FP8 prompt) and ``lookup`` (one synthetic lookup prompt with the filler as
prefix padding; candidates are the target's value and the values of its neighbouring records).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

from ckv.config import ConfigError
from ckv.data.lookup import RecordCodec, assemble_lookup
from ckv.eval.scoring import LogitsFn, score_next_token
from ckv.eval.stats import dominant_period, periodicity_chance, periodicity_score
from ckv.eval.vocab import TextTokenizer, TokenSpec, VocabSpec

SOURCES = ("text", "lookup")
SLOT = "{filler}"


@dataclass(frozen=True)
class ProbeSpec:
    """Settings of the filler-length probe.

    ``lengths``: ``[first, last]`` number of filler units (inclusive). ``stride``: phase period (``None``: the
    model's, else 1). Text source: ``template`` (with one ``{filler}``), ``unit`` (the filler text repeated),
    ``candidates`` (answer strings; the FIRST token of each is scored, the first candidate is the expected
    answer), ``bos`` (``"auto"``, an id or ``None``). Lookup source: ``vocab`` (as the lookup task's),
    ``n_records`` (``None``: the run's), ``n_distractors`` neighbouring records' values as extra candidates.
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
        if isinstance(self.vocab, dict):
            object.__setattr__(self, "vocab", VocabSpec(**self.vocab))
        object.__setattr__(self, "lengths", tuple(self.lengths))
        object.__setattr__(self, "candidates", tuple(self.candidates))
        if self.source not in SOURCES:
            raise ConfigError(f"task.source={self.source!r} is not allowed; choose one of {list(SOURCES)}")
        lo, hi = self.lengths if len(self.lengths) == 2 else (-1, -2)
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
            raise ConfigError(f"task.lengths={list(self.lengths)} must be [first, last] with 0 <= first <= last")
        if self.source == "text":
            if not self.template or self.template.count(SLOT) != 1:
                raise ConfigError(f"task.template must contain {SLOT} exactly once")
            if not self.unit:
                raise ConfigError("task.unit (the filler text) must be a non-empty string")
            if len(self.candidates) < 1:
                raise ConfigError("task.candidates is empty: give at least one answer string")


@dataclass(frozen=True)
class ProbePrompt:
    """The parts of a probe prompt as token ids, and the candidates' scored ids with their labels."""

    before: list[int]
    unit: list[int]
    after: list[int]
    candidate_ids: list[int]
    labels: list[str]

    def __post_init__(self) -> None:
        if not self.unit:
            raise ConfigError("the filler unit is empty after tokenization")
        dup = {i for i in self.candidate_ids if self.candidate_ids.count(i) > 1}
        if dup:
            raise ConfigError(f"candidates {self.labels} share first tokens {sorted(dup)}; they cannot be told apart")


def text_prompt(spec: ProbeSpec, tokenizer: Optional[TextTokenizer]) -> ProbePrompt:
    """Tokenize a text probe (each part separately, so the filler never merges with its neighbours)."""
    if tokenizer is None:
        raise ConfigError("task.source='text' needs a tokenizer but the model has none; use source 'lookup'")
    before, after = spec.template.split(SLOT)  # type: ignore[union-attr]
    bos = tokenizer.bos_id if spec.bos == "auto" else spec.bos
    ids = []
    for c in spec.candidates:
        enc = tokenizer.encode(c)
        if not enc:
            raise ConfigError(f"candidate {c!r} is empty after tokenization")
        ids.append(enc[0])
    return ProbePrompt(([] if bos is None else [int(bos)]) + tokenizer.encode(before), tokenizer.encode(spec.unit),
                       tokenizer.encode(after), ids, list(spec.candidates))


def lookup_prompt(spec: ProbeSpec, codec: RecordCodec, n_records: int) -> ProbePrompt:
    """One synthetic lookup prompt whose prefix padding is the filler; the target is the middle record."""
    if not 3 <= n_records <= codec.n_keys:
        raise ConfigError(f"task.n_records={n_records} must lie in [3, {codec.n_keys} keys]")
    rng = np.random.default_rng(spec.seed)
    keys = rng.choice(codec.n_keys, n_records, replace=False)
    values = rng.integers(0, codec.n_values, n_records)
    t = n_records // 2
    ex = assemble_lookup(codec, keys, values, np.zeros(n_records + 1, dtype=np.int64), np.array([t]), rng)
    ids, labels = [ex.answer_id], ["target"]
    for d in sorted(range(-t, n_records - t), key=lambda x: (abs(x), x))[1:]:  # nearest records first
        if len(ids) > spec.n_distractors:
            break
        cand = codec.answer_tokens(int(values[t + d]))[0]
        if cand not in ids:
            ids.append(cand)
            labels.append(f"record {d:+d}")
    k = len(codec.prefix)
    tokens = ex.prompt.tolist()
    return ProbePrompt(tokens[:k], [codec.pad_id], tokens[k:], ids, labels)


class ProbeTask:
    """The built probe prompts (one per filler length)."""

    def __init__(self, spec: ProbeSpec, prompt: ProbePrompt, *, max_len: int, model_stride: Optional[int] = None,
                 tokenizer: Optional[TextTokenizer] = None, limit: Optional[int] = None) -> None:
        self.spec, self.prompt, self.tokenizer = spec, prompt, tokenizer
        self.stride = spec.stride or model_stride or 1
        lo, hi = spec.lengths
        self.units = np.arange(lo, hi + 1)[:limit] if limit else np.arange(lo, hi + 1)
        self.filler_tokens = self.units * len(prompt.unit)
        self.prompts = [np.asarray(prompt.before + prompt.unit * int(n) + prompt.after, dtype=np.int64) for n in self.units]
        longest = max(len(p) for p in self.prompts)
        if longest > max_len:
            raise ConfigError(f"probe prompts need up to {longest} tokens but the model's context is {max_len}; "
                              "lower task.lengths")

    def evaluate(self, model: LogitsFn, *, batch_size: int = 64, device: torch.device | str = "cpu",
                 progress: bool = True) -> dict:
        """Score every length; returns the report (per length, per phase, periodicity of p(expected))."""
        cand = np.tile(np.asarray(self.prompt.candidate_ids)[None, :], (len(self.prompts), 1))
        scores = score_next_token(model, self.prompts, cand, batch_size=batch_size, device=device,
                                  progress=progress, desc=self.spec.name)
        return self.report(scores.probs, scores.top1)

    def report(self, probs: np.ndarray, top1: np.ndarray) -> dict:
        """``probs`` (L, C) candidate probabilities and ``top1`` (L,) ids -> the JSON-ready report."""
        labels, S = self.prompt.labels, self.stride
        phases = self.filler_tokens % S
        top = probs.argmax(1)
        rows = [{"units": int(n), "filler_tokens": int(f), "phase": int(ph), "top_candidate": labels[int(tc)],
                 "top1_id": int(t1), "top1_token": self.tokenizer.decode([int(t1)]) if self.tokenizer else None,
                 "expected_is_top": bool(tc == 0), **{f"p[{lab}]": float(p) for lab, p in zip(labels, pr)}}
                for n, f, ph, tc, t1, pr in zip(self.units, self.filler_tokens, phases, top, top1, probs)]
        per_phase = []
        for ph in range(S):
            sel = phases == ph
            if not sel.any():
                continue
            per_phase.append({"phase": ph, "n_lengths": int(sel.sum()), "expected_top_share": float((top[sel] == 0).mean()),
                              **{f"p[{lab}]": {"mean": float(probs[sel, c].mean()), "min": float(probs[sel, c].min()),
                                               "max": float(probs[sel, c].max())} for c, lab in enumerate(labels)}})
        curve = probs[:, 0]
        periodicity = None
        if len(curve) >= 2 and len(self.prompt.unit) == 1 and S <= len(curve):
            dom = dominant_period(curve)
            periodicity = {"period": S, "score": periodicity_score(curve, S), "chance": periodicity_chance(len(curve), S),
                           "dominant_period": dom.period, "dominant_p_value": dom.p_value}
        return {"task": "probe", "name": self.spec.name, "stride": S, "labels": labels,
                "candidate_ids": self.prompt.candidate_ids, "spec": asdict(self.spec), "lengths": rows,
                "phases": per_phase, "flips": int(np.sum(top[1:] != top[:-1])), "periodicity": periodicity}
