"""Where does a pretrained run's retrieval stop transferring? (``python -m ckv.apps.transfer RUN``; docs/pretrain.md)

A run of ``data.kind: pretrain`` learns retrieval in its lists ``k v d k v d ... s k v d ...`` and is scored on the
lookup evaluation's template: the evaluation's own words, records back to back. This ladder walks from one to the
other, one change at a time, on lists of the run's own layout (``n_records`` records, a separator, ``n_queries`` of
them asked again), and scores every asked value:

- ``list words``: the run's list words (the evaluation's left out), a delimiter after each record: its training;
- ``eval keys``: the evaluation's keys with list values; ``eval values``: list keys with the evaluation's values;
  ``eval words``: both the evaluation's;
- ``bare``: list words, records back to back (no delimiter, in the records and the queries); ``bare, eval words``:
  both changes: the evaluation's words in its back-to-back layout, its pad and its 8-demonstration template aside;
- ``+ eval separator``: that, with the evaluation's pad token as the separator (``data.recall.eval_pad``, which the
  evaluation uses as its separator); ``+ eval pads``: that, after ``PADS`` of its pads (prefix padding's run).

The delimiter and separator are the run's first (``data.recall.delimiters[0]``, ``separators[0]``). Every layout
draws its lists from its own generator ``(seed, layout index)``, the same draws whatever the model.

``--results CSV`` (an evaluation's ``results.csv`` of the run, no model needed) splits that evaluation's accuracy by
whether its answer was ever a value of the run's lists: under ``data.recall.word_roles=split`` each pool word is only
a key or only a value, so some of the evaluation's values never were one.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ckv.checks import ConfigError, error_message
from ckv.data import DataConfig, build_batches
from ckv.data.recall import RecallSequences, values_besides
from ckv.eval.models import load_ckv_model
from ckv.io.layout import CheckpointError, read_run_config

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids (B, T) -> logits (B, T, V)
LAYOUTS = (
    "list words",
    "eval keys",
    "eval values",
    "eval words",
    "bare",
    "bare, eval words",
    "+ eval separator",
    "+ eval pads",
)
PADS = 16  # the evaluation's pads before the records in the last rung (its prefix padding puts up to 39 there)


@dataclass(frozen=True)
class TransferList:
    """One list: its tokens (L,) and the positions of its asked values (Q,), the last the final query's."""

    tokens: np.ndarray
    answers: np.ndarray


def ladder_lists(
    recall: RecallSequences, n_lists: int, n_records: int, n_queries: int, seed: int = 0
) -> dict[str, list[TransferList]]:
    """``n_lists`` lists per layout of ``LAYOUTS`` from ``recall``'s vocabulary (see the module docstring)."""
    v = recall.vocab
    held = set(v.eval_keys.tolist()) | set(v.eval_values.tolist())
    list_keys = np.array([k for k in recall.pool.keys.tolist() if k not in held])
    list_values = np.array([x for x in recall.pool.values.tolist() if x not in held])
    words = {
        "list words": (list_keys, list_values),
        "eval keys": (v.eval_keys, list_values),
        "eval values": (list_keys, v.eval_values),
        "eval words": (v.eval_keys, v.eval_values),
        "bare": (list_keys, list_values),
        "bare, eval words": (v.eval_keys, v.eval_values),
        "+ eval separator": (v.eval_keys, v.eval_values),
        "+ eval pads": (v.eval_keys, v.eval_values),
    }
    out: dict[str, list[TransferList]] = {}
    for li, name in enumerate(LAYOUTS):
        keys, values = words[name]
        if len(keys) < n_records or len(values) < n_records:
            raise ValueError(
                f"layout {name!r}: {len(keys)} keys and {len(values)} values, fewer than {n_records} records"
            )
        after = [] if name.startswith(("bare", "+")) else [v.delimiters[0]]
        sep = v.eval_structural if name.startswith("+") else v.separators[0]
        pads = [v.eval_structural] * (PADS if name == "+ eval pads" else 0)
        rng = np.random.default_rng([seed, li])
        out[name] = []
        for _ in range(n_lists):
            k = rng.choice(keys, n_records, replace=False)
            x = rng.choice(values_besides(values, k) if recall.pool.shared else values, n_records, replace=False)
            asked = rng.choice(n_records, n_queries, replace=False)
            records = [t for i in range(n_records) for t in (k[i], x[i], *after)]
            queries = [t for i in asked for t in (k[i], x[i], *after)]
            width = 2 + len(after)
            start = len(pads) + len(records) + 1  # the pads, the records, the separator, then the queries
            tokens = np.array([*pads, *records, sep, *queries], dtype=np.int64)
            out[name].append(TransferList(tokens, start + 1 + width * np.arange(n_queries)))
    return out


