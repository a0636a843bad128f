"""README's "Using it" block as written. The fast tests: every ``train.py`` line composes with Hydra into a valid
``TrainConfig`` (each job of a ``-m`` sweep), every ``eval.py`` line composes and passes eval.py's checks, and the
Python snippet runs from a folder that holds a folder named ``ckv`` (a clone's parent: it must not shadow the
installed package). Lines that need a GPU, the deepspeed launcher or a transformers model are named in ``NOT_HERE``
with the reason; every other line must be checked here, so a new README line fails until it is. The slow test runs
the CPU lines end to end (training shortened by overrides appended to the line, evaluation with a ``limit``)."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ckv.train import TrainConfig
from tests.helpers import eval_cli

REPO = Path(__file__).resolve().parents[1]
NOT_HERE = {  # a line's start -> why it is not run here
    "source .venv/bin/activate": "a shell line: these tests run in that environment's interpreter",
    "deepspeed ": "the deepspeed launcher on 8 GPUs",
    "python -m ckv.data.prepare": "needs a corpus and tokenizer of your own (tests/data/test_prepare.py prepares the "
    "shipped text)",
    "python eval.py model=hf": "needs a local transformers model (tests/eval/test_cli.py::test_audit_mode_cli runs "
    "the audit on a tiny one)",
    "python benchmarks/long_context.py": "minutes of one CPU thread (tests/benchmarks/test_long_context.py runs a tiny "
    "version and checks its report)",
    "python benchmarks/gpu_check.py": "needs a CUDA GPU (its --dry-run: tests/benchmarks/test_gpu_check_dry_run.py)",
}
SLOW_ONLY = {  # checked by the slow test only
    "python benchmarks/attention.py": "minutes on a CPU",
    "python -m ckv.train.plan": "composes and plans a 0.6B model (seconds; tests/train/test_plan.py covers it)",
}
PLACEHOLDER = "<run dir>"  # README's stand-in for a run folder; one word here (RUN_DIR)
RUN_DIR = "RUN_DIR"


def using_it() -> tuple[list[list[str]], str]:
    """The bash lines (comments dropped, split as a shell would) and the Python snippet of README's "Using it"."""
    section = (REPO / "README.md").read_text().split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    lines = [line.replace(PLACEHOLDER, RUN_DIR) for line in bash.splitlines() if line.strip()]
    return [shlex.split(line, comments=True) for line in lines], python


def _not_here(words: list[str]) -> str | None:
    line = " ".join(words)
    return next((why for start, why in {**NOT_HERE, **SLOW_ONLY}.items() if line.startswith(start)), None)


def _lines(script: str) -> list[list[str]]:
    return [w[2:] for w in using_it()[0] if w[:2] == ["python", script] and _not_here(w) is None]


def train_jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job ``python train.py <args>`` starts: one, or with ``-m`` the sweep over the
    command line's comma lists and the experiment's ``hydra.sweeper.params`` (Hydra's basic sweeper)."""
    if "-m" not in args:
        return [args]
    overrides = [a for a in args if a != "-m"]
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        hydra_node = compose("config", overrides=fixed, return_hydra_config=True).hydra
    params = OmegaConf.to_container(hydra_node.sweeper.params) or {}
    given = {o.key_or_group for o in parsed}
    swept = [f"{k}={v}" for k, v in params.items() if k not in given] + overrides
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(swept), None)
    return list(itertools.chain.from_iterable(batches))


def test_every_line_is_checked_or_says_why_not() -> None:
    lines, _ = using_it()
    scripts = {"train.py", "eval.py"}
    unchecked = [" ".join(w) for w in lines if _not_here(w) is None and not (w[:1] == ["python"] and w[1] in scripts)]
    assert unchecked == []
    assert len(_lines("train.py")) >= 4 and len(_lines("eval.py")) >= 3


@pytest.mark.parametrize("args", _lines("train.py"), ids=" ".join)
def test_train_line_composes_into_valid_configs(args: list[str]) -> None:
    jobs = train_jobs(args)
    for job in jobs:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=job)
        TrainConfig.from_dict(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True), run_dir="unused")
    assert len(jobs) == (3 if "-m" in args else 1)  # the grid: full, W4/S4, W8/S8 at one seed


@pytest.mark.parametrize("args", _lines("eval.py"), ids=" ".join)
def test_eval_line_composes_and_passes_evals_checks(args: list[str], tmp_path: Path) -> None:
    cli = eval_cli()
    run = str(tmp_path / "run")  # a path: eval.py checks that it exists when it loads, after these checks
    overrides = cli.quote_path_values([a.replace(RUN_DIR, run) for a in args])
    with initialize_config_dir(config_dir=str(REPO / "conf" / "eval"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    source, spec, options = cli.parse(OmegaConf.to_container(cfg, resolve=True))
    assert spec.name == cfg.task.name and options.limit is None


def test_python_snippet_runs_outside_the_clone(tmp_path: Path) -> None:
    """From the clone's parent (a folder named ckv here) the installed ckv is imported, not an empty namespace."""
    (tmp_path / "ckv").mkdir()  # the clone, as `git clone` names it
    _, snippet = using_it()
    p = subprocess.run(
        [sys.executable, "-c", snippet + "\nprint(tuple(logits.shape) == (2, 64, cfg.vocab_size), tuple(out.shape))"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True", "(1,", "30)"]  # the logits of every position; 10 prompt + 20 new tokens


SHORT = ["trainer.max_steps=2", "trainer.val_every=0", "trainer.save_every=0", "wandb.enabled=false"]


@pytest.mark.slow
def test_cpu_lines_run_end_to_end(tmp_path: Path, cache_dir: str) -> None:
    """Each CPU line run as written from a scratch working folder (train.py lines shortened by ``SHORT``, eval.py
    lines on the first train.py line's run with ``limit=1``, the summary on the grid);
    outputs land where README says."""
    cache = f"trainer.data_cache_dir={cache_dir}"  # the session's BPE cache: the shipped-corpus BPE is trained once

    def run(words: list[str], *extra: str) -> subprocess.CompletedProcess:
        script = [str(REPO / words[1])] if words[1].endswith(".py") else words[1:3]
        rest = words[2:] if words[1].endswith(".py") else words[3:]
        p = subprocess.run(
            [sys.executable, *script, *rest, *extra],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, (words, p.stderr[-3000:])
        return p

    lines = [w for w in using_it()[0] if not any(" ".join(w).startswith(s) for s in NOT_HERE)]
    smoke = None  # the first run's folder, as train.py printed it: it is RUN_DIR below
    for words in lines:
        if words[1] == "train.py":
            printed = run(words, *SHORT, cache).stderr
            smoke = smoke or Path(re.search(r"^ckv: (.*?) \| ", printed, re.M).group(1))
        elif words[1] == "eval.py":
            if words[2].startswith("summary="):
                run(words, "limit=1", "progress=false", "stats.n_bootstrap=20", "stats.n_permutations=20")
                assert (tmp_path / "outputs" / "cpu_grid" / "summary" / "demo_lookup" / "summary.json").is_file()
            else:
                run([w.replace(RUN_DIR, str(smoke)) for w in words], "limit=1", "progress=false")
        elif words[1] == "benchmarks/attention.py":
            assert "--quick" in words
            run(words, "--T", "64", "--repeats", "1", "--warmup", "0", "--json", str(tmp_path / "attention.json"))
        else:
            run(words)
    assert (smoke / "eval" / "lookup" / "results.json").is_file()
