"""Run a task on a model and write its folder: ``results.json``, per-sample ``results.csv`` and PNG plots."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ckv import __version__
from ckv.config import ConfigError, field_names, reject_unknown
from ckv.eval.hf_models import HFLastLogits, load_hf_model
from ckv.eval.lookup import LookupSpec, LookupTask
from ckv.eval.models import LoadedModel, load_ckv_model
from ckv.eval.needle import NeedleSpec, NeedleTask
from ckv.eval.plots import plot_lookup, plot_probe
from ckv.eval.probe import ProbeSpec, ProbeTask, lookup_prompt, text_prompt
from ckv.eval.scoring import CkvChunkedLastLogits, LogitsFn
from ckv.eval.stats import StatsOptions
from ckv.eval.summary import find_runs, results_file, summarize
from ckv.eval.vocab import build_codec
from ckv.io.results import RESULTS_CSV, RESULTS_JSON, write_csv, write_json
from ckv.model import Transformer

log = logging.getLogger(__name__)

TaskSpec = Union[LookupSpec, NeedleSpec, ProbeSpec]
TASK_KINDS = {"lookup": LookupSpec, "needle": NeedleSpec, "probe": ProbeSpec}
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
        if self.kind not in MODEL_KINDS:
            raise ConfigError(f"model.kind={self.kind!r} is not allowed; choose one of {list(MODEL_KINDS)}")

    def load(self, device: str = "auto") -> LoadedModel:
        if not self.path:
            raise ConfigError("model.path is not set: give a run folder, weights folder or transformers model folder")
        if self.kind == "ckv":
            return load_ckv_model(self.path, step=self.step, device=device, impl=self.impl)
        return load_hf_model(
            self.path,
            device=device,
            dtype=self.dtype,
            tokenizer=self.tokenizer,
            stride=self.stride,
            trust_remote_code=self.trust_remote_code,
        )


@dataclass(frozen=True)
class RunOptions:
    """How to run: ``limit`` caps base examples (lookup) or lengths (probe) for a quick look."""

    batch_size: int = 64
    limit: Optional[int] = None
    progress: bool = True
    device: str = "auto"
    out_dir: Optional[str] = None
    plots: bool = True
    stats: StatsOptions = field(default_factory=StatsOptions)

    def __post_init__(self) -> None:
        if isinstance(self.stats, dict):
            object.__setattr__(self, "stats", StatsOptions(**self.stats))
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size!r} must be an integer >= 1")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ConfigError(f"limit={self.limit!r} must be null or an integer >= 1")


def task_from_dict(d: dict[str, Any]) -> TaskSpec:
    """A task spec from its config (``kind: lookup | probe`` plus the spec's fields)."""
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in TASK_KINDS:
        raise ConfigError(f"task.kind={kind!r} is not allowed; choose one of {sorted(TASK_KINDS)}")
    cls = TASK_KINDS[kind]
    reject_unknown(d, field_names(cls), f"task (kind {kind!r})")
    return cls(**d)


def build_task(spec: TaskSpec, model: LoadedModel, limit: Optional[int] = None) -> Union[LookupTask, ProbeTask]:
    """Build the prompts of ``spec`` for ``model`` (vocabulary, context and stride checks happen here)."""
    if isinstance(spec, LookupSpec):
        codec = build_codec(
            spec.vocab, vocab_size=model.vocab_size, tokenizer=model.tokenizer, run_format=model.lookup_format
        )
        return LookupTask(
            spec, codec, max_len=model.max_len, model_stride=model.stride, training=model.lookup, limit=limit
        )
    if isinstance(spec, NeedleSpec):
        codec = build_codec(
            spec.vocab, vocab_size=model.vocab_size, tokenizer=model.tokenizer, run_format=model.lookup_format
        )
        return NeedleTask(spec, codec, max_len=model.max_len, model_stride=model.stride, limit=limit)
    if spec.source == "text":
        prompt = text_prompt(spec, model.tokenizer)
    else:
        codec = build_codec(
            spec.vocab, vocab_size=model.vocab_size, tokenizer=model.tokenizer, run_format=model.lookup_format
        )
        n = spec.n_records or (model.lookup.n_records if model.lookup else None)
        if n is None:
            raise ConfigError("task.n_records is null and the model did not train on lookups; set task.n_records")
        prompt = lookup_prompt(spec, codec, n)
    return ProbeTask(
        spec, prompt, max_len=model.max_len, model_stride=model.stride, tokenizer=model.tokenizer, limit=limit
    )


def task_logits(model: LoadedModel, spec: TaskSpec) -> LogitsFn:
    """The logits callable a task scores with: chunked prefill (``spec.prefill_chunk``) for the needle test on
    ckv and transformers models, the model's own last-position logits otherwise."""
    if not isinstance(spec, NeedleSpec):
        return model.logits
    if isinstance(model.module, Transformer):
        return CkvChunkedLastLogits(model.module, spec.prefill_chunk)
    if isinstance(model.logits, HFLastLogits):
        return HFLastLogits(model.module, spec.prefill_chunk)
    raise ConfigError(f"the needle test needs a ckv or transformers model for chunked prefill, not {model.name}")


def output_dir(model: LoadedModel, spec: TaskSpec, options: RunOptions) -> Path:
    """``options.out_dir`` or ``<model's eval folder>/<task name>``."""
    if options.out_dir:
        return Path(options.out_dir)
    if model.out_dir is None:
        raise ConfigError("this model has no default output folder; set out_dir")
    return model.out_dir / spec.name


def results_envelope(model: LoadedModel, spec: TaskSpec, options: RunOptions, report: dict) -> dict:
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


def evaluate(model: LoadedModel, spec: TaskSpec, options: RunOptions = RunOptions()) -> tuple[dict, Path]:
    """Run ``spec`` on ``model`` and write results.json, results.csv and the plot into the output folder.
    Returns ``(results, out_dir)``."""
    task = build_task(spec, model, options.limit)
    out = output_dir(model, spec, options)
    run = dict(batch_size=options.batch_size, device=model.device, progress=options.progress)
    if isinstance(task, LookupTask):  # the needle task too
        outcome = task.evaluate(task_logits(model, spec), **run)
        report, rows = task.report(outcome, options.stats), outcome.rows()
    else:
        report = task.evaluate(model.logits, **run)
        rows = report["lengths"]
    results = results_envelope(model, spec, options, report)
    write_json(out / RESULTS_JSON, results)
    write_csv(out / RESULTS_CSV, rows)
    if options.plots:
        plot = plot_lookup if isinstance(task, LookupTask) else plot_probe
        plot(report, out / f"{spec.name}.png", model.name)
    return results, out


def summarize_runs(
    roots: list[Union[str, Path]],
    spec: TaskSpec,
    source: ModelSource,
    options: RunOptions = RunOptions(),
    *,
    out_dir: Optional[Union[str, Path]] = None,
    rerun: bool = False,
) -> tuple[dict, Path]:
    """Summarise every run below ``roots`` (sweep folders or run folders): runs without results for ``spec`` are
    evaluated first, with ``source``'s settings (its ``path`` replaced by each run) and ``options``; results go to
    ``<run>/eval/<task name>/``. Writes the summary into ``out_dir`` (default ``<first root>/summary/<task>``)."""
    paths = [Path(r) for r in roots]
    runs = sorted({run for root in paths for run in find_runs(root)})

    def evaluate_run(run: Path) -> None:
        log.info("evaluating %s", run)
        model = dataclasses.replace(source, path=str(run)).load(options.device)
        evaluate(model, spec, dataclasses.replace(options, out_dir=str(results_file(run, spec.name).parent)))

    out = Path(out_dir) if out_dir else paths[0] / "summary" / spec.name
    return summarize(runs, spec.name, out, evaluate_missing=evaluate_run, rerun=rerun), out
