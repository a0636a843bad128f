"""The training stream of synthetic lookup sequences: one example per sequence, padded to ``seq_len + 1``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ckv.data.config import LookupConfig
from ckv.data.lookup import LookupFormat, make_lookup_example
from ckv.data.stream import IGNORE, rng_for

LOOKUP_SALT = 1  # keeps lookup draws apart from text shuffles made with the same seed


class LookupSequences:
    """Endless lookup sequences of one rank. Sequence ``i`` of rank ``r`` is drawn from its own generator
    seeded by ``(seed, split, salt, i * world_size + r)``, so streams are reproducible, random-access (the
    state is one counter) and distinct across ranks and splits."""

    def __init__(
        self, cfg: LookupConfig, fmt: LookupFormat, seq_len: int, *, seed: int, split: int, rank: int, world_size: int
    ) -> None:
        if cfg.max_len > seq_len + 1:
            raise ValueError(f"lookup examples of up to {cfg.max_len} tokens do not fit seq_len={seq_len}")
        self.cfg, self.fmt, self.seq_len = cfg, fmt, seq_len
        self.seed, self.split, self.rank, self.world_size = seed, split, rank, world_size
        self.index = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        self.index += 1
        return self.sample((self.index - 1) * self.world_size + self.rank)

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence number ``g`` of the split counted over all ranks (random access; ``next`` reads rank ``r``'s
        ``i``-th as ``g = i * world_size + r``)."""
        c = self.cfg
        rng = rng_for(self.seed, self.split, LOOKUP_SALT, g)
        pad = int(rng.integers(c.prefix_pad[0], c.prefix_pad[1] + 1))
        # drawn only with min_records set: streams without it stay the draws they always were
        n_records = c.n_records if c.min_records is None else int(rng.integers(c.min_records, c.n_records + 1))
        # distinct queries ask each record at most once: a sequence of fewer records than n_queries asks them all
        n_queries = min(c.n_queries, n_records) if c.distinct_queries else c.n_queries
        ex = make_lookup_example(
            self.fmt,
            rng,
            n_records,
            n_queries,
            filler=c.filler,
            prefix_pad=pad,
            tail_filler=c.tail_range(pad),
            distinct_queries=c.distinct_queries,
        )
        n = len(ex.tokens)
        tokens = np.full(self.seq_len + 1, self.fmt.pad_id, dtype=np.int64)  # (T+1,)
        tokens[:n] = ex.tokens
        if c.loss_on == "answers":
            target = np.zeros(self.seq_len + 1, dtype=bool)
            target[:n] = ex.loss_mask
        else:  # every real token except the pads
            target = tokens != self.fmt.pad_id
        labels = np.where(target[1:], tokens[1:], IGNORE)  # (T,) target of position t is token t+1
        return tokens[:-1], labels

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])
