"""The position-matched lookup: design moments, padding modes, prompts, scoring with stand-in models, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ckv.config import ConfigError
from ckv.data.lookup import LookupFormat, assemble_lookup, make_lookup_example
from ckv.eval.codec import TokenCodec
from ckv.eval.design import base_offsets, choose_targets, make_design, slot_pads
from ckv.eval.lookup import LookupSpec, LookupTask, lookup_summary
from ckv.eval.stats import StatsOptions
from ckv.eval.vocab import VocabSpec, build_codec

from .helpers import ReadingOracle

FAST = StatsOptions(n_bootstrap=100, n_permutations=100)
# keys 10..39, values 50..89, pad 1, separator 2, bos 3 in a 100-id vocabulary
CODEC = TokenCodec(key_ids=tuple(range(10, 40)), value_ids=tuple(range(50, 90)), pad_id=1, prefix=[3], separator=[2])


def _task(**kw) -> LookupTask:
    spec = dict(n_records=12, n_demos=3, n_base=16, modulus=4, stride=4)
    spec.update(kw)
    return LookupTask(LookupSpec(**spec), CODEC, max_len=512)


def _moments_by_residue(positions: np.ndarray, modulus: int) -> tuple[set, set]:
    """Exact (integer) sums and sums of squares of the positions of each residue group."""
    res = positions % modulus
    sums = {int(positions[res == r].sum()) for r in range(modulus)}
    squares = {int((positions[res == r] ** 2).sum()) for r in range(modulus)}
    return sums, squares


@pytest.mark.parametrize(
    "modulus,n_records,record_len", [(24, 64, 2), (24, 16, 2), (8, 16, 2), (4, 8, 4), (6, 10, 2), (12, 5, 1)]
)
def test_paired_design_equalises_mean_and_variance(modulus: int, n_records: int, record_len: int) -> None:
    design = make_design(modulus, n_records, record_len, prefix_len=1)
    offsets = base_offsets(modulus * modulus, design)
    t, a = choose_targets(offsets, design, np.random.default_rng(0))
    assert np.all((0 <= t) & (t < n_records)) and np.all((0 <= a) & (a <= design.max_base_pad))
    np.testing.assert_array_equal(t * record_len + a, offsets)
    positions = (1 + offsets)[:, None] + np.arange(modulus)[None, :]  # every base example at every shift
    sums, squares = _moments_by_residue(positions.ravel(), modulus)
    assert len(sums) == 1 and len(squares) == 1  # equal counts, so equal mean and variance
    # a prefix of the schedule that is a multiple of the modulus already matches the means
    sums, _ = _moments_by_residue(positions[:modulus].ravel(), modulus)
    assert len(sums) == 1


@pytest.mark.parametrize("padding", ["prefix", "in_sequence"])
@pytest.mark.parametrize("fixed_query", [True, False])
def test_task_groups_have_equal_moments_and_query_position(padding: str, fixed_query: bool) -> None:
    task = _task(padding=padding, fixed_query=fixed_query)
    tab = task.table
    # the recorded target position is where the target record's key really is
    for i in range(0, len(task.prompts), 7):
        assert task.prompts[i][tab["target_position"][i]] == CODEC.key_ids[tab["key"][i]]
    moments = task.position_moments()
    assert len({m["n"] for m in moments}) == 1 and moments[0]["n"] == 16
    assert len({m["mean"] for m in moments}) == 1 and len({m["var"] for m in moments}) == 1
    if fixed_query:
        assert len(set(tab["query_position"].tolist())) == 1
        assert len({len(p) for p in task.prompts}) == 1
    # within a base example the shift moves the target by exactly k
    for b in range(task.n_base):
        sel = tab["base"] == b
        np.testing.assert_array_equal(tab["target_position"][sel] - tab["target_position"][sel][0], np.arange(4))
        assert len(set(tab["key"][sel].tolist())) == 1 and len(set(tab["value"][sel].tolist())) == 1


def _record_positions(prompt: np.ndarray, keys: list[int]) -> np.ndarray:
    return np.array([int(np.flatnonzero(prompt == CODEC.key_ids[k])[0]) for k in keys])


def test_prefix_padding_shifts_every_record_by_the_same_amount() -> None:
    keys, values = np.arange(10), np.arange(10) + 5
    queried = np.array([1, 2, 4])
    rng = np.random.default_rng(0)
    base = assemble_lookup(CODEC, keys, values, slot_pads(4, 2, 9, 10, "prefix", rng), queried, rng)
    for k in range(1, 8):
        shifted = assemble_lookup(CODEC, keys, values, slot_pads(4, 2 + k, 9 - k, 10, "prefix", rng), queried, rng)
        np.testing.assert_array_equal(shifted.record_starts - base.record_starts, np.full(10, k))
        np.testing.assert_array_equal(
            _record_positions(shifted.prompt, list(keys)) - base.record_starts, np.full(10, k)
        )
        assert len(shifted.prompt) == len(base.prompt)  # query position fixed


def test_in_sequence_padding_moves_target_exactly_and_distractors_variably() -> None:
    keys, values = np.arange(10), np.arange(10) + 5
    rng = np.random.default_rng(0)
    moved = []
    for k in range(8):
        pads = slot_pads(6, 3 + k, 12 - k, 10, "in_sequence", rng)
        assert pads[:7].sum() == 3 + k and pads[7:].sum() == 12 - k
        p = assemble_lookup(CODEC, keys, values, pads, np.array([6]), rng)
        moved.append(p.record_starts)
    moved = np.array(moved) - moved[0]
    np.testing.assert_array_equal(moved[:, 6], np.arange(8))
    assert np.any(moved[:, :6] != np.arange(8)[:, None])  # records before the target do not move in lockstep


def test_prompt_is_the_training_example_up_to_the_scored_answer() -> None:
    fmt = LookupFormat(record="kkvv", n_keys=20, n_values=20, n_filler=1)
    keys, values = np.array([3, 7, 1, 9]), np.array([0, 5, 5, 2])
    fillers, queried = np.array([0, 2, 1, 3]), np.array([2, 0, 1])
    ex = make_lookup_example(
        fmt,
        np.random.default_rng(0),
        4,
        3,
        prefix_pad=5,
        keys=keys,
        values=values,
        fillers=fillers,
        query_records=queried,
    )
    # bos, 5 pads, 4 records and their fillers, sep sep, two answered queries, the last query
    n_prompt = 1 + 5 + 4 * fmt.record_len + fillers.sum() + 2 + 2 * (fmt.query_len + fmt.answer_len) + fmt.query_len
    np.testing.assert_array_equal(ex.prompt, ex.tokens[:n_prompt])
    assert ex.prompt[-fmt.query_len :].tolist() == fmt.query_tokens(7)  # the last query asks record 1 (key 7)
    assert ex.answer_id == fmt.answer_tokens(5)[0] == ex.tokens[n_prompt]


@pytest.mark.parametrize("padding", ["prefix", "in_sequence"])
def test_always_correct_model_scores_one_in_every_group(padding: str) -> None:
    task = _task(padding=padding)
    out = task.evaluate(ReadingOracle(100), batch_size=16, progress=False)
    assert out.correct.all()
    rep = task.report(out, FAST)
    assert [g["accuracy"] for g in rep["residue"]["groups"]] == [1.0] * 4
    assert [g["accuracy"] for g in rep["phase"]["groups"]] == [1.0] * 4
    assert rep["headline"]["phase_gap"] == 0.0 and rep["headline"]["mean"] == 1.0


def test_format_codec_with_kv_records_and_oracle() -> None:
    fmt = LookupFormat(record="kv", n_keys=32, n_values=32, n_filler=2)
    task = LookupTask(LookupSpec(n_records=20, n_demos=4, n_base=64, modulus=8, stride=4), fmt, max_len=256)
    out = task.evaluate(ReadingOracle(fmt.vocab_size), progress=False)
    assert out.correct.mean() == 1.0


def test_phase_sensitive_model_shows_its_weak_phase() -> None:
    task = _task(modulus=8, n_base=64, stride=4)
    out = task.evaluate(ReadingOracle(100, wrong=lambda pos: pos % 4 == 3), progress=False)
    rep = task.report(out, FAST)
    assert [g["accuracy"] for g in rep["phase"]["groups"]] == [1.0, 1.0, 1.0, 0.0]
    assert rep["headline"]["phase_gap"] == 1.0 and rep["headline"]["worst_phase"] == 3
    assert rep["headline"]["phase_p_value"] < 0.05 and rep["headline"]["phase_noise_floor"] < 0.5
    assert rep["residue"]["periodicity"]["score"] == pytest.approx(1.0)
    assert rep["headline"]["mean"] == pytest.approx(0.75)


def test_limit_keeps_the_same_first_examples() -> None:
    full, short = (
        _task(n_base=16),
        LookupTask(LookupSpec(n_records=12, n_demos=3, n_base=16, modulus=4, stride=4), CODEC, max_len=512, limit=5),
    )
    assert short.n_base == 5 and len(short.prompts) == 20
    for a, b in zip(short.prompts, full.prompts):
        np.testing.assert_array_equal(a, b)


def test_stride_resolution() -> None:
    assert _task(stride=None).stride is None  # no model stride and none asked: no phase groups (never the modulus)
    assert _task(stride=2).stride == 2
    assert (
        LookupTask(LookupSpec(n_records=12, n_demos=3, n_base=8, modulus=8), CODEC, max_len=512, model_stride=2).stride
        == 2
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(modulus=4, stride=8), "smaller than the stride"),
        (dict(modulus=6, stride=4), "not a multiple of the stride"),
        (dict(n_records=31), "exceeds the 30 available keys"),
        (dict(n_demos=12), "n_demos=12"),
    ],
)
def test_bad_settings_are_clear_errors(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _task(**kw)


def test_more_records_than_fit_the_context() -> None:
    with pytest.raises(ConfigError, match="model's context is 40"):
        LookupTask(LookupSpec(n_records=20, n_demos=3, n_base=4, modulus=4), CODEC, max_len=40)
    for padding, fixed in (("prefix", True), ("in_sequence", True), ("prefix", False)):
        spec = LookupSpec(n_records=12, n_demos=3, n_base=16, modulus=4, padding=padding, fixed_query=fixed)
        longest = max(len(p) for p in LookupTask(spec, CODEC, max_len=512).prompts)
        LookupTask(spec, CODEC, max_len=longest)  # the check is exact: the longest prompt just fits
        if fixed:
            with pytest.raises(ConfigError, match="context"):
                LookupTask(spec, CODEC, max_len=longest - 1)


def test_vocabulary_errors() -> None:
    with pytest.raises(ConfigError, match="empty vocabulary"):
        build_codec(
            VocabSpec(source="ids", keys=[10, 10], values=[20, 30], pad=1),
            vocab_size=100,
            tokenizer=None,
            run_format=None,
        )
    with pytest.raises(ConfigError, match="is empty"):
        VocabSpec(source="words", keys=[], values=["a"], pad="x")
    with pytest.raises(ConfigError, match="share token ids"):
        build_codec(
            VocabSpec(source="ids", keys=[10, 30], values=[20, 40], pad=1),
            vocab_size=100,
            tokenizer=None,
            run_format=None,
        )
    with pytest.raises(ConfigError, match=r"pad/separator/bos ids \[12\] are also keys"):
        build_codec(
            VocabSpec(source="ids", keys=[10, 30], values=[40, 60], pad=12),
            vocab_size=100,
            tokenizer=None,
            run_format=None,
        )
    with pytest.raises(ConfigError, match="does not fit"):
        build_codec(
            VocabSpec(source="ids", keys=[10, 30], values=[90, 140], pad=1),
            vocab_size=100,
            tokenizer=None,
            run_format=None,
        )
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        build_codec(
            VocabSpec(source="words", keys=["a"], values=["b"], pad="x"),
            vocab_size=100,
            tokenizer=None,
            run_format=None,
        )
    with pytest.raises(ConfigError, match="needs a lookup layout"):
        build_codec(VocabSpec(), vocab_size=100, tokenizer=None, run_format=None)
    with pytest.raises(ConfigError, match="does not match"):
        build_codec(VocabSpec(), vocab_size=50, tokenizer=None, run_format=LookupFormat(n_keys=40, n_values=40))


def test_layout_without_filler_needs_unfixed_query() -> None:
    codec = LookupFormat(record="split", n_keys=16, n_values=16, n_filler=0)
    with pytest.raises(ConfigError, match="no filler ids"):
        LookupTask(LookupSpec(n_records=16, n_demos=3, n_base=4, modulus=4), codec, max_len=256)
    task = LookupTask(LookupSpec(n_records=16, n_demos=3, n_base=4, modulus=4, fixed_query=False), codec, max_len=256)
    assert len({len(p) for p in task.prompts}) > 1  # the query moves with the shift
    assert len({m["mean"] for m in task.position_moments()}) == 1


class _WordTokenizer:
    """Id i decodes to WORDS[i]; a text encodes to the ids of its whitespace-kept pieces (or the unknown id 0)."""

    WORDS = ["<unk>", "\n", " a", " cat", " dog", "!", " owl", " 7", " ox", "ab", " bee", " yak", " Emu"]
    bos_id, unk_id = None, 0

    def encode(self, text: str) -> list[int]:
        return [self.WORDS.index(text)] if text in self.WORDS else [0, 0]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.WORDS[i] for i in ids)


def test_tokenizer_vocabulary_draws_single_token_words_and_auto_prefers_the_run_layout() -> None:
    tok, n = _WordTokenizer(), len(_WordTokenizer.WORDS)
    spec = VocabSpec(source="tokenizer", n_tokens=3, pad="\n", separator="\n")
    codec = build_codec(spec, vocab_size=n, tokenizer=tok, run_format=None)
    words = [" cat", " dog", " owl", " ox", " bee", " yak"]  # " a" (one letter), " 7", "ab" (no prefix) are skipped
    assert codec.labels["keys"] == words[0::2] and codec.labels["values"] == words[1::2]
    assert codec.key_ids == tuple(tok.WORDS.index(w) for w in words[0::2]) and codec.pad_id == 1
    with pytest.raises(ConfigError, match="only 7 single-token words"):
        build_codec(dataclasses.replace(spec, n_tokens=4), vocab_size=n, tokenizer=tok, run_format=None)
    auto = dataclasses.replace(spec, source="auto")
    drawn = build_codec(auto, vocab_size=n, tokenizer=tok, run_format=None)
    assert drawn.labels["drawn_from"] == "the model's tokenizer"
    fmt = LookupFormat(n_keys=4, n_values=4)
    assert build_codec(auto, vocab_size=100, tokenizer=tok, run_format=fmt) is fmt


def test_the_summary_reads_the_phase_gap_against_its_noise_floor_and_prints_further_gap_fields() -> None:
    codec = LookupFormat(record="kv", n_keys=64, n_values=64)
    task = LookupTask(LookupSpec(n_records=16, n_demos=2, n_base=16, modulus=8, stride=4), codec, max_len=512)
    outcome = task.evaluate(ReadingOracle(codec.vocab_size, wrong=lambda pos: pos % 4 == 1), progress=False)
    report = task.report(outcome, StatsOptions(n_bootstrap=100, n_permutations=100))
    report["phase"]["gap"]["equivalence"] = "not flat: the interval's upper end 100.0 pp exceeds the 5 pp margin"
    lines = lookup_summary(report)
    assert lines[0].startswith("mean accuracy 75.0% [") and lines[1].endswith("0: 100.0  1: 0.0  2: 100.0  3: 100.0")
    assert lines[2].startswith("phase gap 100.0 pp [100.0, 100.0], noise floor ") and lines[2].endswith(
        ": above the noise floor"
    )
    assert lines[3].startswith("worst phase 1: 0.0% [0.0, 0.0]")
    assert lines[4].startswith("phase flatness: gap (one-sided 95% upper bound 100.0 pp vs margin 5.0 pp)")
    assert lines[5] == "phase gap equivalence: not flat: the interval's upper end 100.0 pp exceeds the 5 pp margin"
    assert lines[6].startswith("residue (mod 8) gap 100.0 pp")
