"""Single-process training through DeepSpeed on CPU (fp32): learning, exact resume, failures, outputs."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ckv.config import ConfigError
from ckv.io.layout import STATE_FILE
from ckv.io.weights import load_weights
from ckv.model import Transformer
from ckv.train import (
    DivergenceError,
    ResumeError,
    TrainingInterrupted,
    latest_checkpoint,
    list_checkpoints,
    read_metrics,
    train,
)
from ckv.train.engine import Engine

from .helpers import TEXT_DATA, losses


def _assert_learns(run_dir: Path, min_drop: float) -> None:
    train_losses = losses(run_dir)
    val = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    first, last = train_losses[0], sum(train_losses[-3:]) / 3
    assert last < first - min_drop, (first, last)
    assert val[-1] < val[0], val


def test_loss_falls_on_lookup_data(make_config):
    cfg = make_config(trainer={"max_steps": 40, "val_every": 20})
    _assert_learns(Path(train(cfg)), min_drop=1.5)


def test_loss_falls_on_shipped_corpus(make_config):
    cfg = make_config(data=TEXT_DATA, trainer={"max_steps": 40, "val_every": 20})
    run_dir = Path(train(cfg))
    _assert_learns(run_dir, min_drop=0.7)
    assert (run_dir / "model" / "tokenizer.json").is_file()  # analyses and the HF converter need it


def test_resume_after_sigterm_is_exact(make_config, monkeypatch):
    """N steps straight vs. a SIGTERM during step 3 (acted on at step 4, the next multiple of
    trainer.stop_check_every=2: checkpoint, stop) and a resume to N: identical losses, learning rates and final
    weights; the outputs read as one run."""
    straight = make_config("straight", trainer={"max_steps": 8, "save_every": 3})
    train(straight)

    interrupted = make_config("interrupted", trainer={"max_steps": 8, "save_every": 3, "stop_check_every": 2})
    real_step, calls = Engine.micro_step, []

    def micro_step(self, batch):
        calls.append(1)
        if len(calls) == 5:  # inside step 3 (two micro-batches per step)
            signal.raise_signal(signal.SIGTERM)
        return real_step(self, batch)

    monkeypatch.setattr(Engine, "micro_step", micro_step)
    with pytest.raises(TrainingInterrupted, match="SIGTERM"):
        train(interrupted)
    assert latest_checkpoint(interrupted.run_dir).name == "step_00000004"
    assert not (Path(interrupted.run_dir) / "model").exists()
    monkeypatch.setattr(Engine, "micro_step", real_step)
    train(interrupted)

    a, b = read_metrics(straight.run_dir), read_metrics(interrupted.run_dir)
    assert [(r["step"], r["loss"], r["lr"]) for r in a] == [(r["step"], r["loss"], r["lr"]) for r in b]
    assert len(losses(straight.run_dir)) == 8
    wa = load_file(str(Path(straight.run_dir) / "model" / "model.safetensors"))
    wb = load_file(str(Path(interrupted.run_dir) / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # keep_last=2 of the periodic checkpoints 3, 6 plus the signal one at 4 and the final one at 8
    assert [s for s, _ in list_checkpoints(interrupted.run_dir)] == [6, 8]
    starts = (Path(interrupted.run_dir) / "run_info.jsonl").read_text().splitlines()
    assert len(starts) == 2 and all(json.loads(s)["packages"]["torch"] for s in starts)


def test_a_finished_run_reruns_as_a_resume_that_rewrites_no_checkpoint(make_config, capsys):
    """What a study's rerun relies on (``ckv.apps.study_run.is_current``): training a finished folder again resumes
    at its last step, trains no step, and leaves that checkpoint as it was, so evaluations written after it stay
    current."""
    cfg = make_config(trainer={"max_steps": 2})
    run_dir = Path(train(cfg))
    state = latest_checkpoint(run_dir) / STATE_FILE
    before = (state.read_text(), state.stat().st_mtime_ns)
    capsys.readouterr()
    train(cfg)
    assert "resumed at step 2" in capsys.readouterr().err
    assert latest_checkpoint(run_dir) / STATE_FILE == state and (state.read_text(), state.stat().st_mtime_ns) == before
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]


def test_run_folder_outputs(make_config):
    cfg = make_config(
        attention={"kind": "compressed", "window": 8, "stride": 4},
        trainer={"max_steps": 4, "save_every": 2},
        wandb={"enabled": True, "mode": "offline"},
    )
    run_dir = Path(train(cfg))
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["attention"]["stride"] == 4 and saved["trainer"]["max_steps"] == 4
    info = json.loads((run_dir / "run_info.jsonl").read_text())
    assert {"git_sha", "git_dirty", "packages", "argv", "world_size", "precision"} <= info.keys()
    assert info["precision"] == "fp32" and info["packages"]["deepspeed"]
    ckpt = latest_checkpoint(run_dir)
    assert {p.name for p in ckpt.iterdir()} == {"engine", "rank_00000.pt", "weights", "trainer_state.json"}
    exported = load_weights(run_dir / "model")
    from_ckpt = load_weights(ckpt / "weights")
    assert exported.config.attention.stride == 4
    ids = torch.randint(0, exported.config.vocab_size, (1, 24))
    assert torch.equal(exported(ids), from_ckpt(ids))
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert isinstance(exported, Transformer)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(make_config, monkeypatch):
    cfg = make_config(trainer={"max_steps": 10, "save_every": 2})
    real_forward, calls = Transformer.forward, []

    def forward(self, input_ids, cache=None):
        calls.append(1)
        out = real_forward(self, input_ids, cache)
        return out * float("nan") if len(calls) > 10 else out  # step 6 onwards

    monkeypatch.setattr(Transformer, "forward", forward)
    with pytest.raises(
        DivergenceError,
        match=r"diverged at step 6: the loss is not finite.*last good checkpoint is "
        r".*step_00000004",
    ):
        train(cfg)
    assert latest_checkpoint(cfg.run_dir).name == "step_00000004"
    assert load_weights(latest_checkpoint(cfg.run_dir) / "weights")
    assert not (Path(cfg.run_dir) / "model").exists()


def test_resume_with_incompatible_config_is_refused(make_config):
    train(make_config("run", trainer={"max_steps": 2}))
    changed = make_config("run", trainer={"max_steps": 2}, model={"n_layers": 3}, optim={"lr": 1e-3})
    with pytest.raises(ResumeError, match=r"model.n_layers: \(unset\) -> 3\n  optim.lr: 0.003 -> 0.001\n"):
        train(changed)
    with pytest.raises(ResumeError, match=r"trainer.max_steps: 2 -> 3"):  # the LR schedule depends on it
        train(make_config("run", trainer={"max_steps": 3}))
    train(make_config("run", trainer={"max_steps": 2, "log_every": 2, "save_every": 1}))  # compatible changes


@pytest.mark.parametrize(
    "section, value, needle",
    [
        ("data", {"kind": "text", "seq_len": 64, "text": {"paths": ["/nonexistent/corpus.jsonl"]}}, "/nonexistent"),
        ("trainer", {"global_batch_size": 6}, "cannot be split"),
        ("data", {"kind": "text", "seq_len": 64, "text": {"tokenizer": "UNREADABLE"}}, "tokenizer"),
        ("model", {"max_seq_len": 32}, "exceeds the model's max_seq_len"),
    ],
)
def test_clear_errors(make_config, tmp_path, section, value, needle):
    if value.get("text", {}).get("tokenizer") == "UNREADABLE":
        (tmp_path / "tokenizer.json").write_text("{not json")
        value["text"]["tokenizer"] = str(tmp_path / "tokenizer.json")
    with pytest.raises((ConfigError, FileNotFoundError, ValueError, OSError), match=needle):
        train(make_config(**{section: value}))


@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_engine(make_config, stage):
    """The GPU precision path (DeepSpeed bf16 with fp32 master weights) runs, stops, resumes and exports on CPU."""
    sections = dict(
        trainer={"max_steps": 4, "precision": "bf16", "save_every": 2},
        deepspeed={"zero_optimization": {"stage": stage}},
    )
    train(make_config(**{**sections, "trainer": {**sections["trainer"], "stop_at_step": 2}}))
    run_dir = Path(train(make_config(**sections)))
    assert json.loads((run_dir / "run_info.jsonl").read_text().splitlines()[-1])["precision"] == "bf16"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(losses(run_dir))))
    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 4]
