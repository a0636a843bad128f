"""Evaluate a model (ckv run or local transformers model) on a phase task, or summarise a sweep of runs.

    python eval.py model.path=<run dir>                      # lookup task -> <run>/eval/lookup/
    python eval.py model=hf model.path=<dir> task=lookup_words model.stride=4
    python eval.py model.path=<run dir> task=probe_synthetic limit=8
    python eval.py summary=<sweep dir>                       # every run of a multirun sweep + grid summary
    python eval.py model.path=<run dir> analysis=<name>      # a registered analysis (conf/eval/analysis/)

See docs/evaluation.md. This file only turns the Hydra config into ckv.eval dataclasses.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig, OmegaConf

from ckv.eval import ModelSource, RunOptions, evaluate, run_analysis, summarize_runs, task_from_dict


def _options(c: dict) -> RunOptions:
    return RunOptions(batch_size=c["batch_size"], limit=c["limit"], progress=c["progress"], device=c["device"],
                      out_dir=c["out_dir"], plots=c["plots"], stats=c["stats"])


def _summary(c: dict) -> None:
    roots = c["summary"] if isinstance(c["summary"], list) else [c["summary"]]
    result, out = summarize_runs(roots, task_from_dict(c["task"]), ModelSource(**c["model"]), _options(c),
                                 out_dir=c["summary_out"], rerun=c["summary_rerun"])
    print(f"summary of {len(result['runs'])} runs -> {out}")


@hydra.main(version_base="1.3", config_path="conf/eval", config_name="config")
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    if c.get("summary"):
        _summary(c)
        return
    model = ModelSource(**c["model"]).load(c["device"])
    spec, options = task_from_dict(c["task"]), _options(c)
    if c.get("analysis"):
        envelope = run_analysis(c["analysis"], model, spec, options)
        print(json.dumps(envelope["analysis"]["results"], indent=2, default=str)[:2000])
        return
    results, out = evaluate(model, spec, options)
    r = results["results"]
    brief = r["headline"] if r["task"] == "lookup" else {x["units"]: x["top_candidate"] for x in r["lengths"]}
    print(json.dumps(brief, indent=2))
    print(f"results -> {out}")


if __name__ == "__main__":
    main()
