"""``data.kind: pretrain``: corpus text mixed with retrieval blocks in templates the lookup evaluation never uses
(ckv.data.recall). The held-out proof: the evaluation's own prompts, built by ckv.eval for the pretrained model's
tokenizer, hold a layout that no training sequence holds."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ckv.config import ConfigError
from ckv.data import DataConfig, budget_note, build_batches
from ckv.data.recall import MAX_RECORD_RUN, longest_record_run
from ckv.data.stream import IGNORE
from ckv.data.tokenizer import TokenizersTokenizer, single_token_words
from ckv.eval.lookup import LookupSpec, LookupTask, codec_for
from ckv.eval.models import ModelFacts

SEQ_LEN = 128
N_SEQUENCES = 1200  # training sequences scanned for the evaluation's layout (300 with a retrieval block)
TEXT = {"vocab_size": 1024}  # the shipped corpus on a 1,024-id BPE (the one the cpu_smoke fixture trains too)


@pytest.fixture(scope="module")
def eval_words(cache_dir: str) -> dict[str, list[str]]:
    """20 keys and 20 values for the evaluation: single-token words of the 1,024-id BPE (conf/data/pretrain.yaml's
    animals and names are words of its 4,096-id BPE), taken from the middle of the word list."""
    text = build_batches(
        DataConfig.from_dict({"kind": "text", "text": TEXT}), batch_size=1, seed=0, cache_dir=cache_dir
    )
    tok = TokenizersTokenizer(text.source.tok)
    words = [tok.decode([i])[1:] for i in single_token_words(tok, text.vocab_size, " ")][40:80]
    return {"eval_keys": words[0::2], "eval_values": words[1::2]}


def pretrain_config(eval_words: dict[str, list[str]], **changes: object) -> DataConfig:
    """conf/data/pretrain.yaml's settings on the 1,024-id BPE with ``eval_words``."""
    d: dict = {"kind": "pretrain", "seq_len": SEQ_LEN, "text": TEXT, "recall": dict(eval_words)}
    for key, value in changes.items():
        part, _, name = key.partition("__")
        if name:
            d[part] = {**d.get(part, {}), name: value}
        else:
            d[part] = value
    return DataConfig.from_dict(d)


@pytest.fixture(scope="module")
def stream(cache_dir: str, eval_words: dict[str, list[str]]):
    return build_batches(pretrain_config(eval_words), batch_size=8, seed=0, cache_dir=cache_dir)


def eval_prompts(stream, eval_words: dict[str, list[str]], padding: str) -> tuple[list[np.ndarray], object]:
    """The lookup evaluation's prompts for a run of this data (task=lookup at make pretrain's settings: 16 records,
    8 demonstrations, modulus 24, vocabulary auto), one per residue group of two base examples, and its codec."""
    facts = ModelFacts(
        name="pretrain",
        vocab_size=stream.vocab_size,
        max_len=SEQ_LEN,
        tokenizer=TokenizersTokenizer(stream.source.text.tok),
        eval_words={
            "keys": eval_words["eval_keys"],
            "values": eval_words["eval_values"],
            "pad": ".",
            "bos": stream.source.text.eod_id,
        },
    )
    spec = LookupSpec(n_records=16, n_demos=8, n_base=2, modulus=24, padding=padding)
    codec = codec_for(spec.vocab, facts)
    return LookupTask(spec, codec, max_len=SEQ_LEN).prompts, codec


def training_sequences(stream, n: int) -> list[np.ndarray]:
    source = stream.source
    state = source.state_dict()
    out = []
    for _ in range(n):
        inputs, labels = source.next()
        out.append(np.append(inputs, labels[-1:]))  # the sequence's seq_len + 1 tokens
    source.load_state_dict(state)
    return out


LOOSE = {"recall__bare_share": 0.7, "recall__pool_eval_words": True}  # the evaluation's words in lists, bare records


@pytest.fixture(scope="module")
def loose_stream(cache_dir: str, eval_words: dict[str, list[str]]):
    return build_batches(pretrain_config(eval_words, **LOOSE), batch_size=8, seed=0, cache_dir=cache_dir)


