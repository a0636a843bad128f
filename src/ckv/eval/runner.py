"""Run a task on a model and write its folder: ``results.json``, per-sample ``results.csv`` and the task's plot.

Every step asks the task's registered kind (``ckv.eval.registry``): ``build`` (from the model's facts, so a dry
run and every check need no weights), ``logits``, ``run``, ``plot``, ``summary``; nothing here depends on which
task it is."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ckv import __version__
from ckv.config import ConfigError, check_bool, check_choice, check_int
from ckv.eval.hf_models import DTYPES, inspect_hf_model, load_hf_model
from ckv.eval.mitigation import MitigationSpec, config_cost, cost_line, mitigation_cost, plan_mitigation
from ckv.eval.models import LoadedModel, ModelFacts, inspect_ckv_model, load_ckv_model
from ckv.eval.registry import RunOptions, task_type
from ckv.eval.summary import find_runs, results_file, summarize
from ckv.io.access import check_output_dir
from ckv.io.results import RESULTS_CSV, RESULTS_JSON, write_csv, write_json

log = logging.getLogger(__name__)

MODEL_KINDS = ("ckv", "hf")


@dataclass(frozen=True)
class ModelSource:
    """Which model to evaluate (the ``model`` config group). ``kind=ckv``: ``path`` is a run folder or weights
    folder, ``step`` picks a checkpoint, ``impl`` overrides ``attention.impl``. ``kind=hf``: ``path`` is a local
    transformers model folder, ``dtype`` its compute dtype, ``tokenizer`` another tokenizer folder, ``stride``
    the model's compression stride (transformers configs do not say)."""

    kind: str = "ckv"
    path: Optional[str] = None
    step: Union[int, str, None] = None
    impl: Optional[str] = None
    dtype: str = "float32"
    tokenizer: Optional[str] = None
    stride: Optional[int] = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        check_choice("model.kind", self.kind, MODEL_KINDS)
        for name in ("path", "impl", "tokenizer"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"model.{name}={value!r} must be null or a non-empty string")
        if self.step is not None and self.step != "latest":
            check_int("model.step", self.step, 0)
        if self.stride is not None:
            check_int("model.stride", self.stride)
        check_choice("model.dtype", self.dtype, tuple(DTYPES))
        check_bool("model.trust_remote_code", self.trust_remote_code)

    def _path(self) -> str:
        if not self.path:
            raise ConfigError("model.path is not set: give a run folder, weights folder or transformers model folder")
        return self.path

    def inspect(self) -> ModelFacts:
        """What the tasks need to know of the model, read from its configs and tokenizer (no weights)."""
        if self.kind == "ckv":
            return inspect_ckv_model(self._path(), step=self.step, impl=self.impl)[0]
        return inspect_hf_model(self._path(), self.dtype, self.tokenizer, self.stride, self.trust_remote_code)

    def load(self, device: str = "auto") -> LoadedModel:
        if self.kind == "ckv":
            return load_ckv_model(self._path(), step=self.step, device=device, impl=self.impl)
        return load_hf_model(
            self._path(),
            device=device,
            dtype=self.dtype,
            tokenizer=self.tokenizer,
            stride=self.stride,
            trust_remote_code=self.trust_remote_code,
        )


def build_task(
    spec: Any, model: ModelFacts, limit: Optional[int] = None, mitigation: Optional[MitigationSpec] = None
) -> Any:
    """Build the prompts of ``spec`` for ``model`` (its registered task kind's ``build``: vocabulary, context and
    stride checks happen here, from the model's facts; no weights needed), and check ``mitigation`` against them
    (``plan_mitigation``)."""
    kind = task_type(spec)
    built = kind.build(spec, model, limit)
    if mitigation is not None:
        plan_mitigation(mitigation, kind, model, built)
    return built


def plot_title(model: ModelFacts) -> str:
    """Who a plot is about: the model's name and, for a ckv run, its run folder (Hydra names it by the overrides
    and seed, so the runs of a sweep, which share a name, differ), attention geometry, seed and checkpoint step."""
    info = model.info
    if not info.get("run_dir"):
        return model.name
    folder = Path(info["run_dir"]).name
    att = info.get("attention") or {}
    if att.get("layers"):  # a layer schedule (ModelConfig.describe_attention): its segments
        what = f"layers {att['kind']}"
    elif att.get("stride"):
        what = f"W{att['window']}/S{att['stride']} {att['pooling']}"
    else:
        what = f"{att.get('kind')} attention"
    seed = "" if f"seed={info.get('seed')}" in folder else f", seed {info.get('seed')}"
    step = "" if info.get("step") is None else f", step {info['step']}"
    return f"{model.name}/{folder} ({what}{seed}{step})"


def output_dir(model: ModelFacts, spec: Any, options: RunOptions) -> Path:
    """``options.out_dir`` or ``<model's eval folder>/<task name>``."""
    if options.out_dir:
        return Path(options.out_dir)
    if model.out_dir is None:
        raise ConfigError("this model has no default output folder; set out_dir")
    return model.out_dir / spec.name


