"""Evaluation: the position-matched lookup task, the needle test, the filler-length probe, their statistics,
plots, sweep summaries and audit mode for transformers models (see docs/evaluation.md).

``eval.py`` is the command line; from Python::

    from ckv.eval import LookupSpec, RunOptions, evaluate, load_ckv_model
    results, out_dir = evaluate(load_ckv_model("runs/my_run"), LookupSpec(modulus=8), RunOptions(limit=64))

Task kinds register in ``ckv.eval.registry`` when their modules are imported; every module of this package is
imported here, so a new kind is one module of ``ckv.eval`` (docs/evaluation.md, "Adding a task").
"""

import importlib
import pkgutil

from ckv.eval.hf_models import inspect_hf_model, load_hf_model
from ckv.eval.lookup import LookupOutcome, LookupSpec, LookupTask
from ckv.eval.models import CheckpointMismatchError, LoadedModel, ModelFacts, inspect_ckv_model, load_ckv_model
from ckv.eval.needle import NeedleSpec, NeedleTask
from ckv.eval.probe import ProbeSpec, ProbeTask
from ckv.eval.registry import TASKS, EvalTask, RunOptions, TaskResult, register_task, task_from_dict, task_type
from ckv.eval.runner import ModelSource, build_task, dry_run, evaluate, summarize_runs, summary_lines
from ckv.eval.stats import StatsOptions
from ckv.eval.summary import find_runs, summarize
from ckv.eval.vocab import VocabSpec

for _module in pkgutil.iter_modules(__path__):  # task kinds register wherever they are defined
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "TASKS",
    "CheckpointMismatchError",
    "EvalTask",
    "LoadedModel",
    "LookupOutcome",
    "LookupSpec",
    "LookupTask",
    "ModelFacts",
    "ModelSource",
    "NeedleSpec",
    "NeedleTask",
    "ProbeSpec",
    "ProbeTask",
    "RunOptions",
    "StatsOptions",
    "TaskResult",
    "VocabSpec",
    "build_task",
    "dry_run",
    "evaluate",
    "find_runs",
    "inspect_ckv_model",
    "inspect_hf_model",
    "load_ckv_model",
    "load_hf_model",
    "register_task",
    "summarize",
    "summarize_runs",
    "summary_lines",
    "task_from_dict",
    "task_type",
]