@pytest.mark.parametrize("padding", ["prefix", "in_sequence"])
def test_no_training_sequence_holds_an_evaluation_layout(stream, loose_stream, eval_words, padding: str) -> None:
    """Default settings, and lists with bare records and the evaluation's words as any other word: no training
    sequence holds 8 records back to back, every evaluation prompt does."""
    prompts, codec = eval_prompts(stream, eval_words, padding)
    keys, values = np.asarray(codec.key_ids), np.asarray(codec.value_ids)
    vocab = stream.source.lookup.vocab
    # what the data layer holds out is what the evaluation picks for this tokenizer
    assert vocab.eval_keys.tolist() == list(codec.key_ids) and vocab.eval_values.tolist() == list(codec.value_ids)
    assert [vocab.eval_structural] == codec.separator and vocab.eval_structural == codec.pad_id
    assert codec.prefix == [stream.source.text.eod_id]  # a prompt opens as a document does in training
    # every evaluation prompt holds its 8 demonstrations and the query back to back: a run of >= 8 records
    assert min(longest_record_run(p, keys, values) for p in prompts) >= 8
    seqs = training_sequences(stream, N_SEQUENCES)
    assert max(longest_record_run(s, keys, values) for s in seqs) < 8
    # the evaluation's pad/separator never sits inside a retrieval block; list keys and values are not its words
    assert not set(vocab.delimiters + vocab.separators) & {codec.pad_id, *codec.key_ids, *codec.value_ids}
    assert not (set(vocab.keys.tolist()) | set(vocab.values.tolist())) & {*codec.key_ids, *codec.value_ids}
    # bare records and pooled words: runs of up to MAX_RECORD_RUN records inside a block (test below), the
    # evaluation's words among the pool's, and still no run of 8 of them
    loose = loose_stream.source.lookup
    seqs = training_sequences(loose_stream, N_SEQUENCES)
    assert max(longest_record_run(s, keys, values) for s in seqs) < 8
    pooled = set(loose.vocab.keys.tolist()) | set(loose.vocab.values.tolist())
    assert {*codec.key_ids, *codec.value_ids} <= pooled
    assert not set(loose.vocab.delimiters + loose.vocab.separators) & {codec.pad_id, *codec.key_ids, *codec.value_ids}


def test_bare_records_keep_their_lists_and_answers(loose_stream) -> None:
    """``bare_share``: records (asked ones too) lose their delimiter, each on its own, never more than
    ``MAX_RECORD_RUN`` back to back; the list still asks its own records and its answers are their values."""
    recall = loose_stream.source.lookup
    keys, values = set(recall.vocab.keys.tolist()), set(recall.vocab.values.tolist())
    seps, bare, total = set(recall.vocab.separators), 0, 0
    for g in range(100):
        kind, block, answers = recall.block(np.random.default_rng([5, g]))
        if kind != "list":
            continue
        cut = next(i for i, t in enumerate(block) if t in seps)
        parsed = []
        for part in (block[:cut], block[cut + 1 :]):
            i, rows = 0, []
            while i < len(part):  # k v [d]: a key, its value, then a delimiter unless the next key follows
                assert part[i] in keys and part[i + 1] in values
                has_delim = i + 2 < len(part) and part[i + 2] not in keys
                rows.append((int(part[i]), int(part[i + 1]), has_delim))
                i += 3 if has_delim else 2
            parsed.append(rows)
        records, queries = parsed
        given = {k: v for k, v, _ in records}
        assert len(given) == len(records) and all(given[k] == v for k, v, _ in queries)
        assert np.array_equal(block[answers], [v for _, v, _ in queries])
        for rows in parsed:
            run = 0
            assert rows[-1][2]  # a part's last record keeps its delimiter: a run never reaches into the text
            for *_, has_delim in rows:
                run = 0 if has_delim else run + 1
                assert run <= MAX_RECORD_RUN - 1
            bare += sum(not d for *_, d in rows)
            total += len(rows) - 1
    assert 0.45 < bare / total < 0.7  # 0.7 drawn, fewer after the cap on runs
    with pytest.raises(ConfigError, match=re.escape("data.recall.bare_share=-0.1")):
        pretrain_config({"eval_keys": ["a"], "eval_values": ["b"]}, recall__bare_share=-0.1)


