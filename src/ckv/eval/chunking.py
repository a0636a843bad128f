"""Does a score depend on the prefill chunk? The chunk check of transformers models scored by chunked prefill.

A transformers model's chunked prefill (``HFLastLogits`` with a chunk) is meant to equal one full forward, but it
need not: DeepSeek-V4's lightning indexer keeps each query's top-k compressed entries with ``torch.topk``, whose
order among equal scores (ties at exactly 0 after the indexer's ReLU) depends on the tensor's shape, so where
top-k binds a chunk can select other entries than the full forward (issue 21; docs/attention.md). The check takes
``n_check`` of the scored prompts, evenly spread over the prompt set, and compares the logits they were scored
with (kept by ``score_next_token``) with one full forward of each prompt (batch 1, no cache): the largest
absolute difference of the last-position logits, of the answer's probability, and how many prompts get another
top-1 answer and another 0/1 score. Its cost: ``n_check`` full forwards of one prompt. ``results.json`` holds the
record under ``results.chunking``; ``chunking_lines`` gives the summary's line, a warning when an answer changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from ckv.eval.hf_models import HFLastLogits
from ckv.eval.scoring import LogitsFn


def check_sample(n_prompts: int, n_check: int) -> np.ndarray:
    """The indices of ``min(n_check, n_prompts)`` prompts spread evenly from the first to the last (both
    included), so the sample spans depths and shifts; empty for ``n_check = 0``."""
    k = min(n_check, n_prompts)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.round(np.linspace(0, n_prompts - 1, k)).astype(np.int64))


class ChunkCheck:
    """The chunk check of one evaluation scored with ``logits`` (an ``HFLastLogits``): which prompts to keep the
    scored logits of (``indices``), and the record of the comparison (``measure``).

    No forward is compared (``indices`` empty, the record says why) when the prompts are scored by one forward
    each (no chunk), when every prompt fits one chunk, when ``n_check`` is 0 (``task.chunk_check=0``) or when
    ``skip`` gives a reason (e.g. one full forward would not fit in memory).
    """

    def __init__(self, logits: HFLastLogits, lengths: np.ndarray, n_check: int, skip: Optional[str] = None) -> None:
        self.chunk, self.longest = logits.chunk, int(np.max(lengths))
        self.full = HFLastLogits(logits.model)  # one forward, no cache
        self.note: Optional[str] = None
        if self.chunk is None:
            self.note = "each prompt is scored by one forward (no chunked prefill): nothing to check"
        elif self.chunk >= self.longest:
            self.note = f"every prompt ({self.longest} tokens) fits one prefill chunk of {self.chunk}: nothing to check"
        elif n_check == 0:
            self.note = "the chunk check is off (task.chunk_check=0)"
        elif skip is not None:
            self.note = f"not checked: {skip}"
        self.indices = check_sample(len(lengths), n_check) if self.note is None else np.zeros(0, dtype=np.int64)

    def measure(
        self,
        prompts: Sequence[np.ndarray],
        answer_ids: np.ndarray,
        scored: dict[int, torch.Tensor],
        device: torch.device | str,
    ) -> dict:
        """The record: the scored logits (V,) of each checked prompt (``scored``, by index) against one full
        forward of it; ``answer_ids`` (P,) are the ids each prompt is scored against."""
        record: dict = {"chunk": self.chunk, "prompt_tokens": self.longest, "checked_prompts": len(self.indices)}
        if self.note is not None:
            return {**record, "note": self.note}
        logit_diff, p_diff, answers, scores = 0.0, 0.0, 0, 0
        with torch.inference_mode():
            for i in self.indices.tolist():
                ids = torch.as_tensor(np.asarray(prompts[i]), device=device)[None]  # (1, T)
                full = self.full(ids)[0].float().cpu()  # (V,)
                chunked = scored[i]  # (V,)
                answer = int(answer_ids[i])
                logit_diff = max(logit_diff, (chunked - full).abs().max().item())
                p_full, p_chunked = (torch.softmax(x, -1)[answer].item() for x in (full, chunked))
                p_diff = max(p_diff, abs(p_full - p_chunked))
                top_full, top_chunked = int(full.argmax()), int(chunked.argmax())
                answers += top_full != top_chunked
                scores += (top_full == answer) != (top_chunked == answer)
        return {
            **record,
            "prompt_indices": self.indices.tolist(),
            "max_abs_logit_diff": logit_diff,
            "max_abs_p_answer_diff": p_diff,
            "answers_changed": answers,
            "scores_changed": scores,
            "depends_on_chunk": answers > 0,
        }


def chunk_check(
    logits: LogitsFn, lengths: np.ndarray, n_check: int, skip: Optional[str] = None
) -> Optional[ChunkCheck]:
    """The ``ChunkCheck`` of an evaluation scored with ``logits``; ``None`` when it is not a transformers model's
    (ckv's chunked prefill equals its full forward, tested)."""
    if not isinstance(logits, HFLastLogits):
        return None
    return ChunkCheck(logits, lengths, n_check, skip)


def chunking_lines(record: Optional[dict]) -> list[str]:
    """The summary's line about the chunk check: none without a chunked prefill; a warning when an answer
    changed between the chunked prefill and one full forward."""
    if record is None or record["chunk"] is None:
        return []
    if "note" in record:
        return [f"chunk check: {record['note']}"]
    n, c, diff = record["checked_prompts"], record["chunk"], record["max_abs_logit_diff"]
    if record["depends_on_chunk"]:
        return [
            f"WARNING: this score depends on the chunk size: with prefill chunk {c}, {record['answers_changed']} of "
            f"{n} checked prompts have another top-1 answer than in one full forward ({record['scores_changed']} "
            f"another 0/1 score; max |logit diff| {diff:.3g}); rerun with task.prefill_chunk >= "
            f"{record['prompt_tokens']} (one forward per prompt) where memory allows, or report the score as "
            "chunk-dependent"
        ]
    return [
        f"chunk check: prefill chunk {c} vs one full forward on {n} prompts: max |logit diff| {diff:.3g}, same top-1"
    ]
