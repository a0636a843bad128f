"""Batched next-token scoring of many prompts with any causal LM callable.

A model is any callable ``input_ids (B, T) -> logits`` returning ``(B, T, V)`` or just the last position's
``(B, V)``; ``ckv.eval.models`` wraps ckv and transformers models so that only the last position is computed.
Prompts are grouped by length, so batches need no padding and no attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Scores:
    """``top1`` (P,): the full-vocabulary argmax after each prompt; ``probs`` (P, C): the softmax probability of
    each prompt's candidate ids."""

    top1: np.ndarray
    probs: np.ndarray


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
    prompts: Sequence[np.ndarray],
    candidates: np.ndarray,
    *,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    progress: bool = True,
    desc: str = "scoring",
) -> Scores:
    """Score the token after each prompt: its full-vocabulary top-1 and the probabilities of ``candidates``
    (P, C) ids. Runs under ``torch.inference_mode``, in float32 softmax."""
    cand = np.asarray(candidates, dtype=np.int64)
    if cand.ndim != 2 or cand.shape[0] != len(prompts):
        raise ValueError(f"candidates must be (n_prompts={len(prompts)}, C), got {cand.shape}")
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    top1 = np.zeros(len(prompts), dtype=np.int64)
    probs = np.zeros(cand.shape, dtype=np.float64)
    batches = length_batches(lengths, batch_size)
    with torch.inference_mode():
        for idx in tqdm(batches, desc=desc, disable=not progress, unit="batch", leave=False):
            ids = torch.as_tensor(np.stack([prompts[i] for i in idx]), device=device)  # (B, T)
            logits = model(ids)
            if logits.dim() == 3:
                logits = logits[:, -1]  # (B, V)
            logp = torch.log_softmax(logits.float(), dim=-1)
            top1[idx] = logp.argmax(-1).cpu().numpy()
            probs[idx] = logp.gather(1, torch.as_tensor(cand[idx], device=logp.device)).exp().cpu().numpy()
    return Scores(top1=top1, probs=probs)
