"""Evaluate a model (ckv run or local transformers model) on a phase task, or summarise a sweep of runs.

    python eval.py model.path=<run dir>                      # lookup task -> <run>/eval/lookup/
    python eval.py model=hf model.path=<dir> task=lookup_words model.stride=4
    python eval.py model.path=<run dir> task=probe_synthetic limit=8
    python eval.py summary=<sweep dir>                       # every run of a multirun sweep + grid summary
    python eval.py model.path=<run dir> analysis=<name>      # a registered analysis (conf/eval/analysis/)
    python eval.py model=hf model.path=<dir> task=needle dry_run=true   # check settings, print the memory plan

See docs/evaluation.md. This file only turns the Hydra config into ckv.eval / ckv.analysis calls. Path values
(``PATH_KEYS``) are taken verbatim, so a sweep job folder such as ``.../attention.stride=4,seed=0`` can be pasted
unquoted. Every task and model setting is checked before the weights load (the task is built from the model's
configs and tokenizer); configuration and data errors end the program with one ``ckv: error: ...`` line and exit
code 2. A finished evaluation prints a one-screen summary (``ckv.eval.summary_lines``) and the headline as one
JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import hydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ckv.analysis import run_analysis
from ckv.config import ConfigError, check_bool, field_names, reject_unknown
from ckv.data import DataError
from ckv.eval import (
    ModelSource,
    RunOptions,
    build_task,
    dry_run,
    evaluate,
    summarize_runs,
    summary_lines,
    task_from_dict,
)
from ckv.io.layout import CheckpointError

PATH_KEYS = ("model.path", "model.tokenizer", "summary", "summary_out", "out_dir")
# CheckpointMismatchError and AnalysisNotApplicable are ConfigErrors
USER_ERRORS = (
    ConfigError,
    DataError,
    CheckpointError,
    FileNotFoundError,
    ImportError,
    HydraException,
    OmegaConfBaseException,
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


def error_line(e: BaseException) -> str:
    """The one line that reports a configuration or data error ``e``."""
    if isinstance(e, OverrideParseException):
        message = f"cannot parse the override {e.override!r}: {e.message.splitlines()[0]}"
    elif isinstance(e, MissingConfigException) and e.options:
        message = f"{str(e).splitlines()[0]}; choose one of {sorted(e.options)}"
    elif isinstance(e, OmegaConfBaseException):
        message = str(e).splitlines()[0]  # the further lines repeat the key and the node type
    else:
        message = str(e)
    return "ckv: error: " + " ".join(message.split())


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn ``USER_ERRORS`` into ``error_line`` on stderr and exit code 2; anything else keeps its traceback."""
    try:
        yield
    except USER_ERRORS as e:
        print(error_line(e), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def _options(c: dict) -> RunOptions:
    return RunOptions(
        batch_size=c["batch_size"],
        limit=c["limit"],
        progress=c["progress"],
        device=c["device"],
        out_dir=c["out_dir"],
        plots=c["plots"],
        stats=c["stats"],
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


def _run(c: dict) -> None:
    check_bool("dry_run", c.get("dry_run", False))
    if c.get("dry_run") and (c.get("summary") or c.get("analysis")):
        raise ConfigError("dry_run=true checks one model and task; it does not apply to summary= or analysis=")
    source, spec, options = _source(c), task_from_dict(c["task"]), _options(c)  # every setting checked here
    if c.get("summary"):
        _summary(c, spec, source, options)
        return
    if c.get("analysis"):
        envelope = run_analysis(c["analysis"], source.load(c["device"]), spec, options)
        print(json.dumps(envelope["analysis"]["results"], indent=2, default=str)[:2000])
        return
    if c.get("dry_run"):
        print("\n".join(dry_run(source, spec, options)))
        return
    built = build_task(spec, source.inspect(), options.limit)  # vocabulary, lengths, context: before the weights
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
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    with user_errors():
        main()


if __name__ == "__main__":
    cli()
