"""The analysis registry: an analysis is a function ``fn(ctx) -> JSON-ready dict`` registered under a name.

It receives an ``AnalysisContext`` holding the model and the built lookup task, re-runs the same prompts on
modified models through ``ctx.evaluate(logits_fn)`` and gets per-phase results back from ``ctx.report(outcome)``.
``run_analysis`` builds the task once, calls the analysis and writes ``<out>/<name>/<name>.json``. The shipped
analyses register when ``ckv.analysis`` is imported (its ``__init__`` imports them), so ``ANALYSES`` is complete
whichever module a caller imports first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ckv.config import ConfigError
from ckv.eval.lookup import LookupOutcome, LookupSpec, LookupTask
from ckv.eval.models import LoadedModel
from ckv.eval.runner import RunOptions, build_task, output_dir, results_envelope
from ckv.eval.scoring import LogitsFn
from ckv.io.layout import analysis_file
from ckv.io.results import write_json


@dataclass
class AnalysisContext:
    """What an analysis receives: the model, the built lookup task (the same prompts for every variant), the
    run options, its parameters (the ``analysis`` config minus ``name``) and its output folder."""

    model: LoadedModel
    task: LookupTask
    options: RunOptions
    params: dict
    out_dir: Path

    def evaluate(self, logits: Optional[LogitsFn] = None) -> LookupOutcome:
        """Score the task's prompts with ``logits`` (default: the unmodified model)."""
        return self.task.evaluate(
            logits or self.model.logits,
            batch_size=self.options.batch_size,
            device=self.model.device,
            progress=self.options.progress,
        )

    def report(self, outcome: LookupOutcome) -> dict:
        """Per-residue and per-phase statistics of an outcome (see ``LookupTask.report``)."""
        return self.task.report(outcome, self.options.stats)


AnalysisFn = Callable[[AnalysisContext], dict]
ANALYSES: dict[str, AnalysisFn] = {}


def register_analysis(name: str) -> Callable[[AnalysisFn], AnalysisFn]:
    """Decorator: make ``fn(ctx) -> JSON-ready dict`` runnable as ``run_analysis({"name": name, ...})`` (and, with
    a ``conf/eval/analysis/<name>.yaml``, as ``eval.py analysis=<name>``). A name is registered once."""

    def deco(fn: AnalysisFn) -> AnalysisFn:
        if name in ANALYSES and ANALYSES[name] is not fn:
            raise ValueError(f"analysis {name!r} is already registered (by {ANALYSES[name].__module__})")
        ANALYSES[name] = fn
        return fn

    return deco


def run_analysis(
    config: dict[str, Any], model: LoadedModel, spec: LookupSpec, options: RunOptions = RunOptions()
) -> dict:
    """Run the analysis named ``config["name"]`` (the other keys are its ``ctx.params``) on the lookup task
    ``spec``; writes ``<out>/<name>/<name>.json`` and returns the envelope."""
    params = dict(config)
    name = params.pop("name", None)
    if name not in ANALYSES:
        raise ConfigError(f"analysis.name={name!r} is not a known analysis; known: {sorted(ANALYSES)}")
    if not isinstance(spec, LookupSpec):
        raise ConfigError(f"analyses run on a lookup task; task.kind is {type(spec).__name__}")
    if options.mitigation.name != "none":
        raise ConfigError(
            f"mitigation={options.mitigation.name} applies to eval.py's tasks, not to analysis={name} (an analysis "
            "runs the model as it is): drop one of the two"
        )
    task = build_task(spec, model, options.limit)
    path = analysis_file(output_dir(model, spec, options), name)
    result = ANALYSES[name](AnalysisContext(model, task, options, params, path.parent))
    envelope = {
        **results_envelope(model, spec, options, {"task": "lookup", **task.describe()}),
        "analysis": {"name": name, "params": params, "results": result},
    }
    write_json(path, envelope)
    return envelope
