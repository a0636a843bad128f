"""The chunk check (``ckv.eval.chunking``) on a tiny transformers DeepSeek-V4 whose top-k binds: transformers'
chunked prefill of it differs from one full forward (``torch.topk`` breaks the indexer's ties at exactly 0 after
its ReLU by the tensor's shape), the needle measures that on its scored prompts and says so in results.json and
the summary; the same model with top-k over every entry, or with ties broken by index, shows no difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ckv.eval import RunOptions, StatsOptions, evaluate, load_hf_model, summary_lines, task_from_dict
from ckv.eval.chunking import check_sample
from ckv.eval.hf_models import HFLastLogits
from ckv.eval.needle import NeedleKind

from .helpers import task_config, word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FAST = StatsOptions(n_bootstrap=50, n_permutations=50)
# 64 compressed entries at the question: the tiny V4 (tests/eval/conftest.py) with index_topk 2 selects 2 of them
# (binds), with 64 every entry (dense)
CONTEXT, CHUNK, TOPK = 256, 16, 2


def needle_args(**kw: object) -> dict:
    """The shipped needle config at 256 tokens (32 records) over ids of the word tokenizer."""
    ids = word_tokenizer().convert_tokens_to_ids
    cfg = task_config("needle")
    cfg.update({"context_tokens": CONTEXT, "n_records": CONTEXT // 8, "prefill_chunk": CHUNK, **kw})
    cfg["vocab"] = dict(
        source="ids",
        keys=[ids("cat"), ids("cat") + 20],
        values=[ids("Alice"), ids("Alice") + 20],
        pad=ids("pad"),
        separator=[ids(":")],
        bos=None,
    )
    return cfg


def run_needle(path: Path, out: Path, **kw: object) -> tuple[dict, list[str], object]:
    """The needle on the model in ``path`` (limit 1: 8 prompts): results, summary lines and the loaded model."""
    model = load_hf_model(path, device="cpu", stride=4)
    spec = task_from_dict(needle_args(**kw))
    results, where = evaluate(
        model, spec, RunOptions(limit=1, batch_size=8, progress=False, plots=False, stats=FAST, out_dir=str(out))
    )
    return results, summary_lines(spec, results, where), model


def recompute(model: object, prompts: list[np.ndarray], answers: np.ndarray) -> tuple[float, int, int]:
    """Max |logit diff| between transformers' chunked prefill and one forward, prompts whose top-1 differs and
    prompts whose 0/1 score differs, computed here from the prompts (not from the check's code)."""
    diff, top, score = 0.0, 0, 0
    with torch.inference_mode():
        for p, a in zip(prompts, answers):
            ids = torch.as_tensor(p)[None]
            chunked, full = HFLastLogits(model, CHUNK)(ids)[0], HFLastLogits(model)(ids)[0]
            diff = max(diff, (chunked - full).abs().max().item())
            top += int(chunked.argmax() != full.argmax())
            score += int((chunked.argmax() == a) != (full.argmax() == a))
    return diff, top, score


def test_the_needle_measures_where_chunked_prefill_differs(tiny_v4: Callable[[int], Path], tmp_path: Path) -> None:
    results, lines, model = run_needle(tiny_v4(TOPK), tmp_path / "sparse")
    rec = results["results"]["chunking"]
    assert rec["chunk"] == CHUNK and rec["prompt_tokens"] == CONTEXT and rec["checked_prompts"] == 4
    assert rec["prompt_indices"] == check_sample(8, 4).tolist() == [0, 2, 5, 7]  # spread over the 8 prompts
    assert rec["max_abs_logit_diff"] > 0.05  # ties broken by shape: not a rounding difference
    built = NeedleKind().build(task_from_dict(needle_args()), model, limit=1)
    rows = json.loads((tmp_path / "sparse" / "results.json").read_text())["results"]["chunking"]
    assert rows == rec
    diff, top, score = recompute(
        model.module, [built.prompts[i] for i in rec["prompt_indices"]], built.table["answer_id"][rec["prompt_indices"]]
    )
    assert rec["max_abs_logit_diff"] == pytest.approx(diff, abs=1e-5)
    assert (rec["answers_changed"], rec["scores_changed"]) == (top, score)
    assert rec["depends_on_chunk"] == (top > 0)
    warned = [line for line in lines if "this score depends on the chunk size" in line]
    assert len(warned) == (1 if top else 0)
    if top:
        assert f"task.prefill_chunk >= {CONTEXT}" in warned[0]


@pytest.mark.slow
def test_no_difference_where_every_entry_is_selected_or_ties_go_by_index(
    tiny_v4: Callable[[int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dense, lines, _ = run_needle(tiny_v4(64), tmp_path / "dense")
    rec = dense["results"]["chunking"]
    assert rec["checked_prompts"] == 4 and rec["max_abs_logit_diff"] < 1e-4 and rec["answers_changed"] == 0
    assert not rec["depends_on_chunk"] and any("same top-1" in line for line in lines)

    def topk_ties_by_index(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    monkeypatch.setattr(torch.Tensor, "topk", topk_ties_by_index)  # the indexer calls scores.topk(k)
    stable, _, _ = run_needle(tiny_v4(TOPK), tmp_path / "stable")
    assert stable["results"]["chunking"]["max_abs_logit_diff"] < 1e-4  # the binding model's gap is the ties


@pytest.mark.slow
def test_nothing_to_check_off_and_the_lookup(tiny_v4: Callable[[int], Path], tmp_path: Path) -> None:
    fits, lines, model = run_needle(tiny_v4(TOPK), tmp_path / "fits", prefill_chunk=CONTEXT)
    rec = fits["results"]["chunking"]
    assert rec["checked_prompts"] == 0 and "fits one prefill chunk of 256" in rec["note"]
    assert "max_abs_logit_diff" not in rec and any("nothing to check" in line for line in lines)
    off, _, _ = run_needle(tiny_v4(TOPK), tmp_path / "off", chunk_check=0)
    assert off["results"]["chunking"]["note"] == "the chunk check is off (task.chunk_check=0)"
    small, _, _ = run_needle(tiny_v4(TOPK), tmp_path / "small", memory_budget_gb=1e-4)  # the chunk runs, warned
    rec = small["results"]["chunking"]
    assert rec["checked_prompts"] == 0 and rec["note"].startswith("not checked: one full forward of 256 tokens needs")
    cfg = task_config("lookup_words")
    cfg["vocab"].update(pad="pad", separator=":")
    cfg.update(n_records=16, n_demos=2, modulus=8)
    lookup, _ = evaluate(
        model,
        task_from_dict(cfg),
        RunOptions(limit=1, progress=False, plots=False, stats=FAST, out_dir=str(tmp_path / "lookup")),
    )
    rec = lookup["results"]["chunking"]
    assert rec["chunk"] is None and rec["checked_prompts"] == 0 and "one forward" in rec["note"]
    assert rec["prompt_tokens"] // 4 > TOPK  # top-k binds in the lookup's prompts too


class Shifted(HFLastLogits):
    """A chunked path that differs from the full forward on purpose: the chunked logits of every prompt favour
    token ``boost``."""

    boost = 7

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = super().__call__(input_ids).clone()
        out[:, self.boost] += 1e3
        return out


def test_changed_answers_give_the_warning(tiny_v4: Callable[[int], Path], tmp_path: Path) -> None:
    model = load_hf_model(tiny_v4(TOPK), device="cpu", stride=4)
    spec = task_from_dict(needle_args())
    kind = NeedleKind()
    built = kind.build(spec, model, limit=1)
    result = kind.run(built, Shifted(model.module, CHUNK), RunOptions(progress=False, stats=FAST), "cpu")
    rec = result.report["chunking"]
    assert rec["answers_changed"] == 4 and rec["depends_on_chunk"] and 998 < rec["max_abs_logit_diff"] < 1002
    assert rec["scores_changed"] == int(np.sum(built.table["answer_id"][rec["prompt_indices"]] == Shifted.boost))
    lines = kind.summary(result.report)
    assert lines[-1].startswith("WARNING: this score depends on the chunk size: with prefill chunk 16, 4 of 4")


@pytest.mark.slow
def test_eval_py_reports_the_check_and_refuses_a_bad_value(tiny_v4: Callable[[int], Path], tmp_path: Path) -> None:
    cfg = needle_args()
    v = cfg["vocab"]
    common = ["model=hf", f"model.path={tiny_v4(TOPK)}", "model.stride=4", "task=needle", "device=cpu"]
    args = [
        *common,
        f"task.context_tokens={CONTEXT}",
        f"task.n_records={CONTEXT // 8}",
        f"task.prefill_chunk={CHUNK}",
        "task.vocab.source=ids",
        f"task.vocab.keys=[{v['keys'][0]},{v['keys'][1]}]",
        f"task.vocab.values=[{v['values'][0]},{v['values'][1]}]",
        f"task.vocab.pad={v['pad']}",
        f"task.vocab.separator=[{v['separator'][0]}]",
        "task.vocab.bos=null",
        "limit=1",
        "batch_size=8",
        f"out_dir={tmp_path / 'needle'}",
        "progress=false",
        "stats.n_bootstrap=50",
        "stats.n_permutations=50",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}

    def eval_py(*argv: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(ROOT / "eval.py"), *argv]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    p = eval_py(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((tmp_path / "needle" / "results.json").read_text())["results"]["chunking"]
    assert rec["checked_prompts"] == 4 and rec["max_abs_logit_diff"] > 0.05
    assert ("this score depends on the chunk size" in p.stdout) == rec["depends_on_chunk"]
    bad = eval_py(*common, "task.chunk_check=-1")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr[-2000:]
    assert bad.stderr.startswith("ckv: error: task.chunk_check=-1") and "Traceback" not in bad.stdout + bad.stderr