def test_shared_word_roles_let_every_word_be_a_key_and_a_value(cache_dir: str, eval_words, stream) -> None:
    """``word_roles: shared``: every pool word is drawn as a key and as a value (under ``split`` each is only one of
    the two, so half of the evaluation's values were never a list's value); a list's values are never its own keys;
    the lists still ask their own records, and no sequence holds an evaluation layout (8 records back to back)."""
    changes = {"recall__repeat_share": 0.0, "recall__pool_eval_words": True, "recall__bare_share": 0.5}
    shared = build_batches(
        pretrain_config(eval_words, **changes, recall__word_roles="shared"), batch_size=1, seed=0, cache_dir=cache_dir
    ).source.lookup
    split = build_batches(pretrain_config(eval_words, **changes), batch_size=1, seed=0, cache_dir=cache_dir)
    split = split.source.lookup
    assert not set(split.vocab.keys.tolist()) & set(split.vocab.values.tolist())
    assert np.array_equal(shared.vocab.keys, shared.vocab.values)
    assert set(shared.vocab.keys.tolist()) == set(split.vocab.keys.tolist()) | set(split.vocab.values.tolist())
    seps, as_key, as_value = set(shared.vocab.separators), set(), set()
    for g in range(400):
        _, block, answers = shared.block(np.random.default_rng([11, g]))  # repeat_share 0: a list
        cut = next(i for i, t in enumerate(block) if t in seps)
        parsed = []
        for part in (block[:cut], block[cut + 1 :]):
            i, rows = 0, []
            while i < len(part):  # k v [d]: delimiters are punctuation, never words
                has_delim = i + 2 < len(part) and part[i + 2] in shared.vocab.delimiters
                rows.append((int(part[i]), int(part[i + 1])))
                i += 3 if has_delim else 2
            parsed.append(rows)
        records, queries = parsed
        given = dict(records)
        assert len(given) == len(records) and not set(given) & set(given.values())
        assert all(given[k] == v for k, v in queries) and np.array_equal(block[answers], [v for _, v in queries])
        as_key |= set(given)
        as_value |= set(given.values())
    evaluation = set(shared.vocab.eval_keys.tolist()) | set(shared.vocab.eval_values.tolist())
    assert evaluation <= as_key and evaluation <= as_value
    keys, values = shared.vocab.eval_keys, shared.vocab.eval_values
    assert max(longest_record_run(np.append(*shared.sample(g)), keys, values) for g in range(N_SEQUENCES)) < 8
    note = budget_note(pretrain_config(eval_words, **changes, recall__word_roles="shared"), stream, 8)
    assert "words (the evaluation's among them: data.recall.pool_eval_words), each a key or a value" in note
    with pytest.raises(ConfigError, match=re.escape("data.recall.word_roles='both' is not allowed")):
        pretrain_config(eval_words, recall__word_roles="both")


def test_eval_word_roles_give_the_evaluations_words_its_roles(cache_dir: str, eval_words, stream) -> None:
    """``word_roles: eval``: the evaluation's keys are only list keys and its values only list values (the roles of
    its lookup); every other word alternates as under ``split``; it needs ``pool_eval_words`` (one line)."""
    changes = {"recall__repeat_share": 0.0, "recall__pool_eval_words": True}
    roles = build_batches(
        pretrain_config(eval_words, **changes, recall__word_roles="eval"), batch_size=1, seed=0, cache_dir=cache_dir
    ).source.lookup
    split = build_batches(pretrain_config(eval_words, **changes), batch_size=1, seed=0, cache_dir=cache_dir)
    split = split.source.lookup
    v = roles.vocab
    ek, ev = set(v.eval_keys.tolist()), set(v.eval_values.tolist())
    keys, values = set(v.keys.tolist()), set(v.values.tolist())
    assert ek <= keys and not ek & values and ev <= values and not ev & keys
    assert np.all(np.diff(v.keys) > 0) and np.all(np.diff(v.values) > 0)  # id order
    assert keys | values == set(split.vocab.keys.tolist()) | set(split.vocab.values.tolist())
    as_value = set()
    for g in range(400):
        _, block, answers = roles.block(np.random.default_rng([13, g]))
        as_value |= set(block[answers].tolist())
    assert ev <= as_value and not ek & as_value
    note = budget_note(pretrain_config(eval_words, **changes, recall__word_roles="eval"), stream, 8)
    assert "each a key or a value" not in note and note.endswith(
        "words (the evaluation's among them: data.recall.pool_eval_words), the evaluation's in its roles "
        "(data.recall.word_roles))"
    )
    with pytest.raises(ConfigError, match="^" + re.escape("data.recall.word_roles=eval gives the evaluation's")):
        pretrain_config(eval_words, recall__word_roles="eval")


