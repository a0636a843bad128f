"""The eval-task registry: a new task kind is one module (here: this test) registering an ``EvalTask``; the runner
runs it end to end (build, logits, run, results.json and .csv, plot, summary) without knowing what it is. This
walks docs/evaluation.md's checklist "Adding a task" once."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from ckv.config import ConfigError, check_int
from ckv.eval import (
    TASKS,
    EvalTask,
    LoadedModel,
    LookupSpec,
    ModelFacts,
    RunOptions,
    TaskResult,
    evaluate,
    register_task,
    summary_lines,
    task_from_dict,
    task_type,
)
from ckv.eval.registry import check_name
from ckv.eval.scoring import LogitsFn, score_next_token
from ckv.io.results import read_json

from .helpers import ReadingOracle, png_ok

VOCAB = 50


@dataclass(frozen=True)
class CopySpec:
    """A toy task: ``n`` prompts ``k v k``; the answer is ``v`` (a lookup of one record)."""

    name: str = "copy"
    n: int = 6

    def __post_init__(self) -> None:
        check_name(self)
        check_int("task.n", self.n)


class CopyTask(EvalTask):
    kind = "copy"
    spec = CopySpec

    def build(self, spec: CopySpec, model: ModelFacts, limit: Optional[int] = None) -> list[np.ndarray]:
        if 2 * spec.n > model.vocab_size:
            raise ConfigError(f"task.n={spec.n} needs {2 * spec.n} ids; the model has {model.vocab_size}")
        return [np.array([i, spec.n + i, i]) for i in range(min(spec.n, limit or spec.n))]

    def logits(self, spec: CopySpec, model: LoadedModel, built: Any, options: RunOptions) -> LogitsFn:
        return lambda ids: model.logits(ids) * 2.0  # a task may score with its own callable

    def run(self, built: list[np.ndarray], logits: LogitsFn, options: RunOptions, device: Any) -> TaskResult:
        answers = np.array([[p[1]] for p in built])
        scores = score_next_token(logits, built, answers, batch_size=options.batch_size, device=device, progress=False)
        correct = (scores.top1 == answers[:, 0]).astype(int)
        rows = [
            {"prompt": i, "correct": int(c), "p_answer": float(p)}
            for i, (c, p) in enumerate(zip(correct, scores.probs[:, 0]))
        ]
        report = {"task": "copy", "n_prompts": len(built), "headline": {"mean": float(correct.mean())}}
        return TaskResult(report, rows)

    def plot(self, report: dict, path: Path, title: str) -> Optional[Path]:
        fig = Figure(figsize=(3, 2))
        fig.subplots().bar([0], [report["headline"]["mean"]])
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path

    def summary(self, report: dict) -> list[str]:
        return [f"copied {100 * report['headline']['mean']:.0f}% of {report['n_prompts']} values"]


@pytest.fixture
def copy_task() -> Iterator[type[EvalTask]]:
    register_task(CopyTask)
    yield CopyTask
    TASKS.pop("copy")


def _model(tmp_path: Path) -> LoadedModel:
    return LoadedModel(
        name="oracle",
        vocab_size=VOCAB,
        max_len=64,
        out_dir=tmp_path / "eval",
        logits=ReadingOracle(VOCAB),
        module=torch.nn.Identity(),
        device=torch.device("cpu"),
    )


def test_a_registered_toy_task_runs_end_to_end_through_the_runner(copy_task, tmp_path: Path) -> None:
    spec = task_from_dict({"kind": "copy", "n": 5})
    assert isinstance(spec, CopySpec) and task_type(spec) is TASKS["copy"]
    results, out = evaluate(_model(tmp_path), spec, RunOptions(batch_size=2, progress=False))
    assert out == tmp_path / "eval" / "copy" and results["results"]["headline"]["mean"] == 1.0
    saved = read_json(out / "results.json")
    assert saved["eval"]["task"] == {"kind": "copy", "name": "copy", "n": 5} and saved["model"]["name"] == "oracle"
    assert len((out / "results.csv").read_text().splitlines()) == 6 and png_ok(out / "copy.png")
    lines = summary_lines(spec, results, out)
    assert lines[0] == "copy 'copy' on oracle" and lines[1] == "  copied 100% of 5 values"
    assert lines[2].startswith("results -> ") and str(out / "copy.png") in lines[2]
    results, _ = evaluate(
        _model(tmp_path), spec, RunOptions(progress=False, limit=2, plots=False, out_dir=str(tmp_path / "o"))
    )
    assert results["results"]["n_prompts"] == 2 and not (tmp_path / "o" / "copy.png").exists()


def test_task_configs_and_registrations_are_checked(copy_task) -> None:
    registered = sorted(TASKS)
    with pytest.raises(ConfigError, match=r"unknown task \(kind 'copy'\) field\(s\) \['m'\]"):
        task_from_dict({"kind": "copy", "m": 1})
    with pytest.raises(ConfigError, match="task.n=0 must be an integer >= 1"):
        task_from_dict({"kind": "copy", "n": 0})
    with pytest.raises(ConfigError, match=r"task.kind='nosuch' is not allowed; choose one of \['copy', 'lookup'"):
        task_from_dict({"kind": "nosuch"})

    class Again(CopyTask):
        """The copy task registered a second time under its own kind."""

    with pytest.raises(ValueError, match="task kind 'copy' is already registered"):
        register_task(Again)

    class SameSpec(CopyTask):
        kind = "copy2"

    with pytest.raises(ValueError, match="spec CopySpec already belongs to task kind 'copy'"):
        register_task(SameSpec)

    class NoName(EvalTask):
        kind, spec = "noname", dataclass(type("S", (), {"__annotations__": {"n": int}, "n": 1}))

    with pytest.raises(TypeError, match="needs a 'name' field"):
        register_task(NoName)
    assert sorted(TASKS) == registered  # the refused registrations left no trace
    with pytest.raises(ConfigError, match="not the spec of a registered task kind"):
        task_type(object())
    assert task_type(LookupSpec()).kind == "lookup"
