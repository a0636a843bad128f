"""Fixtures of the analysis tests: a tiny compressed model trained (through ``ckv.train``) on synthetic lookups.

W = S = 4 learned scalar gates, 2 layers, 2 KV heads; single-token ``key value`` records, 6 per sequence, 8 keys
and 8 values, no filler. 250 steps at a constant lr of 1e-2 take it from chance (12.5%) to ~85% top-1 on the
position-matched lookup, with checkpoints at steps 100, 200 and 250 for the analyses over training.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckv.analysis import AnalysisContext
from ckv.eval import LoadedModel, LookupSpec, RunOptions, StatsOptions, build_task, load_ckv_model

TINY_RUN = {
    "name": "tiny_gate",
    "seed": 0,
    "model": {"preset": "tiny", "max_seq_len": 64},
    "attention": {"kind": "compressed", "window": 4, "stride": 4, "local_window": 4, "impl": "reference"},
    "data": {
        "kind": "lookup",
        "seq_len": 32,
        "lookup": {"record": "kv", "n_keys": 8, "n_values": 8, "n_records": 6, "n_queries": 4, "prefix_pad": [0, 7]},
    },
    "optim": {"lr": 1e-2, "warmup_steps": 10, "schedule": "constant"},
    "trainer": {
        "max_steps": 250,
        "global_batch_size": 32,
        "micro_batch_size": 32,
        "log_every": 50,
        "device": "cpu",
        "progress": False,
        "save_every": 100,
        "keep_last": 5,
    },
    "deepspeed": {"zero_optimization": {"stage": 0}},
    "wandb": {"enabled": False},
}
# the model trained without filler tokens: shifts add prefix pads only (the query moves with the target)
SPEC = LookupSpec(modulus=4, fixed_query=False)
STATS = StatsOptions(n_bootstrap=100, n_permutations=100)
# the selection tests' compressed layers: W = 8, S = 4 (entry j pools positions 4j - 4 .. 4j + 3), one KV head
W8S4 = dict(kind="compressed", window=8, stride=4, local_window=2, kv_heads=1)
TRAIN_THREADS = 2


def options(tmp_path: Path, limit: int = 8, plots: bool = False) -> RunOptions:
    return RunOptions(limit=limit, progress=False, device="cpu", out_dir=str(tmp_path), plots=plots, stats=STATS)


def context(model: LoadedModel, tmp_path: Path, limit: int = 8, params: dict | None = None) -> AnalysisContext:
    """The context ``run_analysis`` would hand an analysis, for calling analysis functions directly."""
    return AnalysisContext(model, build_task(SPEC, model, limit), options(tmp_path, limit), params or {}, tmp_path)


@pytest.fixture(scope="session")
def trained_run(shared_folder: Callable[[str, Callable[[Path], object]], Path]) -> Path:
    """The tiny model, trained once per session (xdist workers share it)."""
    from ckv.train import TrainConfig, train

    def build(root: Path) -> None:
        trainer = {**TINY_RUN["trainer"], "data_cache_dir": str(root / "cache")}
        # trained on TRAIN_THREADS threads whatever the worker layout (xdist workers run one thread each): the
        # reduction order changes the trajectory, and on one thread the model stayed near 50% on some machines
        threads = torch.get_num_threads()
        torch.set_num_threads(TRAIN_THREADS)
        try:
            train(TrainConfig.from_dict({**TINY_RUN, "run_dir": str(root / "tiny_gate"), "trainer": trainer}))
        finally:
            torch.set_num_threads(threads)

    return shared_folder("analysis", build) / "tiny_gate"


@pytest.fixture()
def trained(trained_run: Path) -> LoadedModel:
    """A fresh copy of the trained model (tests may modify its parameters)."""
    return load_ckv_model(trained_run, device="cpu")