def test_a_list_gap_puts_corpus_text_between_the_records_and_the_questions(cache_dir: str, eval_words, stream) -> None:
    """``list_gap``: that many tokens of corpus text between a list's records and its separator; the list still asks
    its own records; ``[0, 0]`` leaves every draw as it was; the longest block counts the gap."""
    changes = {"recall__repeat_share": 0.0}
    gapped = build_batches(
        pretrain_config(eval_words, **changes, recall__list_gap=[2, 5]), batch_size=1, seed=0, cache_dir=cache_dir
    ).source.lookup
    plain = build_batches(pretrain_config(eval_words, **changes), batch_size=1, seed=0, cache_dir=cache_dir)
    plain = plain.source.lookup
    seps, delims, gaps = set(gapped.vocab.separators), set(gapped.vocab.delimiters), []
    for g in range(60):
        _, block, answers = gapped.block(np.random.default_rng([17, g]))
        _, ref, _ = plain.block(np.random.default_rng([17, g]))
        n_records = next(i for i in range(0, len(ref), 3) if ref[i] in seps) // 3  # the plain list's record count
        records = block[: 3 * n_records].reshape(-1, 3)
        cut = len(block) - 1 - 3 * int(answers.sum())  # the separator: the queries follow it, 3 tokens each
        assert block[cut] in seps and set(records[:, 2]) <= delims
        gaps.append(cut - 3 * n_records)
        given = dict(zip(records[:, 0].tolist(), records[:, 1].tolist()))
        queries = block[cut + 1 :].reshape(-1, 3)
        assert all(given[k] == v for k, v in queries[:, :2].tolist())
        assert np.array_equal(block[answers], queries[:, 1])
    assert min(gaps) >= 2 and max(gaps) <= 5 and len(set(gaps)) > 2
    note = budget_note(pretrain_config(eval_words, **changes, recall__list_gap=[2, 5]), stream, 8)
    assert "; 2-5 text tokens between a list's records and its separator" in note
    default = pretrain_config(eval_words, **changes)  # lists only: the longest block is a list
    assert pretrain_config(eval_words, **changes, recall__list_gap=[2, 5]).recall.max_block == (
        default.recall.max_block + 5
    )
    with pytest.raises(ConfigError, match=re.escape("data.seq_len=128 is too short for data.recall")):
        pretrain_config(eval_words, recall__list_gap=[0, 60])


def test_filler_runs_stand_before_the_records_and_in_the_gap(cache_dir: str, eval_words, stream) -> None:
    """``filler_share``: that share of lists have a run of one filler token (of ``fillers``) before their records
    and another in place of the gap's text; the lists still ask their own records, and no sequence holds an
    evaluation layout; a filler that is the evaluation's pad, or runs without a gap, are one line each."""
    changes = {"recall__repeat_share": 0.0, "recall__list_gap": [1, 3], "recall__filler_share": 0.5}
    recall = build_batches(pretrain_config(eval_words, **changes), batch_size=1, seed=0, cache_dir=cache_dir)
    recall = recall.source.lookup
    fillers, seps, runs = set(recall.vocab.fillers), set(recall.vocab.separators), 0
    for g in range(80):
        _, block, answers = recall.block(np.random.default_rng([19, g]))
        cut = len(block) - 1 - 3 * int(answers.sum())  # the separator: the queries follow it, 3 tokens each
        assert block[cut] in seps
        if block[0] not in fillers:  # corpus text in the gap
            continue
        runs += 1  # a run, the records, a run of the same filler, the separator
        f = block[0]
        lead = int(np.argmax(block != f))
        tail = cut - int(np.argmax(block[:cut][::-1] != f))
        assert 1 <= lead <= 3 and 1 <= cut - tail <= 3 and np.all(block[tail:cut] == f)
        records = block[lead:tail].reshape(-1, 3)
        given = dict(zip(records[:, 0].tolist(), records[:, 1].tolist()))
        queries = block[cut + 1 :].reshape(-1, 3)
        assert all(given[k] == v for k, v in queries[:, :2].tolist())
    assert 25 < runs < 55
    keys, values = recall.vocab.eval_keys, recall.vocab.eval_values
    assert max(longest_record_run(np.append(*recall.sample(g)), keys, values) for g in range(300)) < 8
    note = budget_note(pretrain_config(eval_words, **changes), stream, 8)
    assert "(50% of the lists: a run of one filler there and before the records)" in note
    with pytest.raises(ConfigError, match=re.escape("data.recall.fillers holds '.', the lookup evaluation's pad")):
        build_batches(
            pretrain_config(eval_words, **changes, recall__fillers=["."]), batch_size=1, seed=0, cache_dir=cache_dir
        )
    with pytest.raises(ConfigError, match=re.escape("data.recall.filler_share=0.5 sets runs of list_gap tokens")):
        pretrain_config(eval_words, recall__filler_share=0.5)


