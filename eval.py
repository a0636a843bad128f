"""Evaluate a model (ckv run or local transformers model) on a phase task, or summarise a sweep of runs.

    python eval.py model.path=<run dir>                      # lookup task -> <run>/eval/lookup/
    python eval.py model=hf model.path=<dir> task=lookup_words model.stride=4
    python eval.py model.path=<run dir> task=probe_synthetic limit=8
    python eval.py summary=<sweep dir>                       # every run of a multirun sweep + grid summary
    python eval.py model.path=<run dir> analysis=<name>      # a registered analysis (conf/eval/analysis/)
    python eval.py model=hf model.path=<dir> task=needle dry_run=true   # check settings, print the memory plan

See docs/evaluation.md. This file only turns the Hydra config into ckv.eval / ckv.analysis calls. Path values
(``PATH_KEYS``) are taken verbatim, so a sweep job folder such as ``.../attention.stride=4,seed=0`` can be pasted
unquoted. Every task and model setting, and the folder the results go to, is checked before the weights load (the
task is built from the model's configs and tokenizer); configuration and data errors end the program with one
``ckv: error: ...`` line and exit code 2 (3, ``EXIT_NOT_APPLICABLE``, for an analysis that does not apply to the
model). A finished evaluation prints a one-screen summary (``ckv.eval.summary_lines``) and the headline as one JSON
line.
"""

from __future__ import annotations

import json
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from ckv.analysis import run_analysis
from ckv.analysis.hooks import AnalysisNotApplicable
from ckv.apps.cli import EXIT_NOT_APPLICABLE, HYDRA_ERRORS, one_line_errors, run_hydra_main
from ckv.config import ConfigError, check_bool, field_names, reject_unknown
from ckv.data import DataError
from ckv.eval import (
    ModelSource,
    RunOptions,
    StatsOptions,
    build_task,
    dry_run,
    evaluate,
    summarize_runs,
    summary_lines,
    task_from_dict,
)
from ckv.eval.runner import check_output
from ckv.io.layout import CheckpointError

CONF = Path(__file__).resolve().parent / "conf" / "eval"
PATH_KEYS = ("model.path", "model.tokenizer", "summary", "summary_out", "out_dir")
# CheckpointMismatchError and AnalysisNotApplicable are ConfigErrors
USER_ERRORS = (
    ConfigError,
    DataError,
    CheckpointError,
    FileNotFoundError,
    ImportError,
    *HYDRA_ERRORS,
)
EXIT_USER_ERROR = 2


def quote_path_values(overrides: list[str]) -> list[str]:
    """Quote the value of each ``<path key>=<value>`` override (``PATH_KEYS``) so that Hydra's override grammar
    reads it verbatim (``=`` and ``,`` are grammar in an unquoted value). Values already quoted, lists
    (``summary=[a,b]``: quote their items yourself), ``null``, empty values and other keys are left alone."""
    out = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") in PATH_KEYS and value and value[0] not in "'\"[" and value != "null":
            quote = "'" if "'" not in value else '"'
            if quote not in value:
                arg = f"{key}={quote}{value}{quote}"
        out.append(arg)
    return out


def user_errors() -> AbstractContextManager[None]:
    """Turn ``USER_ERRORS`` into one ``ckv: error:`` line on stderr and exit code 2; anything else keeps its
    traceback."""
    return one_line_errors(USER_ERRORS, EXIT_USER_ERROR)


def settings() -> list[str]:
    """eval.py's top-level settings: the keys of ``conf/eval/config.yaml`` and the config groups it defaults."""
    root = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    root.pop("hydra")
    groups = [k for d in root.pop("defaults") if isinstance(d, dict) for k in d if " " not in k]
    return [*root, *groups]


def check_settings(c: dict) -> None:
    """Refuse a key that eval.py does not read (``+limt=4`` would otherwise be composed in and ignored)."""
    reject_unknown(c, settings(), "eval")
    reject_unknown(c["stats"], field_names(StatsOptions), "stats")


def _options(c: dict) -> RunOptions:
    return RunOptions(
        batch_size=c["batch_size"],
        limit=c["limit"],
        progress=c["progress"],
        device=c["device"],
        out_dir=c["out_dir"],
        plots=c["plots"],
        stats=c["stats"],
        mitigation=c["mitigation"],
    )