def score_lists(logits: LogitsFn, lists: dict[str, list[TransferList]]) -> list[dict]:
    """Per layout: the share of asked values predicted (argmax), the same for each list's last query, and the last
    answer's mean probability."""
    rows = []
    for name, items in lists.items():
        hits, last, p_last = [], [], []
        for item in items:
            with torch.no_grad():
                lp = torch.log_softmax(logits(torch.as_tensor(item.tokens)[None]).float(), -1)[0]  # (L, V)
            want = torch.as_tensor(item.tokens[item.answers])  # (Q,)
            got = lp[item.answers - 1].argmax(-1)  # (Q,) each value predicted from the token before it
            hits.append((got == want).float().mean().item())
            last.append(float(got[-1] == want[-1]))
            p_last.append(lp[item.answers[-1] - 1, want[-1]].exp().item())
        rows.append(
            dict(
                layout=name,
                lists=len(items),
                accuracy=float(np.mean(hits)),
                last=float(np.mean(last)),
                p_last=float(np.mean(p_last)),
            )  # fmt: skip
        )
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    """The ladder as a table: one line per layout."""
    lines = [f"{'layout':18s} {'lists':>5s} {'asked values':>12s} {'last query':>10s} {'p(last answer)':>14s}"]
    for r in rows:
        lines.append(f"{r['layout']:18s} {r['lists']:5d} {r['accuracy']:12.1%} {r['last']:10.1%} {r['p_last']:14.4f}")
    return lines


def by_value_role(recall: RecallSequences, results_csv: str) -> list[dict]:
    """An evaluation's prompts (its ``results.csv``: ``answer_id``, ``correct``) split by whether the answer is a
    value of ``recall``'s lists: per part, its prompts, distinct answers and accuracy (a part without prompts is
    left out)."""
    with open(results_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"answer_id", "correct"} <= set(rows[0]):
        raise ValueError(f"{results_csv}: not a lookup evaluation's results.csv (no answer_id and correct columns)")
    values = set(recall.pool.values.tolist())
    out = []
    for label, held in (("a list value in training", True), ("never a list value", False)):
        part = [r for r in rows if (int(r["answer_id"]) in values) == held]
        if part:
            out.append(
                dict(
                    part=label,
                    prompts=len(part),
                    answers=len({r["answer_id"] for r in part}),
                    accuracy=float(np.mean([float(r["correct"]) for r in part])),
                )  # fmt: skip
            )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """The command: the ladder of one run (at ``--step``, else its final weights) printed as a table."""
    parser = argparse.ArgumentParser(
        prog="python -m ckv.apps.transfer",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", help="a run folder of data.kind=pretrain")
    parser.add_argument("--step", type=int, default=None, help="a kept checkpoint's step (default: the final weights)")
    parser.add_argument("--lists", type=int, default=64, help="lists per layout (default 64)")
    parser.add_argument("--records", type=int, default=16, help="records per list (default 16)")
    parser.add_argument("--queries", type=int, default=9, help="asked records per list (default 9)")
    parser.add_argument("--seed", type=int, default=0, help="the lists' seed (default 0)")
    parser.add_argument(
        "--results",
        default=None,
        help="instead of the ladder: an evaluation's results.csv of this run, split by whether each answer was a "
        "value of the run's lists",
    )
    args = parser.parse_args(argv)
    for name in ("lists", "records", "queries"):
        if getattr(args, name) < 1:
            parser.exit(2, error_message(f"--{name}={getattr(args, name)} must be >= 1") + "\n")
    if args.queries > args.records:
        parser.exit(2, error_message(f"--queries={args.queries} asks more records than a list holds") + "\n")
    try:
        cfg = read_run_config(args.run)
        data = DataConfig.from_dict(cfg["data"])
        if data.kind != "pretrain":
            raise ConfigError(
                f"{args.run} was trained on data.kind={data.kind}: the ladder reads a pretrain run's lists"
            )
        recall = build_batches(data, batch_size=1, seed=0).source.lookup
        if args.results is not None:
            parts = by_value_role(recall, args.results)
            held = np.isin(recall.vocab.eval_values, recall.pool.values).sum()
            print(f"ckv transfer: {args.results}, by the answer's role in {args.run}'s lists")
            print(f"  (they hold {held} of the evaluation's {len(recall.vocab.eval_values)} values as values):")
            for r in parts:
                print(f"  {r['part']:25s} {r['prompts']:6d} prompts {r['answers']:4d} answers {r['accuracy']:7.1%}")
            return 0
        lists = ladder_lists(recall, args.lists, args.records, args.queries, args.seed)
        model = load_ckv_model(args.run, step=args.step)
    except (ValueError, FileNotFoundError, CheckpointError) as e:  # ConfigError is a ValueError
        parser.exit(2, error_message(str(e)) + "\n")
    rows = score_lists(model.module, lists)
    where = f"step {args.step}" if args.step is not None else "final weights"
    print(f"ckv transfer: {args.run} ({where}), {args.records} records, {args.queries} asked, per layout:")
    print("\n".join(format_rows(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
