"""Batched next-token scoring of many prompts with any causal LM callable.

A model is any callable ``input_ids (B, T) -> logits`` returning ``(B, T, V)`` or just the last position's
``(B, V)``; ``ckv.eval.models`` wraps ckv and transformers models so that only the last position is computed.
Prompts are grouped by length, so batches need no padding and no attention mask. Long prompts (the needle test)
are scored by chunked prefill through the model's KV cache (``CkvChunkedLastLogits`` here, ``HFLastLogits`` with
``chunk`` in ``ckv.eval.hf_models``) and may be built on demand (``LazyPrompts``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Union

import numpy as np
import torch
from tqdm.auto import tqdm

from ckv.checks import check_choice
from ckv.model import Transformer

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
COMBINES = ("mean_logprob", "max_confidence")  # how the runs of a prompt are combined (``combine_runs``)


def check_chunk(chunk: int) -> None:
    """A prefill chunk must be a positive integer number of tokens."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"prefill chunk={chunk!r} must be an integer >= 1 (tokens per forward)")


class CkvChunkedLastLogits:
    """Last-position logits of a ckv ``Transformer`` by chunked prefill: ``chunk`` tokens per forward through
    the model's own KV cache, the LM head on the last position only. Activation and attention memory are
    bounded by the chunk (scores ``(B, H, chunk, cached)``); no ``(T, V)`` logits exist. Equals one full forward
    (tested for full and compressed attention)."""

    def __init__(self, model: Transformer, chunk: int) -> None:
        check_chunk(chunk)
        self.model, self.chunk = model, chunk

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        cache = self.model.new_cache(input_ids.shape[0])
        for start in range(0, input_ids.shape[1], self.chunk):
            hidden = self.model.hidden_states(input_ids[:, start : start + self.chunk], cache)  # (B, c, d)
        return self.model.lm_head(hidden[:, -1])  # (B, V)


class LazyPrompts(Sequence[np.ndarray]):
    """Prompts of known ``lengths`` (P,) built one at a time by ``build(i)`` when scored (a 128K-token prompt set
    does not fit in memory at once)."""

    def __init__(self, lengths: np.ndarray, build: Callable[[int], np.ndarray]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._build = build

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        prompt = self._build(int(i))
        if len(prompt) != self.lengths[i]:
            raise RuntimeError(f"prompt {i} has {len(prompt)} tokens, its declared length is {self.lengths[i]}")
        return prompt

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class Scores:
    """``top1`` (P,): the full-vocabulary argmax after each prompt; ``probs`` (P, C): the softmax probability of
    each prompt's candidate ids; ``logits``: the scored last-position logits (V,) (float32, CPU) of the prompts
    asked for by index (``keep``); ``also``: the same runs combined by other rules (``score_next_token``'s
    ``also``), one ``Scores`` each."""

    top1: np.ndarray
    probs: np.ndarray
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    also: dict[str, Scores] = field(default_factory=dict)


def prompt_lengths(prompts: Union[Sequence[np.ndarray], LazyPrompts]) -> np.ndarray:
    """(P,) the length of each prompt (``LazyPrompts`` know theirs without building them)."""
    if isinstance(prompts, LazyPrompts):
        return prompts.lengths
    return np.array([len(p) for p in prompts], dtype=np.int64)


def length_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Indices of prompts grouped into batches of equal length, at most ``batch_size`` each, in a stable order."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    order = np.argsort(lengths, kind="stable")
    batches: list[np.ndarray] = []
    for length in np.unique(lengths):
        same = order[lengths[order] == length]
        batches += [same[i : i + batch_size] for i in range(0, len(same), batch_size)]
    return batches


def score_next_token(
    model: LogitsFn,
    prompts: Union[Sequence[np.ndarray], LazyPrompts],
    candidates: np.ndarray,
    *,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    progress: bool = True,
    desc: str = "scoring",
    keep: Sequence[int] = (),
    variants: Sequence[Sequence[np.ndarray]] = (),
    combine: str = "mean_logprob",
    also: Sequence[str] = (),
) -> Scores:
    """Score the token after each prompt: its full-vocabulary top-1 and the probabilities of ``candidates``
    (P, C) ids, and keep the logits of the prompts in ``keep`` (indices) as scored. Runs under
    ``torch.inference_mode``, in float32 softmax, with a progress bar over the prompts (``progress``).
    ``LazyPrompts`` are built batch by batch. ``variants``: other versions of each prompt, of its length (the shift
    ensemble's, ``ckv.eval.mitigation``), run beside it; the runs' distributions are combined by ``combine_runs``
    and the combined one is scored (no logits are kept); ``also``: other rules scored from the same runs (no more
    forwards), each returned in ``Scores.also``."""
    cand = np.asarray(candidates, dtype=np.int64)
    if cand.ndim != 2 or cand.shape[0] != len(prompts):
        raise ValueError(f"candidates must be (n_prompts={len(prompts)}, C), got {cand.shape}")
    rules = (combine, *also)
    for rule in rules:
        check_choice("combine", rule, COMBINES)
    lengths = prompt_lengths(prompts)
    if any(not np.array_equal(prompt_lengths(v), lengths) for v in variants):
        raise ValueError("every variant of a prompt must have its length")
    top1 = {rule: np.zeros(len(prompts), dtype=np.int64) for rule in rules}
    probs = {rule: np.zeros(cand.shape, dtype=np.float64) for rule in rules}
    kept: dict[int, torch.Tensor] = {}
    wanted = {int(i) for i in keep}
    batches = length_batches(lengths, batch_size)
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress, unit="prompt", leave=False)
    with torch.inference_mode(), bar:
        for idx in batches:
            runs = []
            for source in (prompts, *variants):
                ids = torch.as_tensor(np.stack([source[i] for i in idx]), device=device)  # (B, T)
                logits = model(ids)
                logits = logits[:, -1] if logits.dim() == 3 else logits  # (B, V)
                runs.append(torch.log_softmax(logits.float(), dim=-1))
            stacked = torch.stack(runs) if variants else None  # (k, B, V)
            for rule in rules:
                logp = runs[0] if stacked is None else combine_runs(stacked, rule)
                top1[rule][idx] = logp.argmax(-1).cpu().numpy()
                probs[rule][idx] = logp.gather(1, torch.as_tensor(cand[idx], device=logp.device)).exp().cpu().numpy()
            if not variants:
                kept.update({int(i): logits[j].float().cpu() for j, i in enumerate(idx) if int(i) in wanted})  # (V,)
            bar.update(len(idx))
    others = {rule: Scores(top1=top1[rule], probs=probs[rule]) for rule in also}
    return Scores(top1=top1[combine], probs=probs[combine], logits=kept, also=others)


def combine_runs(logp: torch.Tensor, rule: str) -> torch.Tensor:
    """One distribution (B, V) of log-probabilities from ``k`` runs of each prompt, ``logp`` (k, B, V):
    ``mean_logprob``, the mean of the runs' log-probabilities, renormalised (a log-linear pool: its top-1 is the
    token the runs rate highest on average in log space); ``max_confidence``, per prompt the run whose top-1
    probability is the highest (ties: the earlier run)."""
    check_choice("combine", rule, COMBINES)
    if rule == "mean_logprob":
        return torch.log_softmax(logp.mean(0), dim=-1)
    best = logp.amax(-1).argmax(0)  # (B,): the run whose top-1 is the most probable
    return logp[best, torch.arange(logp.shape[1], device=logp.device)]
