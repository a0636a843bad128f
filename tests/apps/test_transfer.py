"""``python -m ckv.apps.transfer``: the ladder from a pretrained run's lists to the evaluation's layout. Its lists
and scoring are checked with retrievers whose answers are known: an exact induction retriever answers every layout,
one that only retrieves after a delimiter or separator answers the delimited layouts and, in the bare ones, only
the first query (the one right after the separator)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ckv.apps import transfer
from ckv.data.recall import RecallVocab, WordPool

VOCAB = 64
DELIM, SEP = 1, 2
RECORDS, QUERIES = 6, 4


def recall_like() -> SimpleNamespace:
    """The two things the ladder reads from a run's ``RecallSequences``: its vocabulary and its word pool (the
    evaluation's words among the pool's, as with ``data.recall.pool_eval_words``)."""
    vocab = RecallVocab(
        keys=np.arange(10, 30, 2),
        values=np.arange(11, 31, 2),
        delimiters=(DELIM, 3),
        separators=(SEP, 4),
        fillers=(6,),
        eval_keys=np.arange(40, 48),
        eval_values=np.arange(50, 58),
        eval_structural=5,
    )
    pool = WordPool.of(np.concatenate([vocab.keys, vocab.eval_keys]), np.concatenate([vocab.values, vocab.eval_values]))
    return SimpleNamespace(vocab=vocab, pool=pool)


def retriever(after_structure_only: bool):
    """Logits (1, T, VOCAB) that put the token after the previous occurrence of each position's token first; with
    ``after_structure_only`` only where the token before is the delimiter or the separator."""

    def logits(ids: torch.Tensor) -> torch.Tensor:
        t = ids[0].tolist()
        out = torch.zeros(1, len(t), VOCAB)
        for i, tok in enumerate(t):
            if after_structure_only and (i == 0 or t[i - 1] not in (DELIM, SEP)):
                continue
            earlier = [j for j in range(i) if t[j] == tok]
            if earlier:
                out[0, i, t[earlier[-1] + 1]] = 10.0
        return out

    return logits


def test_the_lists_hold_each_layout_and_their_answers():
    lists = transfer.ladder_lists(recall_like(), 5, RECORDS, QUERIES, seed=3)
    assert list(lists) == list(transfer.LAYOUTS)
    v = recall_like().vocab
    for name, items in lists.items():
        bare = name.startswith(("bare", "+"))
        evaluation = "eval words" in name or name.startswith("+")
        keys = v.eval_keys if evaluation or name == "eval keys" else v.keys
        values = v.eval_values if evaluation or name == "eval values" else v.values
        sep = v.eval_structural if name.startswith("+") else SEP
        pads = transfer.PADS if name == "+ eval pads" else 0
        assert len(items) == 5
        for item in items:
            t = item.tokens
            assert np.all(t[:pads] == v.eval_structural)
            cut = int(np.flatnonzero(t[pads:] == sep)[0]) + pads
            width = 2 if bare else 3
            assert cut == pads + RECORDS * width and len(t) == cut + 1 + QUERIES * width
            records = t[pads:cut].reshape(RECORDS, width)
            assert set(records[:, 0].tolist()) <= set(keys.tolist())
            assert set(records[:, 1].tolist()) <= set(values.tolist())
            assert bare or set(records[:, 2].tolist()) == {DELIM}
            given = dict(zip(records[:, 0].tolist(), records[:, 1].tolist()))
            assert [given[int(t[a - 1])] for a in item.answers] == t[item.answers].tolist()  # key, then its value
    again = transfer.ladder_lists(recall_like(), 5, RECORDS, QUERIES, seed=3)
    assert all(np.array_equal(a.tokens, b.tokens) for n in lists for a, b in zip(lists[n], again[n]))


def test_shared_roles_never_give_a_list_its_own_key_as_a_value():
    """``data.recall.word_roles=shared``: the pool's keys are its values; a ladder list's values are never its keys."""
    like = recall_like()
    words = np.concatenate([like.pool.keys, like.pool.values])
    shared = SimpleNamespace(vocab=like.vocab, pool=WordPool.of(words, words, shared=True))
    for name in ("list words", "bare"):
        for item in transfer.ladder_lists(shared, 40, RECORDS, QUERIES, seed=1)[name]:
            width = 2 if name == "bare" else 3
            records = item.tokens[: RECORDS * width].reshape(RECORDS, width)
            assert not set(records[:, 0].tolist()) & set(records[:, 1].tolist())


def test_scores_follow_what_each_retriever_can_answer():
    """The exact retriever answers every rung; one that retrieves only after the run's delimiter or separator
    answers the delimited rungs, the first query of the bare ones, and nothing after the evaluation's separator."""
    lists = transfer.ladder_lists(recall_like(), 4, RECORDS, QUERIES)
    exact = {r["layout"]: r for r in transfer.score_lists(retriever(False), lists)}
    assert all(r["accuracy"] == 1.0 and r["last"] == 1.0 and r["p_last"] > 0.99 for r in exact.values())
    bound = {r["layout"]: r for r in transfer.score_lists(retriever(True), lists)}
    for name, r in bound.items():
        if name.startswith("bare"):  # only the first query follows the separator
            assert r["accuracy"] == pytest.approx(1 / QUERIES) and r["last"] == 0.0 and r["p_last"] < 0.05
        elif name.startswith("+"):  # the evaluation's separator is not one it retrieves after
            assert r["accuracy"] == 0.0
        else:
            assert r["accuracy"] == 1.0
    lines = transfer.format_rows(list(bound.values()))
    assert len(lines) == 1 + len(transfer.LAYOUTS) and lines[5].split()[0] == "bare"


