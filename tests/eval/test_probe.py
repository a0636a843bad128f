"""The filler-length probe measures like the paper: flips of the full-vocabulary top-1, whole-sequence candidate
log-probabilities, filler lengths that are exact token counts of the model's own tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ckv.config import ConfigError
from ckv.eval.probe import ProbeSpec, ProbeTask, exact_fillers, probe_summary, text_prompt

from .helpers import TOK

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 400
SPEC = ProbeSpec(
    template='def f():\n    """{filler}"""\n    return torch.float',
    unit="=",
    candidates=("8", "32"),
    lengths=(4, 11),
    stride=4,
    bos=None,
)


def test_fillers_are_exact_token_counts_of_the_models_tokenizer() -> None:
    prompt = text_prompt(SPEC, TOK)
    for n in range(4, 12):
        text = prompt.filler_texts[n]
        assert len(TOK.encode(text)) == n and prompt.fillers[n] == TOK.encode(text)
        assert set(text) == {"="} and len(text) > n  # "=" runs merge: more characters than tokens
    assert prompt.candidates == [[ord("8")], [ord("3"), ord("2")]]  # "32" is scored as two tokens
    with pytest.raises(ConfigError, match=r"exactly \[3\] tokens"):  # "ab" repeats give only even counts
        exact_fillers(TOK, "ab", range(2, 5))


def _fixed_top1(input_ids: torch.Tensor) -> torch.Tensor:
    """Top-1 is always "x" (neither candidate); below it "8" and "3" trade places with the prompt length's parity;
    after "3" the next token is "2" (up to about e^-12)."""
    logits = torch.zeros(input_ids.shape[0], VOCAB)
    logits[:, ord("x")] = 8.0
    even = input_ids.shape[1] % 2 == 0
    logits[:, ord("8")], logits[:, ord("3")] = (3.0, 1.0) if even else (1.0, 3.0)
    after_3 = input_ids[:, -1] == ord("3")
    logits[after_3, ord("2")] = 20.0  # "2" all but certain after "3": p("32") ~ p("3")
    return logits


def test_shipped_fp8_reconstruction_has_exact_filler_lengths() -> None:
    cfg = yaml.safe_load((ROOT / "conf" / "eval" / "task" / "probe_fp8.yaml").read_text())
    cfg.pop("kind")
    spec = ProbeSpec(**cfg)
    task = ProbeTask(spec, text_prompt(spec, TOK), max_len=2048, tokenizer=TOK)
    assert list(task.filler_tokens) == list(range(24, 40)) and np.all(np.diff([len(p) for p in task.prompts]) == 1)
    assert task.prompt.candidates == [[ord("8")], [ord("3"), ord("2")]]
    # the paper's prompt: the outer code has already cast to float32 (so "32" after "FP" repeats that cast), the
    # cast being completed is ".to(FP", and the docstring around the filler names neither answer
    before, after = TOK.decode(task.prompt.before), TOK.decode(task.prompt.after)
    assert after.endswith("q = (x / scale).to(FP") and ".to(FP32)" in before.split("def quantize")[0]
    docstring = before.split('"""')[-1] + after.split('"""')[0]
    assert '"""' in before and not any(s in docstring for s in ("8", "32", "FP", "e4m3"))


def test_shipped_bible_probe_has_exact_filler_lengths_under_a_bible_bpe(cache_dir: str) -> None:
    """conf/eval/task/probe_bible.yaml (make pretrain's corpus-native probe) on a BPE trained on the shipped Bible:
    every filler length of its range exact, the two names before the filler, the question after it."""
    from ckv.data import DataConfig, build_batches
    from ckv.data.tokenizer import TokenizersTokenizer

    text = build_batches(
        DataConfig.from_dict({"kind": "text", "text": {"vocab_size": 1024}}), batch_size=1, seed=0, cache_dir=cache_dir
    )
    tok = TokenizersTokenizer(text.source.tok)
    cfg = yaml.safe_load((ROOT / "conf" / "eval" / "task" / "probe_bible.yaml").read_text())
    cfg.pop("kind")
    spec = ProbeSpec(**cfg)
    task = ProbeTask(spec, text_prompt(spec, tok), max_len=128, tokenizer=tok)
    assert list(task.filler_tokens) == list(range(8, 32)) and np.all(np.diff([len(p) for p in task.prompts]) == 1)
    assert len({c[0] for c in task.prompt.candidates}) == 2  # the top-1 names at most one of them
    before, after = tok.decode(task.prompt.before), tok.decode(task.prompt.after)
    assert "Bethel" in before and "Luz" in before and after.endswith("the place that Jacob called was")
    assert max(len(p) for p in task.prompts) <= 128  # make pretrain's sequence length


