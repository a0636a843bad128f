"""Commands and code the docs and configs show, as written: docs/training.md's SLURM line parses and composes,
docs/evaluation.md's Python API block runs, every one-line ``python train.py`` command in an experiment's comments
composes into a valid config, and ``python -m tests.eval.measure_memory --help`` prints its usage."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ckv.train import TrainConfig

from .eval.helpers import make_run

REPO = Path(__file__).resolve().parents[1]
USER_DATA = {  # the values a command leaves to the user ("...")
    "data.text.paths=...": "data.text.paths=[/data/corpus/*.parquet]",
    "data.text.tokenizer=...": "data.text.tokenizer=/models/qwen3/tokenizer.json",
}


def _block(doc: str, after: str, lang: str) -> str:
    """The first ``lang`` code block of ``docs/<doc>`` after the text ``after``."""
    text = (REPO / "docs" / doc).read_text().split(after, 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", text, re.S).group(1)


def _compose(overrides: list[str], hydra_node: bool = False):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_node)


def test_slurm_line_of_docs_training_composes() -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    words = shlex.split(_block("training.md", "**A grid on SLURM**", "bash").replace("\\\n", " "))
    assert words[:4] == ["python", "train.py", "-m", "experiment=paper_seeds"]
    cfg = _compose(words[3:], hydra_node=True)
    assert list(cfg.hydra.launcher.setup) == ["source ~/venv/bin/activate"]
    assert cfg.hydra.launcher.partition == "gpu" and cfg.hydra.launcher.account == "myproj"


def test_python_api_block_of_docs_evaluation_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    code = _block("evaluation.md", "## Python API", "python")
    run = re.search(r'run = "(.*?)"', code).group(1)
    make_run(tmp_path / Path(run).parent, attention=dict(kind="compressed", window=4, stride=4), name=Path(run).name)
    monkeypatch.chdir(tmp_path)  # the block names the run folder relative to where train.py ran
    exec(compile(code, "docs/evaluation.md", "exec"), {})
    assert (tmp_path / run / "eval" / "lookup" / "results.json").is_file()
    assert capsys.readouterr().out.splitlines()[-1].startswith("mean ")


def _experiment_commands() -> list[list[str]]:
    found = []
    for path in sorted((REPO / "conf" / "experiment").glob("*.yaml")):
        for line in path.read_text().splitlines():
            m = re.match(r"#\s+python train\.py (.*[^\\])$", line)
            if m:
                found.append([USER_DATA.get(w, w) for w in shlex.split(m.group(1)) if w != "-m"])
    return found


@pytest.mark.parametrize("overrides", _experiment_commands(), ids=" ".join)
def test_experiment_comment_command_composes(overrides: list[str]) -> None:
    """An option a comment names must exist (the sweep itself is conf/hydra's business: one job composed)."""
    cfg = _compose(overrides)
    config = TrainConfig.from_dict(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True), run_dir="unused")
    assert isinstance(config, TrainConfig)


def test_measure_memory_prints_its_usage() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "tests.eval.measure_memory", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stdout.startswith("usage:") and "qwen3_eager" in p.stdout, p.stderr[-2000:]
