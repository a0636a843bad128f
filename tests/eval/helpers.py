"""Stand-in models and tiny run folders shared by the evaluation tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import yaml

from ckv import Transformer
from ckv.data.config import DataConfig
from ckv.io.weights import save_weights
from ckv.train.config import ModelSpec, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SPLIT_LOOKUP = dict(
    record="split", n_keys=16, n_values=16, n_filler=1, n_records=16, n_queries=8, filler=[0, 1], prefix_pad=[0, 7]
)


class ReadingOracle:
    """A model that solves ``key value`` lookups by reading the prompt: it finds the first occurrence of the
    last token (the queried key) and answers the token after it. ``wrong(position_of_key)`` can make it fail
    on purpose (e.g. at one phase). Logits are one-hot-ish over ``vocab_size``."""

    def __init__(self, vocab_size: int, wrong: Optional[Callable[[int], bool]] = None) -> None:
        self.vocab_size, self.wrong = vocab_size, wrong

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(input_ids.shape[0], self.vocab_size)  # (B, V)
        for b, row in enumerate(input_ids.tolist()):
            pos = row.index(row[-1])
            answer = row[pos + 1]
            if self.wrong is not None and self.wrong(pos):
                answer = (answer + 1) % self.vocab_size
            logits[b, answer] = 10.0
        return logits


def make_run(
    root: Path,
    *,
    attention: dict,
    lookup: Optional[dict] = None,
    name: str = "run",
    seed: int = 0,
    preset_overrides: Optional[dict] = None,
) -> Path:
    """A ckv run folder as training writes it: config.yaml and model/ (random weights of a tiny model)."""
    run = root / name
    data = DataConfig(kind="lookup", seq_len=96, lookup=dict(lookup or SPLIT_LOOKUP))
    overrides = {
        **dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=32, max_seq_len=128),
        **(preset_overrides or {}),
    }
    cfg = TrainConfig(
        run_dir=str(run),
        model=ModelSpec(preset="tiny", overrides=overrides),
        attention=attention,
        data=data,
        seed=seed,
        name=name,
    )
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    fmt = data.lookup.format(0)
    model = Transformer(cfg.model.build(attention, fmt.vocab_size))
    save_weights(model, run / "model")
    return run


def png_ok(path: Path) -> bool:
    """A non-empty PNG file."""
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def bernoulli_paired(curve: np.ndarray, n_clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Paired data: each cluster has one sample per group, correct with probability ``curve[group]``.
    Returns ``(correct, groups, clusters)``, each (n_clusters * G,)."""
    rng = np.random.default_rng(seed)
    g = len(curve)
    groups = np.tile(np.arange(g), n_clusters)
    clusters = np.repeat(np.arange(n_clusters), g)
    correct = (rng.random(len(groups)) < np.asarray(curve)[groups]).astype(np.int64)
    return correct, groups, clusters


def eval_cli():  # -> the eval.py module (its functions: quote_path_values, user_errors, _run)
    """``eval.py`` imported as a module (it is a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckv_eval_cli", ROOT / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_eval(args: list[str], capsys) -> tuple[int, str, str]:
    """``python eval.py <args>`` in this process: Hydra's compose over conf/eval (the overrides quoted as eval.py
    quotes them), then eval.py's own run with its error handling. Returns ``(exit code, stdout, stderr)``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    cli = eval_cli()
    code = 0
    try:
        with cli.user_errors():
            with initialize_config_dir(config_dir=str(ROOT / "conf" / "eval"), version_base="1.3"):
                cfg = compose("config", overrides=cli.quote_path_values(args))
            cli._run(OmegaConf.to_container(cfg, resolve=True))
    except SystemExit as e:
        code = int(e.code)
    out = capsys.readouterr()
    return code, out.out, out.err