def test_bare_records_start_at_bare_from(cache_dir: str, eval_words, stream) -> None:
    """``bare_from``: retrieval sequence ``g`` (counted over all ranks) has bare records only from ``bare_from`` on;
    before it, the draws of a run without them; the log line says where they start."""
    changes = {"recall__repeat_share": 0.0, "recall__bare_share": 0.7}
    cfg = pretrain_config(eval_words, **changes, recall__bare_from=20)
    late = build_batches(cfg, batch_size=1, seed=0, cache_dir=cache_dir).source.lookup
    never = build_batches(
        pretrain_config(eval_words, recall__repeat_share=0.0), batch_size=1, seed=0, cache_dir=cache_dir
    )
    never = never.source.lookup
    runs = [longest_record_run(np.append(*late.sample(g)), late.vocab.keys, late.vocab.values) for g in range(40)]
    for g in range(20):
        assert all(np.array_equal(a, b) for a, b in zip(late.sample(g), never.sample(g)))
    assert max(runs[20:]) > 1 and max(runs) <= MAX_RECORD_RUN
    note = budget_note(cfg, stream, 8)
    assert note.endswith("; 70% of the records bare (data.recall.bare_share) from retrieval sequence 20 on)")
    with pytest.raises(ConfigError, match=re.escape("data.recall.bare_from=-1")):
        pretrain_config(eval_words, recall__bare_from=-1)