def test_no_flip_is_counted_while_the_top1_is_neither_candidate() -> None:
    task = ProbeTask(SPEC, text_prompt(SPEC, TOK), max_len=256, tokenizer=TOK)
    rep = task.evaluate(_fixed_top1, progress=False)
    rows = rep["lengths"]
    assert {r["top1_token"] for r in rows} == {"x"} and {r["top1_is"] for r in rows} == {None}
    assert rep["flips"] == 0 and rep["headline"]["flips"] == 0
    assert rep["headline"]["candidate_flips"] == len(rows) - 1  # the candidates' order swaps at every length
    assert not any(r["expected_is_top1"] for r in rows)


def test_multi_token_candidates_are_scored_as_whole_sequences() -> None:
    prompt = text_prompt(SPEC, TOK)
    rep = ProbeTask(SPEC, prompt, max_len=256, tokenizer=TOK).evaluate(_fixed_top1, progress=False)
    for row in rep["lengths"]:
        ids = torch.as_tensor(prompt.ids(row["filler_tokens"]))[None]
        first = torch.log_softmax(_fixed_top1(ids), -1)[0]
        second = torch.log_softmax(_fixed_top1(torch.cat([ids, torch.tensor([[ord("3")]])], 1)), -1)[0]
        assert row["logp[8]"] == pytest.approx(float(first[ord("8")]), abs=1e-5)
        assert row["logp[32]"] == pytest.approx(float(first[ord("3")] + second[ord("2")]), abs=1e-5)


def test_a_flip_of_the_top1_is_counted() -> None:
    def flipping(input_ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(input_ids.shape[0], VOCAB)
        logits[:, ord("8") if input_ids.shape[1] % 4 else ord("3")] = 9.0  # "3" is top-1 at one phase
        return logits

    rep = ProbeTask(SPEC, text_prompt(SPEC, TOK), max_len=256, tokenizer=TOK).evaluate(flipping, progress=False)
    top = [r["top1_is"] for r in rep["lengths"]]
    assert set(top) == {"8", "32"} and rep["flips"] == sum(a != b for a, b in zip(top, top[1:])) >= 3
    assert rep["periodicity"]["dominant_period"] == 4


def test_tokenisations_that_are_not_the_tokenizers_own_are_flagged_and_left_out() -> None:
    """A candidate that merges with the prompt's end ("=" + "==" is one run of 3) is not the tokenizer's own
    tokenisation; lengths with such prompts or candidates are listed and left out of the statistics."""
    spec = dataclasses.replace(SPEC, template="f({filler}) =", candidates=("8", "=="), lengths=(4, 11))
    prompt = text_prompt(spec, TOK)
    assert all(prompt.canonical.values()) and set(map(tuple, prompt.candidates_canonical.values())) == {(True, False)}
    rep = ProbeTask(spec, prompt, max_len=256, tokenizer=TOK).evaluate(_fixed_top1, progress=False)
    assert rep["lengths"][0]["canonical[==]"] is False and rep["headline"]["non_canonical_lengths"] == list(
        range(4, 12)
    )
    assert rep["headline"]["non_canonical_left_out"] is False  # every length is: none is left out, and it says so
    # some lengths not canonical: they leave the per-phase table, the flips and the periodicity
    odd = {n: n % 2 == 0 for n in range(4, 12)}
    task = ProbeTask(SPEC, dataclasses.replace(text_prompt(SPEC, TOK), canonical=odd), max_len=256, tokenizer=TOK)
    rep = task.evaluate(_fixed_top1, progress=False)
    assert rep["headline"]["non_canonical_lengths"] == [5, 7, 9, 11] and rep["headline"]["non_canonical_left_out"]
    assert [p["phase"] for p in rep["phases"]] == [0, 2] and [p["n_lengths"] for p in rep["phases"]] == [2, 2]
    assert rep["headline"]["candidate_flips"] == 0  # even lengths only: the candidates' order never changes
    assert len(rep["lengths"]) == 8 and "left out of the statistics" in probe_summary(rep)[-1]