def _source(c: dict) -> ModelSource:
    if not isinstance(c["model"], dict):
        raise ConfigError(f"model={c['model']!r} must be a mapping (model=ckv or model=hf and their settings)")
    reject_unknown(c["model"], field_names(ModelSource), "model")
    return ModelSource(**c["model"])


def _summary(c: dict, spec: object, source: ModelSource, options: RunOptions) -> None:
    roots = c["summary"] if isinstance(c["summary"], list) else [c["summary"]]
    result, out = summarize_runs(roots, spec, source, options, out_dir=c["summary_out"], rerun=c["summary_rerun"])
    print(f"summary of {len(result['runs'])} runs -> {out}")


def _brief(value: Any) -> str:
    """A result value in a few words: a number or short text as is, an evaluation by its mean and phase gap, a
    list by its length, a mapping by its keys."""
    if isinstance(value, dict) and isinstance(value.get("headline"), dict):
        h = value["headline"]
        gap = "n/a" if h.get("phase_gap") is None else f"{100 * h['phase_gap']:.1f} pp"
        return f"mean {100 * h['mean']:.1f}%, phase gap {gap}"
    if isinstance(value, dict):
        keys = list(value)
        return "{" + ", ".join(map(str, keys[:6])) + (", ..." if len(keys) > 6 else "") + "}"
    if isinstance(value, list):
        return f"{len(value)} entries"
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def analysis_lines(analysis: dict, task_dir: Path) -> list[str]:
    """The console report of an analysis: each top-level result in a few words (``_brief``) and the files it
    wrote (the full results are in ``<name>.json`` there)."""
    name, out = analysis["name"], task_dir / analysis["name"]
    lines = [f"analysis {name}:", *(f"  {k}: {_brief(v)}" for k, v in analysis["results"].items())]
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    return [*lines, f"files -> {out}: {', '.join(files)}"]


def parse(c: dict) -> tuple[ModelSource, Any, RunOptions]:
    """The composed config ``c`` checked, every setting, before any work: the model source, the task spec and the
    run options."""
    check_settings(c)
    check_bool("dry_run", c.get("dry_run", False))
    if c.get("dry_run") and (c.get("summary") or c.get("analysis")):
        raise ConfigError("dry_run=true checks one model and task; it does not apply to summary= or analysis=")
    return _source(c), task_from_dict(c["task"]), _options(c)


def _run(c: dict) -> None:
    source, spec, options = parse(c)
    if c.get("summary"):
        _summary(c, spec, source, options)
        return
    if c.get("dry_run"):
        print("\n".join(dry_run(source, spec, options)))
        return
    facts = source.inspect()
    if c.get("analysis"):
        out = check_output(facts, spec, options)  # where it writes: before the weights load
        model = source.load(c["device"])
        with one_line_errors((AnalysisNotApplicable,), EXIT_NOT_APPLICABLE):
            envelope = run_analysis(c["analysis"], model, spec, options)
        print("\n".join(analysis_lines(envelope["analysis"], out)))
        return
    if facts.info.get("trainer_state"):  # an unfinished run (no model/ folder) or a chosen checkpoint
        print(f"evaluating the checkpoint of step {facts.info['step']}: {facts.info['weights']}")
    built = build_task(spec, facts, options.limit, options.mitigation)  # vocabulary, lengths, context, mitigation
    check_output(facts, spec, options)  # where it writes: before the weights load
    results, out = evaluate(source.load(c["device"]), spec, options, built)
    print("\n".join(summary_lines(spec, results, out)))
    print("headline: " + json.dumps(results["results"]["headline"], default=str))


@hydra.main(version_base="1.3", config_path="conf/eval", config_name="config")
def main(cfg: DictConfig) -> None:
    # errors are reported in here: Hydra would add a line of its own to an exception that leaves the job
    with user_errors():
        _run(OmegaConf.to_container(cfg, resolve=True))


def cli() -> None:
    """``python eval.py [overrides]``: Hydra's own errors (a bad override, an unknown config group option) are
    raised to here instead of printed by Hydra (``HYDRA_FULL_ERROR``) and reported like the job's."""
    sys.argv = [sys.argv[0], *quote_path_values(sys.argv[1:])]
    run_hydra_main(main, USER_ERRORS, EXIT_USER_ERROR)


if __name__ == "__main__":
    cli()