def check_output(model: ModelFacts, spec: Any, options: RunOptions) -> Path:
    """``output_dir``, checked before any work (``ckv.io.access.check_output_dir``: a folder this user can write,
    or can make); a ``ConfigError`` line naming it, why not and ``out_dir=`` as the way out otherwise."""
    out = output_dir(model, spec, options)
    what = f"out_dir={str(out)!r}" if options.out_dir else f"the results folder {str(out)!r} (the default out_dir)"
    return check_output_dir(out, what, "give a folder you can write to: out_dir=...")


def results_envelope(model: ModelFacts, spec: Any, options: RunOptions, report: dict) -> dict:
    """What every results file holds around a task's ``report``: the model, the task and options, the version."""
    return {
        "model": {"name": model.name, **model.info},
        "eval": {
            "task": {"kind": report["task"], **dataclasses.asdict(spec)},
            "options": options,
            "ckv_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "results": report,
    }


def evaluate(
    model: LoadedModel, spec: Any, options: Optional[RunOptions] = None, built: Any = None
) -> tuple[dict, Path]:
    """Run ``spec`` on ``model`` with ``options`` (default ``RunOptions()``) and write results.json, results.csv
    and the task's plot into the output folder (``built``: the task already built for this model by
    ``build_task``). Returns ``(results, out_dir)``."""
    options = options or RunOptions()
    kind = task_type(spec)
    built = kind.build(spec, model, options.limit) if built is None else built
    plan = plan_mitigation(options.mitigation, kind, model, built)  # its checks: before the compute
    out = check_output(model, spec, options)  # before the compute
    applied = plan.apply(model)  # dual-offset compression: a ckv model rebuilt, or a DeepSeek-V4 patched in place
    logits = kind.logits(spec, applied, built, options)
    result = kind.run(built, logits, plan.options(options), model.device)
    if plan.note:
        log.warning("%s", plan.note)
    result.report["mitigation"] = plan.record(mitigation_cost(plan, model, built, logits))
    results = results_envelope(model, spec, options, result.report)
    write_json(out / RESULTS_JSON, results)
    write_csv(out / RESULTS_CSV, result.rows)
    if options.plots:
        kind.plot(result.report, out / f"{spec.name}.png", plot_title(model))
    return results, out


def dry_run(source: ModelSource, spec: Any, options: Optional[RunOptions] = None) -> list[str]:
    """Check ``spec`` against the model's configs and tokenizer and return what the task would do (for the needle
    its memory estimate), without loading the weights."""
    options = options or RunOptions()
    facts = source.inspect()
    kind = task_type(spec)
    built = kind.build(spec, facts, options.limit)
    lines = kind.dry_run(spec, built, facts, options)
    plan = plan_mitigation(options.mitigation, kind, facts, built)
    if plan.spec.name == "none":
        return lines
    cost = config_cost(plan, facts.config) if facts.kind == "ckv" else None
    record = plan.record(cost)
    counted = "" if cost or plan.note else " (a transformers model's FLOPs are counted when it runs)"
    return [*lines, cost_line(record) + counted]


def summary_lines(spec: Any, results: dict, out: Path) -> list[str]:
    """The one-screen summary of an evaluation of ``spec``: model, task, the task's own lines (its kind's
    ``summary``), where the files are."""
    head = f"{task_type(spec).kind} '{spec.name}' on {results['model']['name']}"
    files = [out / RESULTS_JSON, out / RESULTS_CSV, out / f"{spec.name}.png"]
    lines = [f"  {line}" for line in task_type(spec).summary(results["results"])]
    mitigation = results["results"].get("mitigation")
    if mitigation and mitigation["name"] != "none":
        lines.append(f"  {cost_line(mitigation)}")
    return [head, *lines, "results -> " + ", ".join(str(f) for f in files if f.is_file())]


def summarize_runs(
    roots: list[Union[str, Path]],
    spec: Any,
    source: ModelSource,
    options: Optional[RunOptions] = None,
    *,
    out_dir: Optional[Union[str, Path]] = None,
    rerun: bool = False,
) -> tuple[dict, Path]:
    """Summarise every run below ``roots`` (sweep folders or run folders): runs without results for ``spec`` are
    evaluated first, with ``source``'s settings (its ``path`` replaced by each run) and ``options``; results go to
    ``<run>/eval/<task name>/``. Writes the summary into ``out_dir`` (default ``<first root>/summary/<task>``). Each
    folder it writes is checked (``check_output``) before a model is loaded."""
    options = options or RunOptions()
    paths = [Path(r) for r in roots]
    runs = sorted({run for root in paths for run in find_runs(root)})

    def evaluate_run(run: Path) -> None:
        log.info("evaluating %s", run)
        run_source, run_options = (
            dataclasses.replace(source, path=str(run)),
            dataclasses.replace(options, out_dir=str(results_file(run, spec.name).parent)),
        )
        check_output(run_source.inspect(), spec, run_options)  # before the weights load
        evaluate(run_source.load(options.device), spec, run_options)

    out = Path(out_dir) if out_dir else paths[0] / "summary" / spec.name
    check_output_dir(out, f"the summary folder {str(out)!r}", "give a folder you can write to: summary_out=...")
    return summarize(runs, spec.name, out, evaluate_missing=evaluate_run, rerun=rerun), out
