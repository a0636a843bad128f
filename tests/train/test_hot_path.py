"""The training hot path: no host syncs between log steps, the memory options give today's loss, torch.compile,
and the throughput accounting in the metrics rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ckv.config import ConfigError
from ckv.data import BatchStream, DataError
from ckv.flops import flops_per_token
from ckv.io.weights import load_weights
from ckv.train import read_metrics, train

from .helpers import losses, syncs_per_step

COMPRESSED = {"kind": "compressed", "window": 8, "stride": 4}


@pytest.mark.parametrize("attention", [{"kind": "full"}, COMPRESSED], ids=["full", "compressed"])
def test_no_host_sync_between_log_steps(make_config, monkeypatch, attention):
    """Steps 1-3 and 5-7 (not log steps, no stop check) read no tensor value: the model's id check, the
    compressed layers' window checks and the loss read are off the hot path. Step 4 (a log step and a stop check)
    reads 5: the loss (item), its all-reduce, the stop flag's all-reduce and the divergence watch's all-reduce
    (tolist each) and the watch's first bad step (int)."""
    cfg = make_config(
        attention=attention, trainer={"max_steps": 8, "log_every": 4, "stop_check_every": 4, "save_every": 0}
    )
    steps = syncs_per_step(monkeypatch, cfg)
    assert len(steps) == 7
    assert [sum(c.values()) for i, c in enumerate(steps, 1) if i != 4] == [0] * 6, steps
    assert steps[3] == {"item": 1, "tolist": 3, "__int__": 1}, steps[3]


def test_debug_checks_turn_the_model_id_check_back_on(make_config, monkeypatch):
    cfg = make_config(
        trainer={"max_steps": 3, "log_every": 4, "stop_check_every": 4, "save_every": 0, "debug_checks": True}
    )
    steps = syncs_per_step(monkeypatch, cfg)
    # two micro-batches per step, min and max each
    assert [c["__int__"] for c in steps] == [4, 4], steps


def _losses(make_config, name: str, **trainer) -> list[float]:
    cfg = make_config(name, attention=COMPRESSED, trainer={"max_steps": 4, "save_every": 0, **trainer})
    return losses(train(cfg))


def test_checkpointing_and_chunked_loss_give_the_same_losses(make_config):
    """Four optimizer steps with each memory option give today's losses to 1e-5 (so the gradients agree too:
    the later losses depend on them)."""
    base = _losses(make_config, "base")
    assert len(base) == 4
    for name, options in {
        "full": {"activation_checkpointing": "full"},
        "selective_chunked": {"activation_checkpointing": "selective", "loss_chunk_tokens": 48},
        "chunked": {"loss_chunk_tokens": 100},
    }.items():
        assert _losses(make_config, name, **options) == pytest.approx(base, abs=1e-5), name


def test_chunked_loss_is_refused_under_zero3(make_config):
    with pytest.raises(ConfigError, match="ZeRO stage 3"):
        make_config(trainer={"loss_chunk_tokens": 1024}, deepspeed={"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        make_config(trainer={"activation_checkpointing": "some"})


def test_metrics_rows_carry_throughput_flops_and_mfu(make_config):
    plain = make_config("plain", trainer={"max_steps": 2, "save_every": 0})
    run_dir = Path(train(plain))
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    want = flops_per_token(load_weights(run_dir / "model").config, plain.data.seq_len).training
    assert all(r["tokens_per_s"] > 0 and r["flops_per_token"] == pytest.approx(want) for r in rows)
    assert all("mfu" not in r for r in rows)  # CPU: no known peak, so MFU is left out (the log says why)
    peak = 1e12
    given = make_config("peak", trainer={"max_steps": 2, "save_every": 0, "peak_flops": peak})
    rows = [r for r in read_metrics(Path(train(given))) if "loss" in r]
    assert all(r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / peak) for r in rows)


class _Source:
    """A sequence source whose second sequence holds an id outside a vocabulary of 10."""

    def __init__(self) -> None:
        self.n = 0

    def next(self):
        self.n += 1
        ids = np.full(8, 10 if self.n == 2 else 3, dtype=np.int64)
        return ids, ids

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state) -> None:
        self.n = state["n"]


def test_batch_stream_checks_token_ids_at_the_data_boundary():
    """The check the model no longer makes per forward: an id outside the vocabulary stops at the batch."""
    stream = BatchStream(_Source(), batch_size=1, identity={}, vocab_size=10)
    assert int(next(stream)["input_ids"].max()) == 3
    with pytest.raises(DataError, match=r"batch 2 holds token ids outside \[0, 10\): min 10, max 10"):
        next(stream)