def test_lists_ask_their_own_records_and_shares_hold(stream) -> None:
    source = stream.source
    recall, vocab = source.lookup, source.lookup.vocab
    delims, seps = set(vocab.delimiters), set(vocab.separators)
    lists = 0
    for g in range(200):
        kind, block, _ = recall.block(np.random.default_rng([7, g]))
        if kind == "repeat":  # a passage, a gap, the passage again
            n = next(n for n in range(len(block) // 2, 0, -1) if np.array_equal(block[:n], block[-n:]))
            assert n >= recall.cfg.repeat_len[0]
            continue
        lists += 1
        cut = next(i for i in range(0, len(block), 3) if block[i] in seps)  # keys are words, never separators
        records, queries = block[:cut].reshape(-1, 3), block[cut + 1 :].reshape(-1, 3)
        assert set(records[:, 2]) <= delims and len(set(records[:, 2])) == 1
        assert len(set(records[:, 0])) == len(records)  # distinct keys
        assert set(records[:, 0]) <= set(vocab.keys.tolist()) and set(records[:, 1]) <= set(vocab.values.tolist())
        answer = dict(zip(records[:, 0].tolist(), records[:, 1].tolist()))
        assert all(answer[k] == v for k, v in queries[:, :2].tolist())
        assert len(set(queries[:, 0])) == len(queries) <= len(records)
    assert 100 < lists < 180  # repeat_share 0.3 of 200 blocks
    # the recall share: exactly floor(n * share) of the first n rows
    rows = [source.is_lookup(r) for r in range(400)]
    assert sum(rows) == 100


def test_word_fill_makes_a_random_word_repeat_sequence_all_words(cache_dir: str, eval_words) -> None:
    """``word_fill``: a sequence whose passage is random words holds nothing else (no corpus text around it, none in
    its gap); without it the same draws keep their text; corpus passages keep their text either way."""
    changes = {"recall__repeat_share": 1.0, "recall__word_repeat_share": 0.5, "recall__repeat_gap": [4, 16]}
    filled = build_batches(
        pretrain_config(eval_words, **changes, recall__word_fill=True), batch_size=1, seed=0, cache_dir=cache_dir
    ).source.lookup
    plain = build_batches(pretrain_config(eval_words, **changes), batch_size=1, seed=0, cache_dir=cache_dir)
    plain = plain.source.lookup
    words = set(filled.pool.words.tolist())
    kinds = []
    for g in range(60):
        kind, block, _ = filled.block(np.random.default_rng([5, g]))
        plain_kind, plain_block, _ = plain.block(np.random.default_rng([5, g]))
        kinds.append(kind)
        if kind == "word_repeat":
            n = filled.cfg.repeat_len[0]  # the same passage (its first n tokens), a gap of random words instead of text
            assert plain_kind == "repeat" and set(block.tolist()) <= words and len(block) == len(plain_block)
            assert np.array_equal(block[:n], plain_block[:n]) and np.array_equal(block[-n:], plain_block[-n:])
        else:
            assert kind == plain_kind == "repeat" and np.array_equal(block, plain_block)
    assert 15 < kinds.count("word_repeat") < 45  # word_repeat_share 0.5 of 60
    # whole sequences: all words (the passage twice among them) or corpus text around a corpus passage
    all_words = 0
    for g in range(60):
        inputs, labels = filled.sample(g)
        sequence = np.append(inputs, labels[-1:])
        if set(sequence.tolist()) <= words:
            all_words += 1
            assert any(
                np.array_equal(sequence[i : i + n], sequence[j : j + n])
                for n in [filled.cfg.repeat_len[0]]
                for i in range(len(sequence) - n)
                for j in range(i + n, len(sequence) - n + 1)
            )
    assert 15 < all_words < 45


def test_loss_on_answers_scores_the_asked_values_and_the_repeated_passage(cache_dir: str, eval_words) -> None:
    """``loss: answers``: a list sequence's scored labels are its asked records' values, one per query, each the
    value its key was given; a repeat's are the second passage after its first token; every other label ignored.
    ``loss: all`` (the default) scores every label of the same sequence."""
    answers = build_batches(
        pretrain_config(eval_words, recall__loss="answers", recall__repeat_share=0.5),
        batch_size=1,
        seed=0,
        cache_dir=cache_dir,
    ).source.lookup
    every = build_batches(
        pretrain_config(eval_words, recall__repeat_share=0.5), batch_size=1, seed=0, cache_dir=cache_dir
    ).source.lookup
    values = set(answers.vocab.values.tolist())
    kinds = set()
    for g in range(40):
        inputs, labels = answers.sample(g)
        all_inputs, all_labels = every.sample(g)
        assert np.array_equal(inputs, all_inputs) and (all_labels != IGNORE).all()
        scored = np.flatnonzero(labels != IGNORE)
        assert np.array_equal(labels[scored], all_labels[scored]) and len(scored) >= 1
        if set(labels[scored].tolist()) <= values and all(inputs[i] in answers.vocab.keys for i in scored):
            kinds.add("list")  # each scored label is the value after an asked key, which the records gave it
            given = {}
            for i in range(len(inputs) - 2):
                if inputs[i] in answers.vocab.keys and inputs[i + 2] in answers.vocab.delimiters:
                    given.setdefault(int(inputs[i]), int(inputs[i + 1]))
            assert all(given[int(inputs[i])] == labels[i] for i in scored)
            assert len(set(inputs[scored].tolist())) == len(scored)  # distinct queries
        else:
            kinds.add("repeat")  # one contiguous run: the second passage t[a : a + n] after its first token
            assert np.array_equal(scored, np.arange(scored[0], scored[-1] + 1))
            t = np.append(inputs, labels[-1:]) if labels[-1] != IGNORE else np.append(inputs, all_labels[-1:])
            a, n = int(scored[0]), len(scored) + 1
            passage = t[a : a + n]
            assert any(np.array_equal(t[j : j + n], passage) for j in range(a - n + 1))  # it occurred before
    assert kinds == {"list", "repeat"}


def test_word_delimiters_follow_each_record_with_a_random_word(cache_dir: str, eval_words) -> None:
    """``word_delimiter_share``: that share of lists put a random pool word after each record (queries too) in place
    of the list's delimiter; the records, queries and answers are the same draws' otherwise."""
    changes = {"recall__repeat_share": 0.0, "recall__word_delimiter_share": 0.5}
    source = build_batches(pretrain_config(eval_words, **changes), batch_size=1, seed=0, cache_dir=cache_dir)
    recall = source.source.lookup
    delims, words = set(recall.vocab.delimiters), set(recall.pool.words.tolist())
    seps = set(recall.vocab.separators)
    worded = 0
    for g in range(60):
        kind, block, answers = recall.block(np.random.default_rng([3, g]))
        cut = next(i for i in range(0, len(block), 3) if block[i] in seps)
        records, queries = block[:cut].reshape(-1, 3), block[cut + 1 :].reshape(-1, 3)
        after = set(records[:, 2].tolist()) | set(queries[:, 2].tolist())
        if after <= delims:
            assert len(after) == 1  # one delimiter per list
        else:
            worded += 1
            assert after <= words and len(after) > 1  # a word drawn per record
        given = dict(zip(records[:, 0].tolist(), records[:, 1].tolist()))
        assert all(given[k] == v for k, v in queries[:, :2].tolist())
        assert np.array_equal(block[answers], queries[:, 1])
    assert 15 < worded < 45
    with pytest.raises(ConfigError, match=re.escape("data.recall.word_delimiter_share=2")):
        pretrain_config(eval_words, recall__word_delimiter_share=2)


def test_a_warm_up_draws_its_sequences_from_the_first_words_only(cache_dir: str, eval_words, stream) -> None:
    """``warmup_words`` / ``warmup_sequences``: retrieval sequence ``g`` (counted over all ranks) draws from the
    pool's first ``warmup_words`` words while ``g < warmup_sequences``, then from the whole pool; the draws are the
    ones without a warm-up after it (a curriculum over the sequence number: resume and ranks are unchanged)."""
    changes = {"recall__repeat_share": 1.0, "recall__word_repeat_share": 1.0, "recall__word_fill": True}  # all words
    cfg = pretrain_config(eval_words, **changes, recall__warmup_words=40, recall__warmup_sequences=30)
    warm = build_batches(cfg, batch_size=1, seed=0, cache_dir=cache_dir).source.lookup
    cold = build_batches(pretrain_config(eval_words, **changes), batch_size=1, seed=0, cache_dir=cache_dir)
    cold = cold.source.lookup
    first = set(warm.warm_pool.words.tolist())
    assert len(first) == 40 and first < set(warm.pool.words.tolist())
    for g in range(60):
        inputs, labels = warm.sample(g)
        words = set(np.append(inputs, labels[-1:]).tolist())
        assert words <= set(warm.pool.words.tolist())
        if g < 30:
            assert words <= first  # every key, value and random word of the warm-up from its 40 words
        else:
            assert all(np.array_equal(a, b) for a, b in zip((inputs, labels), cold.sample(g)))
    assert all(not set(warm.sample(g)[0].tolist()) <= first for g in range(30, 60))
    note = budget_note(cfg, stream, 8)
    assert note.endswith(", the first 30 from the first 40 only (data.recall.warmup_words))")
    for changes, message in [
        (
            {"recall__warmup_words": 40},
            "data.recall.warmup_words=40 and data.recall.warmup_sequences=0 go together: set both (a warm-up of that "
            "many sequences on that many words) or neither",
        ),
        (
            {"recall__warmup_words": 1, "recall__warmup_sequences": 5},
            "data.recall.warmup_words=1 must be an integer >= 2",
        ),
    ]:
        with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
            pretrain_config(eval_words, **changes)
    with pytest.raises(ConfigError) as err:
        build_batches(
            pretrain_config(eval_words, recall__warmup_words=30, recall__warmup_sequences=5),
            batch_size=1,
            seed=0,
            cache_dir=cache_dir,
        )
    assert str(err.value).startswith("data.recall.warmup_words=30 must lie in [40, ")


def test_resume_gives_the_same_batches(cache_dir: str, eval_words) -> None:
    a = build_batches(pretrain_config(eval_words), batch_size=4, seed=3, cache_dir=cache_dir)
    it = iter(a)
    next(it)
    state = a.state_dict()
    want = next(it)
    b = build_batches(pretrain_config(eval_words), batch_size=4, seed=3, cache_dir=cache_dir)
    b.load_state_dict(state)
    got = next(iter(b))
    assert all(np.array_equal(want[k], got[k]) for k in ("input_ids", "labels"))


def test_budget_note_counts_epochs(stream, eval_words) -> None:
    windows = stream.source.text.per_rank
    note = budget_note(pretrain_config(eval_words), stream, 4 * windows)  # 3 windows' worth of text rows at share 0.75
    assert f"{3 * windows:,} text sequences = 3.00 epochs" in note and f"{windows:,} sequences with a retrieval" in note
    words = len(stream.source.lookup.pool.words)
    assert (
        f"(their text drawn at random offsets of the same split; keys, values and random passages from {words:,} "
        in note
    )
    assert budget_note(DataConfig.from_dict({"kind": "text"}), stream, 10) is None
    # word_fill: the share of sequences with no corpus text is said; the words the blocks draw from are counted
    pool = f"keys, values and random passages from {words:,} words"
    half = pretrain_config(eval_words, recall__word_fill=True, recall__repeat_share=1.0, recall__word_repeat_share=0.5)
    assert "(50% of them random words throughout: data.recall.word_fill; the others' text drawn" in budget_note(
        half, stream, 8
    )
    every = pretrain_config(eval_words, recall__word_fill=True, recall__repeat_share=1.0, recall__word_repeat_share=1.0)
    assert budget_note(every, stream, 8).endswith(f"(random words throughout: data.recall.word_fill; {pool})")
    scored = pretrain_config(eval_words, recall__loss="answers")
    assert budget_note(scored, stream, 8).endswith(
        "(their text drawn at random offsets of the same split; the loss on their blocks' answers only: "
        f"data.recall.loss; {pool})"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"shares": {"text": 0.7, "recall": 0.2}},
            "data.shares (text=0.7, recall=0.2) sum to 0.9; the shares are fractions of the sequences and must sum "
            "to 1",
        ),
        ({"shares": {"text": 1.0}}, "data.shares=['text'] must give a share to each of ['text', 'recall']"),
        (
            {"seq_len": 64},
            "data.seq_len=64 is too short for data.recall: its longest block ends at token 128 (text_before hi 32 "
            "+ 96)",
        ),
        ({"recall__n_records": [0, 4]}, "data.recall.n_records=[0, 4] must draw at least 1"),
        ({"recall__word_pool": 1}, "data.recall.word_pool=1 must be an integer >= 2"),
        ({"recall__loss": "values"}, "data.recall.loss='values' is not allowed; choose one of ['all', 'answers']"),
        (
            {"recall__eval_keys": None},
            "data.kind=pretrain needs data.recall.eval_keys: the words the lookup evaluation asks",
        ),
    ],
)
def test_bad_mixture_is_one_line(eval_words, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        pretrain_config(eval_words, **changes)


@pytest.mark.parametrize(
    ("delimiters", "message"),
    [
        (["."], "data.recall.delimiters holds '.', the lookup evaluation's pad and separator ('.')"),
        ([None], "data.recall.delimiters holds ' {key}', one of the lookup evaluation's key/value words"),
        ([" -->"], "data.recall.delimiters: ' -->' -> "),
    ],
)
def test_evaluation_template_in_the_data_is_refused(cache_dir: str, eval_words, delimiters: list, message: str) -> None:
    key = eval_words["eval_keys"][0]
    delimiters = [d if d is not None else " " + key for d in delimiters]
    cfg = pretrain_config(eval_words, recall__delimiters=delimiters)
    with pytest.raises(ConfigError) as err:
        build_batches(cfg, batch_size=2, seed=0, cache_dir=cache_dir)
    message = message.format(key=key)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_word_pool_too_small_for_a_list_is_one_line(cache_dir: str, eval_words) -> None:
    cfg = pretrain_config(eval_words, recall__word_pool=30)
    with pytest.raises(ConfigError) as err:
        build_batches(cfg, batch_size=2, seed=0, cache_dir=cache_dir)
    assert str(err.value) == (
        "data.recall: data.recall.word_pool=30 leaves 30 single-token words besides the evaluation's; a list needs 40 "
        "(n_records hi 20 keys and as many values): raise data.recall.word_pool or lower data.recall.n_records"
    )
    small = build_batches(pretrain_config(eval_words, recall__word_pool=40), batch_size=2, seed=0, cache_dir=cache_dir)
    vocab = small.source.lookup.vocab
    assert len(vocab.keys) == len(vocab.values) == 20 and len(small.source.lookup.pool.words) == 40


def test_a_corpus_too_small_for_one_sequence_says_so(tmp_path, cache_dir: str, eval_words) -> None:
    (tmp_path / "tiny.txt").write_text("In the beginning God created the heavens and the earth.\n")
    cfg = pretrain_config(eval_words, text={"paths": [str(tmp_path / "tiny.txt")], "vocab_size": 300, "val_every": 2})
    with pytest.raises(Exception) as err:
        build_batches(cfg, batch_size=2, seed=0, cache_dir=cache_dir)
    text = str(err.value)
    assert "not one full window of 129 tokens" in text and "lower data.seq_len" in text
