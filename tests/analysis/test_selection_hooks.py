"""The selectors of analysis=selection on a layer (``ckv.analysis.selection_hooks``): which entries hold a record,
which the query attended, and the selections the imposed selectors pick."""

from __future__ import annotations

import pytest
import torch

from ckv import Transformer
from ckv.analysis.selection_hooks import chosen_entries, imposed_selection, target_entries
from tests.helpers import small_config

from .conftest import W8S4


def test_the_entries_holding_a_record_and_the_entries_a_query_attended():
    """W = 8, S = 4: entry j pools positions 4j - 4 .. 4j + 3. A record at 5, 6 lies in entries 1 and 2 (both
    tokens); one at 7, 8 straddles: 7 in entries 1, 2 and 8 in entries 2, 3."""
    layer = Transformer(small_config(W8S4, n_layers=1)).layers[0].self_attn
    holds = target_entries(layer, 5, torch.tensor([5, 7]), 2)  # (B=2, E=5, R=2)
    assert holds[0].T.tolist() == [[False, True, True, False, False]] * 2
    assert holds[1].T.tolist() == [[False, True, True, False, False], [False, False, True, True, False]]
    # the query at grid position 15 sees entries 0..3 (entry s closes at 4s + 3)
    assert chosen_entries(None, 5, 15, 4, 2).tolist() == [[True, True, True, True, False]] * 2
    chosen = chosen_entries(torch.tensor([[1, -1], [3, 4]]), 5, 15, 4, 2)  # entry 4 is not visible: not attended
    assert chosen.tolist() == [[False, True, False, False, False], [False, False, False, True, False]]
    hit = (holds.any(-1) & chosen).any(-1)
    covered = (holds & chosen[..., None]).any(1).all(-1)
    assert hit.tolist() == [True, True] and covered.tolist() == [True, False]  # 7 is in neither 3 nor 4


class _Attend(torch.nn.Module):
    """Stands in for a layer's ``attend``: an ``lse`` of 0 makes the oracle's scores the summed entry weights."""

    def forward(self, q, kc, *rest, **kwargs):
        B, T, H, _ = q.shape
        return q, torch.zeros(B, T, H)


def _selections(selector: str, k: int, E: int = 6, T: int = 24, stride: int = 4, seed: int = 0) -> torch.Tensor:
    q, kc = torch.randn(2, T, 2, 8), torch.randn(2, E, 1, 8)
    gen = torch.Generator().manual_seed(seed)
    args = (q, kc, torch.zeros_like(kc), q, q)  # a JointAttention call: queries, entries' keys and values, local k, v
    call = dict(q_start=0, stride=stride, local_window=None)
    return imposed_selection(selector, _Attend(), args, call, k, gen)  # (B, T, k)


@pytest.mark.parametrize("selector", ["oracle", "random", "recency"])
def test_every_selector_picks_visible_entries_without_repeats_and_marks_empty_slots(selector):
    """Query t (grid position) sees entries s with 4 s + 3 <= t: visible and distinct picks, -1 exactly in the
    slots beyond the visible count."""
    k, sel = 3, _selections(selector, 3)
    for t in range(sel.shape[1]):
        n_visible = min((t + 1) // 4, 6)
        for row in sel[:, t].tolist():
            picked = [s for s in row if s >= 0]
            assert len(picked) == len(set(picked)) == min(k, n_visible)
            assert all(s < n_visible for s in picked) and row.count(-1) == k - len(picked)


def test_recency_keeps_the_last_k_visible_entries_and_random_is_seeded_and_uniform():
    rec = _selections("recency", 2)
    assert rec[0, 23].tolist() == [5, 4] and rec[1, 15].tolist() == [3, 2] and rec[0, 7].tolist() == [1, 0]
    assert torch.equal(_selections("random", 2, seed=5), _selections("random", 2, seed=5))
    assert not torch.equal(_selections("random", 2, seed=5), _selections("random", 2, seed=6))
    counts = torch.zeros(6)
    for seed in range(200):  # the last query sees all 6 entries: each is picked 2/6 of the time
        counts += torch.bincount(_selections("random", 2, seed=seed)[:, -1].reshape(-1), minlength=6)
    share = counts / counts.sum()
    assert torch.all((share - 1 / 6).abs() < 0.04), share
