"""Evaluation: the position-matched lookup task, the filler-length probe, their statistics, plots, sweep
summaries and audit mode for transformers models (see docs/evaluation.md).

``eval.py`` is the command line; from Python::

    from ckv.eval import LookupSpec, RunOptions, evaluate, load_ckv_model
    results, out_dir = evaluate(load_ckv_model("runs/my_run"), LookupSpec(modulus=8), RunOptions(limit=64))
"""

from ckv.eval.hf_models import load_hf_model
from ckv.eval.lookup import LookupOutcome, LookupSpec, LookupTask
from ckv.eval.models import CheckpointMismatchError, LoadedModel, load_ckv_model
from ckv.eval.probe import ProbeSpec, ProbeTask
from ckv.eval.runner import ModelSource, RunOptions, build_task, evaluate, summarize_runs, task_from_dict
from ckv.eval.stats import StatsOptions
from ckv.eval.summary import find_runs, summarize
from ckv.eval.vocab import VocabSpec

__all__ = [
    "CheckpointMismatchError",
    "LoadedModel",
    "LookupOutcome",
    "LookupSpec",
    "LookupTask",
    "ModelSource",
    "ProbeSpec",
    "ProbeTask",
    "RunOptions",
    "StatsOptions",
    "VocabSpec",
    "build_task",
    "evaluate",
    "find_runs",
    "load_ckv_model",
    "load_hf_model",
    "summarize",
    "summarize_runs",
    "task_from_dict",
]
