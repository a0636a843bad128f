"""What a run guarantees when things go wrong: divergence stops it without saving or exporting, one writer per
run folder, damaged checkpoints are named (and skipped with ``trainer.resume=fallback``), metrics stay strict JSON."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

from ckv.checks import error_message
from ckv.io.layout import LOCK_FILE
from ckv.io.weights import load_weights
from ckv.train import (
    CheckpointError,
    DivergenceError,
    RunLockedError,
    TrainConfig,
    WandbConfig,
    list_checkpoints,
    read_metrics,
    train,
)
from ckv.train.checkpoint import verify_checkpoint
from ckv.train.loop import EXPLODED_LOSS_FACTOR
from ckv.train.metrics import MetricsLogger
from tests.helpers import assert_documented, assert_umask_modes, tree_state

from .helpers import REPO, child_env

ZERO1 = {"zero_optimization": {"stage": 1}}  # cpu_smoke's ZeRO stage: the engine folder holds model and optimizer files
HOLD = (
    "import sys\nfrom ckv.io.lock import RunLock\nwith RunLock(sys.argv[1]):\n    print('locked', flush=True)\n"
    "    sys.stdin.read()"
)  # holds the lock until its stdin closes


def _strict_json(line: str) -> dict:
    def refuse(token: str) -> None:
        raise AssertionError(f"bare {token} in metrics.jsonl: {line}")

    return json.loads(line, parse_constant=refuse)


def _cpu_smoke(run_dir: Path, cache_dir: str, *overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="train"):
        cfg = compose(
            config_name="config",
            overrides=[
                "experiment=cpu_smoke",
                "wandb.enabled=false",
                "trainer.progress=false",
                f"trainer.data_cache_dir={cache_dir}",
                *overrides,
            ],
        )
    return TrainConfig.from_dict(OmegaConf.to_container(cfg, resolve=True), run_dir=str(run_dir))


def test_divergence_stops_without_saving_or_exporting(tmp_path, cache_dir):
    """``experiment=cpu_smoke optim.lr=1e4``: the gradient norm goes to inf within a few steps. The run stops
    naming the step; every checkpoint it kept predates that step and holds finite weights; nothing is exported."""
    cfg = _cpu_smoke(
        tmp_path / "run",
        cache_dir,
        "optim.lr=1e4",
        "trainer.max_steps=12",
        "trainer.save_every=1",
        "trainer.log_every=1",
        "trainer.val_every=0",
    )
    with pytest.raises(
        DivergenceError,
        match=r"training diverged at step \d+: the (gradient norm is not finite|loss "
        r"is not finite|loss exploded).*stopping without saving or exporting",
    ) as err:
        train(cfg)
    bad_step = int(re.search(r"diverged at step (\d+)", str(err.value)).group(1))
    run = Path(cfg.run_dir)
    assert not (run / "model").exists()
    kept = list_checkpoints(run)
    assert kept and all(step < bad_step for step, _ in kept)
    load_weights(kept[-1][1] / "weights")  # refuses non-finite weights
    rows = [_strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["step"] == bad_step and "loss" in r)  # logged, then the run stopped
    assert row.get("nonfinite") or row["loss"] > EXPLODED_LOSS_FACTOR * math.log(cfg.data.text.vocab_size)


@pytest.mark.slow
def test_diverged_train_py_exits_non_zero(tmp_path, cache_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "experiment=cpu_smoke",
            "optim.lr=1e4",
            "trainer.max_steps=12",
            f"out_dir={tmp_path}",
            f"trainer.data_cache_dir={cache_dir}",
            "wandb.enabled=false",
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("ckv: error: training diverged at step")
    assert not (tmp_path / "cpu_smoke" / "seed=0" / "model").exists()


def test_metrics_write_null_and_a_flag_for_non_finite_values(tmp_path):
    log = MetricsLogger(tmp_path, True, WandbConfig(enabled=False), "run", {}, 0, 10, False)
    log.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "tokens_per_s": None})
    log.close()
    row = _strict_json((tmp_path / "metrics.jsonl").read_text())
    assert row["loss"] is None and row["grad_norm"] is None and row["nonfinite"] == ["loss", "grad_norm"]
    assert row["lr"] == 1e-3 and "tokens_per_s" not in row
    assert read_metrics(tmp_path)[0]["nonfinite"] == ["loss", "grad_norm"]


def test_eta_leaves_out_the_first_step(tmp_path, monkeypatch, capsys):
    """With trainer.compile the first step compiles (here 100 s, then 1 s a step): the ETA at step 5 of 10 is the
    5 s the remaining steps take, not the average that holds the compilation."""
    import ckv.train.metrics as metrics

    clock = iter([0.0, 100.0, 104.0])  # the logger starts; step 1 ends (start_clock); step 5 is shown
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    log = MetricsLogger(tmp_path, True, WandbConfig(enabled=False), "run", {}, 0, 10, True)
    log.start_clock(1)
    log.progress(5, loss="1.0")
    log.close()
    assert capsys.readouterr().err.strip().endswith("elapsed 0:01:44 eta 0:00:05")


def test_a_second_writer_is_refused_and_a_stale_lock_taken_over(make_config, capsys):
    cfg = make_config(trainer={"max_steps": 2})
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, cfg.run_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=rf"is being trained by another process \(pid {holder.pid} on host"):
            train(cfg)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not list_checkpoints(cfg.run_dir) and not (Path(cfg.run_dir) / "metrics.jsonl").exists()

    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        ).stdout
    )
    (Path(cfg.run_dir) / LOCK_FILE).write_text(json.dumps({"pid": dead, "host": "node7", "since": "yesterday"}))
    train(cfg)
    assert f"took over the stale lock of a process that is gone: pid {dead} on host node7" in capsys.readouterr().err
    assert (Path(cfg.run_dir) / LOCK_FILE).read_text() == ""  # released at the end


def _damage(step_dir: Path) -> dict[str, tuple[Path, str]]:
    """Ways to damage a checkpoint: name -> (the file that is damaged, how) for ``_apply``."""
    engine = step_dir / "engine"
    return {
        "truncated engine file": (next(engine.rglob("*model_states.pt")), "truncate"),
        "zero-filled optimizer file": (next(engine.rglob("*optim_states.pt")), "zeros"),
        "garbage trainer_state.json": (step_dir / "trainer_state.json", "garbage"),
        "missing engine/": (engine, "remove"),
        "truncated consolidated weights": (step_dir / "weights" / "model.safetensors", "truncate"),
        "garbage weights config.json": (step_dir / "weights" / "config.json", "garbage"),
        "garbage weights tokenizer.json": (step_dir / "weights" / "tokenizer.json", "garbage"),
    }


def _apply(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "zeros":
        path.write_bytes(bytes(path.stat().st_size))
    elif how == "garbage":
        path.write_text("{garbage")
    else:
        shutil.rmtree(path)


def test_damaged_newest_checkpoint_is_named_and_fallback_resumes_exactly(make_config, tmp_path, capsys):
    sections = dict(trainer={"max_steps": 4, "save_every": 1}, deepspeed=ZERO1)
    straight = Path(train(make_config("straight", **sections)))
    cfg = make_config("run", **sections)
    train(make_config("run", trainer={**sections["trainer"], "stop_at_step": 3}, deepspeed=ZERO1))
    newest = Path(cfg.run_dir) / "checkpoints" / "step_00000003"

    for name, (path, how) in _damage(newest).items():  # each kind of damage, on a copy
        copy = tmp_path / "copies" / name.replace(" ", "_").replace("/", "")
        shutil.copytree(newest, copy)
        damaged = copy / path.relative_to(newest)
        _apply(damaged, how)
        with pytest.raises(CheckpointError, match=re.escape(str(damaged))):
            verify_checkpoint(copy)

    truncated = _damage(newest)["truncated engine file"][0]
    _apply(truncated, "truncate")
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{truncated} is damaged") + r".*; resume from the newest "
        r"intact checkpoint, step_00000002, with trainer.resume=fallback",
    ):
        train(cfg)
    assert truncated.is_file()  # strict: nothing moved

    run = Path(train(make_config("run", trainer={**sections["trainer"], "resume": "fallback"}, deepspeed=ZERO1)))
    err = capsys.readouterr().err
    assert "resumed at step 2" in err and "set aside: damaged_step_00000003" in err
    assert (run / "checkpoints" / "damaged_step_00000003" / truncated.relative_to(newest)).is_file()  # kept
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]
    a, b = load_file(str(straight / "model" / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the fallback resume is exact


def test_a_finished_runs_files_have_the_umask_modes(make_config):
    """Every file of a finished run, the weights in model/ and in the checkpoints included (safetensors wrote them
    0600, hiding them from the colleagues who read the run's other files), has the mode the umask gives."""
    old = os.umask(0o002)  # group-writable: neither safetensors' 0600 nor a fixed 0644
    try:
        run = Path(train(make_config(trainer={"max_steps": 2, "save_every": 1})))
    finally:
        os.umask(old)
    assert (run / "model" / "model.safetensors").is_file()
    assert_umask_modes(run, 0o002)


def test_damaged_checkpoint_weights_of_a_finished_run_are_reported_and_the_refusal_writes_nothing(
    make_config, tmp_path
):
    """A finished run whose newest checkpoint's consolidated weights were damaged was run again as "finished", exit
    0, the damage left: now the resume check reads them, refuses in one line naming the file and the way out, and
    writes nothing (file listing and hashes unchanged: config.yaml, run_info.jsonl included); the fallback resume
    then sets the damaged checkpoint aside and trains its step again."""
    sections = dict(trainer={"max_steps": 2, "save_every": 1}, deepspeed=ZERO1)
    run = Path(train(make_config(**sections)))
    damaged = run / "checkpoints" / "step_00000002" / "weights" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    before = tree_state(run)
    with pytest.raises(CheckpointError) as e:
        train(make_config(**sections))
    line = error_message(str(e.value))
    assert line.startswith(f"ckv: error: cannot resume {run}: {damaged} is damaged: SafetensorError: ")
    assert line.endswith(
        "; resume from the newest intact checkpoint, step_00000001, with trainer.resume=fallback (it moves the "
        "damaged ones aside, deleting nothing)"
    )
    assert tree_state(run) == before
    assert_documented(line.replace(str(tmp_path), "/data"))
    train(make_config(trainer={**sections["trainer"], "resume": "fallback"}, deepspeed=ZERO1))
    assert (run / "checkpoints" / "damaged_step_00000002" / "weights" / "model.safetensors").is_file()
    verify_checkpoint(run / "checkpoints" / "step_00000002")
    (run / "config.yaml").write_text("name: run\ntrainer: {max_steps: 2\n")  # a damaged config: refused, named
    before = tree_state(run)
    with pytest.raises(CheckpointError) as e:
        train(make_config(**sections))
    line = error_message(str(e.value))
    assert line.startswith(f"ckv: error: {run / 'config.yaml'} is damaged: not YAML (")
    assert_documented(line.replace(str(tmp_path), "/data"))
    assert tree_state(run) == before
