"""The analysis registry: what ``run_analysis`` hands an analysis, what it writes, and which analyses it knows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ckv.analysis import ANALYSES, AnalysisContext, register_analysis, run_analysis
from ckv.config import ConfigError
from ckv.eval import LookupSpec, RunOptions, StatsOptions, load_ckv_model

from ..eval.helpers import make_run

ROOT = Path(__file__).resolve().parents[2]
FAST = StatsOptions(n_bootstrap=50, n_permutations=50)
# the shipped analyses: one config file of conf/eval/analysis each, naming the analysis it runs
CONFIGS = [yaml.safe_load(f.read_text()) for f in sorted((ROOT / "conf" / "eval" / "analysis").glob("*.yaml"))]
SHIPPED = sorted(c["name"] for c in CONFIGS)


def _table_oracle(ctx: AnalysisContext, ids: torch.Tensor) -> torch.Tensor:
    """Answers every prompt of the task correctly, by looking the prompt up in the task's table."""
    answers = {tuple(p.tolist()): a for p, a in zip(ctx.task.prompts, ctx.task.table["answer_id"])}
    logits = torch.zeros(ids.shape[0], ctx.model.vocab_size)
    for b, row in enumerate(ids.tolist()):
        logits[b, answers[tuple(row)]] = 1.0
    return logits


def test_an_analysis_reruns_the_lookup_with_a_modified_model(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=dict(kind="compressed", window=4, stride=4, local_window=4))
    seen = {}

    def swap(ctx: AnalysisContext) -> dict:
        clean = ctx.report(ctx.evaluate())
        oracle = ctx.report(ctx.evaluate(lambda ids: _table_oracle(ctx, ids)))
        seen["prompts"] = len(ctx.task.prompts)
        return {
            "clean_mean": clean["headline"]["mean"],
            "oracle_phase_accuracy": [g["accuracy"] for g in oracle["phase"]["groups"]],
            "scale": ctx.params["scale"],
        }

    register_analysis("test_oracle_swap")(swap)
    try:
        env = run_analysis(
            {"name": "test_oracle_swap", "scale": 2},
            load_ckv_model(run, device="cpu"),
            LookupSpec(modulus=4),
            RunOptions(limit=3, progress=False, stats=FAST),
        )
    finally:
        ANALYSES.pop("test_oracle_swap")
    assert env["analysis"]["results"]["oracle_phase_accuracy"] == [1.0] * 4 and seen["prompts"] == 12
    assert env["analysis"]["results"]["scale"] == 2 and env["analysis"]["params"] == {"scale": 2}
    assert (run / "eval" / "lookup" / "test_oracle_swap" / "test_oracle_swap.json").is_file()


def test_an_unknown_name_lists_the_known_analyses(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=dict(kind="compressed", window=4, stride=4, local_window=4))
    with pytest.raises(ConfigError, match=r"'nope' is not a known analysis; known: \['gate_cycling', 'gates'"):
        run_analysis({"name": "nope"}, load_ckv_model(run, device="cpu"), LookupSpec(modulus=4))


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'gates' is already registered"):
        register_analysis("gates")(lambda ctx: {})


def test_the_registry_knows_the_shipped_analyses_whatever_is_imported_first() -> None:
    """A fresh interpreter that imports only the registry module has every shipped one, and ckv.eval alone imports
    none."""
    code = (
        "import sys; import ckv.eval; assert not any(m.startswith('ckv.analysis') for m in sys.modules); "
        "from ckv.analysis.registry import ANALYSES; print(sorted(ANALYSES))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(SHIPPED)


def test_every_config_file_names_a_registered_analysis_and_nothing_else() -> None:
    assert SHIPPED == sorted(ANALYSES)
    assert all("module" not in c for c in CONFIGS)
