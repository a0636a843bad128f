"""Position design of the position-matched lookup: where each target record sits, and how padding moves it.

A prompt is ``prefix [pad slot 0] record_0 [slot 1] record_1 ... record_{N-1} [slot N] separator queries``.
Slot ``j <= t`` lies before the target record ``t``; the pad tokens there (``pre``) move the target, the rest
(``post``) sit after it. Every prompt of a task has the same pad budget, so the query position is fixed.

Paired design: base example ``i`` has a base target position ``B_i`` and is evaluated at every shift
``k = 0..M-1`` (``k`` more pad tokens before the target, ``k`` fewer after it), so each base example puts one
target in every residue group ``(B_i + k) mod M``. The base positions follow a balanced schedule: within each
block of ``M^2`` base examples, indexed by ``(u, s)`` with ``v = (u + s) mod M``,

    B = prefix_len + (M - 1) + M * (u mod n_coarse) + v - u.

Then the residues ``B mod M`` are uniform and the mean of ``B`` is the same for every residue, which makes the
mean AND the variance of the target position identical across residue groups (docs/evaluation.md has the
proof). A prefix of the schedule that is a multiple of ``M`` still matches the means exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PADDINGS = ("prefix", "in_sequence")


@dataclass(frozen=True)
class PositionDesign:
    """Geometry of one lookup task's prompts (all lengths in tokens).

    ``n_coarse``: how many coarse levels (steps of ``modulus``) the base target positions spread over;
    ``max_base_pad``: the most pad tokens the schedule needs before a target at shift 0. The pad budget of
    every prompt is ``max_base_pad + modulus - 1``.
    """

    modulus: int
    n_records: int
    record_len: int
    prefix_len: int
    n_coarse: int
    max_base_pad: int

    @property
    def pad_budget(self) -> int:
        return self.max_base_pad + self.modulus - 1


def make_design(modulus: int, n_records: int, record_len: int, prefix_len: int) -> PositionDesign:
    """Spread base targets over as many coarse levels as the record block allows, with the smallest pad
    budget that still gives every scheduled position a target record."""
    if modulus < 1 or n_records < 1 or record_len < 1 or prefix_len < 0:
        raise ValueError(
            f"invalid design: modulus={modulus}, n_records={n_records}, record_len={record_len}, "
            f"prefix_len={prefix_len}"
        )
    span = n_records * record_len
    n_coarse = max(1, (span - modulus + 1) // modulus)
    max_offset = modulus * n_coarse + modulus - 2
    max_base_pad = max(record_len - 1, max_offset - (n_records - 1) * record_len)
    return PositionDesign(modulus, n_records, record_len, prefix_len, n_coarse, max_base_pad)


def base_offsets(n_base: int, design: PositionDesign) -> np.ndarray:
    """(n_base,) base target offsets ``B - prefix_len`` following the balanced schedule."""
    m = design.modulus
    j = np.arange(n_base) % (m * m)
    u, s = j // m, j % m
    v = (u + s) % m
    return (m - 1) + m * (u % design.n_coarse) + v - u


def choose_targets(
    offsets: np.ndarray, design: PositionDesign, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """For each base offset, a target record index ``t`` (uniform over the feasible ones) and the base pad
    ``a = offset - t * record_len`` (in ``[0, max_base_pad]``) placed before it. Returns ``(t, a)``, (n_base,) each."""
    L = design.record_len
    hi = np.minimum(design.n_records - 1, offsets // L)
    lo = np.maximum(0, -((design.max_base_pad - offsets) // L))  # ceil((offset - max_base_pad) / L)
    if np.any(lo > hi):
        raise ValueError("position design has no feasible target record for some offsets")
    t = lo + (rng.random(len(offsets)) * (hi - lo + 1)).astype(np.int64)
    return t, offsets - t * L


def slot_pads(target: int, pre: int, post: int, n_records: int, padding: str, rng: np.random.Generator) -> np.ndarray:
    """(n_records + 1,) pad tokens per slot: ``pre`` over slots ``0..target``, ``post`` over the rest.

    ``prefix``: all of ``pre`` in slot 0 (every record moves together) and all of ``post`` in the last slot.
    ``in_sequence``: each pad token goes to a uniformly random slot on its side of the target, so the gaps
    between records, and hence the distractors' phases, vary while the target moves by exactly ``pre``.
    """
    if padding not in PADDINGS:
        raise ValueError(f"padding={padding!r} is not allowed; choose one of {list(PADDINGS)}")
    if pre < 0 or post < 0 or not 0 <= target < n_records:
        raise ValueError(f"invalid slots: target={target}, pre={pre}, post={post}, n_records={n_records}")
    pads = np.zeros(n_records + 1, dtype=np.int64)
    if padding == "prefix":
        pads[0] += pre
        pads[n_records] += post
        return pads
    pads[: target + 1] = rng.multinomial(pre, np.full(target + 1, 1.0 / (target + 1)))
    after = n_records - target
    pads[target + 1 :] = rng.multinomial(post, np.full(after, 1.0 / after))
    return pads