def test_results_split_by_the_answers_role_in_the_lists(tmp_path):
    """``--results``: an evaluation's prompts split by whether the answer was a list value (``recall_like``'s values
    and the evaluation's values are the pool's values; its keys never are)."""
    like = recall_like()
    answers = [11, 11, 50, 40, 42, 13]  # values 11, 50, 13; keys 40, 42
    correct = [1, 0, 1, 0, 0, 1]
    path = tmp_path / "results.csv"
    path.write_text("residue,answer_id,correct\n" + "".join(f"0,{a},{c}\n" for a, c in zip(answers, correct)))
    parts = transfer.by_value_role(like, str(path))
    assert parts == [
        {"part": "a list value in training", "prompts": 4, "answers": 3, "accuracy": 0.75},
        {"part": "never a list value", "prompts": 2, "answers": 2, "accuracy": 0.0},
    ]
    path.write_text("residue,correct\n0,1\n")
    with pytest.raises(ValueError, match="not a lookup evaluation's results.csv"):
        transfer.by_value_role(like, str(path))


def test_too_few_words_for_a_layout_is_refused():
    with pytest.raises(ValueError, match="layout 'eval keys': 8 keys and 10 values, fewer than 9 records"):
        transfer.ladder_lists(recall_like(), 1, 9, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--queries", "20"], "ckv: error: --queries=20 asks more records than a list holds"),
        (["--lists", "0"], "ckv: error: --lists=0 must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line(capsys, tmp_path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        transfer.main([str(tmp_path), *argv])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == message


def test_a_run_that_was_not_pretrained_is_one_line(capsys, cpu_smoke_run) -> None:
    assert cpu_smoke_run.returncode == 0, cpu_smoke_run.stderr[-3000:]
    run = cpu_smoke_run.out_dir / "cpu_smoke" / "seed=0"  # data.kind: text
    with pytest.raises(SystemExit) as exit_:
        transfer.main([str(run)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("ckv: error: ") and "the ladder reads a pretrain run's lists" in err
    with pytest.raises(SystemExit):
        transfer.main([str(run / "nowhere")])
    assert "not a ckv run folder" in capsys.readouterr().err
