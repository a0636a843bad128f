"""``data.kind: shards``: the same samples on any number of ranks, exact and cross-layout resume, the validation
split, mixtures by token budget, and the config's one-line errors."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckv.config import ConfigError, ModelSpec
from ckv.data import DataConfig, DataError, build_batches
from ckv.data.prepare import prepare, sha256_file
from ckv.data.shards import MIX_BLOCK, ShardSet, TokenMixture
from ckv.data.tokenizer import lookup_special_tokens, train_bpe

from .conftest import EOD, make_docs

SEQ = 16


def prepared(tmp: Path, name: str, tokenizer: str, n_docs: int, seed: int) -> str:
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(f'{{"text": "{t}"}}\n' for t in make_docs(n_docs, seed=seed)))
    prepare([str(path)], tokenizer, str(tmp / name), val_fraction=0.1, shard_tokens=2000)
    return str(tmp / name)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, tokenizer: str) -> str:
    return prepared(tmp_path_factory.mktemp("shards"), "a", tokenizer, 150, seed=0)


def windows(path: str, split: str) -> set[bytes]:
    """The input tokens (int64 bytes) of every window of a prepared split."""
    data = ShardSet(path, split)
    return {data.read(w * SEQ, SEQ).tobytes() for w in range((data.n_tokens - 1) // SEQ)}


def stream(path: str, *, batch: int = 2, rank: int = 0, world: int = 1, split: str = "train", **shards: Any):
    cfg = DataConfig.from_dict({"kind": "shards", "seq_len": SEQ, "shards": {"path": path, **shards}})
    return build_batches(cfg, batch_size=batch, seed=5, rank=rank, world_size=world, split=split)


def steps(path: str, world: int, accumulation: int, n_steps: int, micro: int = 2) -> list[torch.Tensor]:
    """The rows of each optimizer step over all ranks, rank-major then micro-step."""
    ranks = [stream(path, batch=micro, rank=r, world=world, prefetch=0) for r in range(world)]
    out = []
    for _ in range(n_steps):
        per_rank = [[next(s)["input_ids"] for _ in range(accumulation)] for s in ranks]
        out.append(torch.cat([torch.cat(p) for p in per_rank]))
    return out


def test_samples_do_not_depend_on_rank_count_or_micro_batching(shards: str) -> None:
    one = steps(shards, world=1, accumulation=2, n_steps=3)  # 1 rank x 2 accumulation steps
    two = steps(shards, world=2, accumulation=1, n_steps=3)  # 2 ranks x 1
    four = steps(shards, world=4, accumulation=1, n_steps=3, micro=1)
    for a, b, c in zip(one, two, four):
        assert torch.equal(a, b) and torch.equal(a, c)  # the same rows in the same global order
    assert not torch.equal(one[0], one[1])


def test_an_epoch_reads_every_window_once(shards: str) -> None:
    s = stream(shards, batch=1, prefetch=0)
    data = ShardSet(shards, "train")
    n = (data.n_tokens - 1) // SEQ
    seen = torch.cat([next(s)["input_ids"] for _ in range(n)])  # (n, T)
    every = torch.from_numpy(np.stack([data.read(w * SEQ, SEQ) for w in range(n)]))
    assert torch.equal(seen[seen[:, 0].argsort(stable=True)].unique(dim=0), every.unique(dim=0))
    assert len(seen.unique(dim=0)) == len(every.unique(dim=0))
    assert not torch.equal(next(s)["input_ids"][0], seen[0])  # the next epoch has another order


def test_exact_resume_with_and_without_prefetch(shards: str) -> None:
    a = stream(shards, prefetch=4)
    for _ in range(3):
        next(a)
    state = a.state_dict()
    rest = [next(a) for _ in range(4)]
    b = stream(shards, prefetch=0)
    b.load_state_dict(state)
    for x, y in zip(rest, [next(b) for _ in range(4)]):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    assert torch.equal(x["labels"][:, :-1], x["input_ids"][:, 1:])  # labels are the inputs shifted by one
    a.close()


def test_resume_from_two_ranks_into_one(shards: str) -> None:
    two = [stream(shards, rank=r, world=2) for r in range(2)]
    for s in two:
        next(s), next(s)
    states = [s.state_dict() for s in two]
    assert states[0] == states[1]  # the state is global: any rank's file will do
    following = torch.cat([next(s)["input_ids"] for s in two])  # what 2 ranks would read next
    one = stream(shards, batch=4)
    one.load_state_dict(states[0])
    assert torch.equal(next(one)["input_ids"], following)
    odd = stream(shards, batch=3)
    with pytest.raises(ValueError, match="not a multiple of world_size x micro_batch_size"):
        odd.load_state_dict(states[0])


def test_validation_reads_the_validation_split(shards: str) -> None:
    rows = next(stream(shards, split="val", batch=4))["input_ids"]
    assert all(r.numpy().tobytes() in windows(shards, "val") for r in rows)


def test_a_source_without_a_validation_split_trains_when_validation_is_off(tmp_path: Path, tokenizer: str) -> None:
    """trainer.val_every=0 builds no validation stream, so a folder prepared with --val-fraction 0 trains; asking for
    validation from it is the one-line error naming the empty split."""
    from ckv.train import TrainConfig, train
    from tests.train.helpers import base_config, losses

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'{{"text": "{t}"}}\n' for t in make_docs(60, seed=1)))
    prepare([str(path)], tokenizer, str(tmp_path / "no_val"), val_fraction=0.0, shard_tokens=2000)
    assert ShardSet(str(tmp_path / "no_val"), "val").n_tokens == 0

    def config(name: str, val_every: int) -> TrainConfig:
        d = base_config(tmp_path / name, tmp_path / "cache")
        d["data"] = {"kind": "shards", "seq_len": SEQ, "shards": {"path": str(tmp_path / "no_val")}}
        d["trainer"].update(max_steps=2, val_every=val_every)
        return TrainConfig.from_dict(d)

    train(config("off", 0))
    assert len(losses(tmp_path / "off")) == 2
    with pytest.raises(DataError, match="the 'val' split of .* has 0 tokens"):
        train(config("on", 1))


def test_config_errors(shards: str, tmp_path: Path, tokenizer: str, cache_dir: str) -> None:
    with pytest.raises(ConfigError, match="holds no manifest.json"):
        stream(str(tmp_path))
    with pytest.raises(ConfigError, match="exactly one of"):
        stream(shards, sources=[{"path": shards}])
    other = train_bpe(make_docs(100), vocab_size=300, special_tokens=[EOD], cache_dir=cache_dir)
    b = prepared(tmp_path, "b", other, 50, seed=1)
    with pytest.raises(ConfigError, match="different tokenizers"):
        stream(None, sources=[{"path": shards}, {"path": b}])
    cfg = DataConfig.from_dict({"kind": "shards", "seq_len": SEQ, "shards": {"path": shards}})
    with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller"):
        ModelSpec.from_dict({"preset": "tiny", "vocab_size": 100}).build(
            {"kind": "full"}, build_batches(cfg, batch_size=1, seed=0).vocab_size
        )


class Tagged:
    """A fake source whose sample ``k`` is ``[tag, k]`` (to see which source and which of its samples)."""

    def __init__(self, tag: int) -> None:
        self.tag = tag

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array([self.tag, g]), np.array([self.tag, g])


def test_mixture_deals_exact_ratios_and_reads_each_source_in_order() -> None:
    ratios = [0.6, 0.3, 0.1]
    mix = TokenMixture([Tagged(i) for i in range(3)], ratios, seed=0, split=0)
    rows = np.stack([mix.sample(g)[0] for g in range(4 * MIX_BLOCK)])  # (N, 2)
    for end in range(MIX_BLOCK, 4 * MIX_BLOCK + 1, MIX_BLOCK):
        counts = np.bincount(rows[:end, 0], minlength=3)
        # tolerance: within one sample of the target at every block boundary
        assert np.abs(counts - end * np.asarray(ratios)).max() <= 1
    for i in range(3):  # each source's samples are its own indices 0, 1, 2, ... in order: none skipped or repeated
        assert (rows[rows[:, 0] == i, 1] == np.arange((rows[:, 0] == i).sum())).all()
    again = TokenMixture([Tagged(i) for i in range(3)], ratios, seed=0, split=0)
    assert all((again.sample(g)[0] == rows[g]).all() for g in range(0, 4 * MIX_BLOCK, 97))  # deterministic
    with pytest.raises(ConfigError, match="at least 1/"):
        TokenMixture([Tagged(0), Tagged(1)], [1.0, 1e-5], seed=0, split=0)


def test_mixture_of_prepared_sources_and_max_epochs(shards: str, tokenizer: str, tmp_path: Path) -> None:
    b = prepared(tmp_path, "b", tokenizer, 300, seed=2)
    sources = [{"path": shards, "ratio": 3}, {"path": b, "ratio": 1, "max_epochs": 1}]
    cfg = DataConfig.from_dict({"kind": "shards", "seq_len": SEQ, "shards": {"sources": sources}})
    b_windows = (ShardSet(b, "train").n_tokens - 1) // SEQ
    s = build_batches(cfg, batch_size=64, seed=0, total_samples=4 * b_windows - 64)
    rows = torch.cat([next(s)["input_ids"] for _ in range(MIX_BLOCK // 64)])
    in_a, in_b = windows(shards, "train"), windows(b, "train")
    assert all((r.numpy().tobytes() in in_a) != (r.numpy().tobytes() in in_b) for r in rows)
    from_b = sum(r.numpy().tobytes() in in_b for r in rows)
    assert abs(from_b - MIX_BLOCK / 4) <= 1
    with pytest.raises(ConfigError, match="more than its max_epochs=1"):
        build_batches(cfg, batch_size=64, seed=0, total_samples=8 * b_windows)


def test_lookup_sequences_mix_through_the_same_mechanism(shards: str, tmp_path: Path, cache_dir: str) -> None:
    lookup = {"record": "kv", "n_keys": 8, "n_values": 8, "n_records": 4, "n_queries": 2}
    n_special = DataConfig.from_dict({"kind": "lookup", "lookup": lookup}).lookup.format(0).layout_size
    tok = train_bpe(
        make_docs(100), vocab_size=600, special_tokens=[EOD, *lookup_special_tokens(n_special)], cache_dir=cache_dir
    )
    text = prepared(tmp_path, "t", tok, 150, seed=0)
    cfg = DataConfig.from_dict(
        {
            "kind": "shards",
            "seq_len": 32,
            "lookup": lookup,
            "shards": {"sources": [{"path": text, "ratio": 0.75}, {"lookup": True, "ratio": 0.25}]},
        }
    )
    s = build_batches(cfg, batch_size=MIX_BLOCK // 4, seed=0)
    assert s.lookup_format is not None
    labels = torch.cat([next(s)["labels"] for _ in range(4)])  # one mixture block
    lookups = (labels == -100).any(dim=1)  # lookup rows carry loss on answers only; text rows everywhere
    assert lookups.sum().item() == MIX_BLOCK // 4


@pytest.mark.slow
def test_training_on_two_processes_matches_one_and_resumes_into_one(shards: str, tmp_path: Path) -> None:
    """2 ranks x 1 accumulation step train on the same batches as 1 rank x 2, and a run checkpointed by 2 processes
    continues on 1 with the samples that were next (gloo on CPU; ZeRO stage 0, whose optimizer state is whole)."""
    from ckv.train import TrainConfig, train
    from tests.train.helpers import base_config, child_env, losses, worker_command

    def config(name: str, **trainer: Any) -> TrainConfig:
        d = base_config(tmp_path / name, tmp_path / "cache")
        d["data"] = {"kind": "shards", "seq_len": SEQ, "shards": {"path": shards}}
        d["trainer"].update(max_steps=6, save_every=3, **trainer)
        return TrainConfig.from_dict(d)

    two = config("two", stop_at_step=3)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    proc = subprocess.run(
        [*cmd, *worker_command("train", two)[1:]], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    train(config("two"))  # the same run folder, resumed by one process
    one = config("one")
    train(one)
    assert len(losses(one.run_dir)) == 6
    assert losses(tmp_path / "two") == pytest.approx(losses(one.run_dir), rel=1e-5)


def test_a_prefetched_error_reaches_the_consumer(shards: str) -> None:
    n = (ShardSet(shards, "train").n_tokens - 1) // SEQ
    s = stream(None, batch=1, sources=[{"path": shards, "max_epochs": 1}], prefetch=4)
    for _ in range(n):  # one epoch is allowed
        next(s)
    with pytest.raises(DataError, match="exceeds its max_epochs"):
        next(s)
    s.close()


def test_resume_on_shards_prepared_again_with_another_tokenizer(tokenizer: str, tmp_path: Path, cache_dir: str) -> None:
    """Shards prepared again in place with another tokenizer: resuming is refused in one line that names both
    tokenizers' hashes and the way out (was a traceback: a size mismatch of the embedding, or of the data state)."""
    from ckv.io.layout import CheckpointError
    from ckv.train import TrainConfig, train
    from tests.train.helpers import base_config

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "{t}"}}\n' for t in make_docs(60)))
    out = str(tmp_path / "shards")
    prepare([str(corpus)], tokenizer, out, val_fraction=0.0)
    d = base_config(tmp_path / "run", tmp_path / "cache")
    d["data"] = {"kind": "shards", "seq_len": SEQ, "shards": {"path": out}}
    d["trainer"].update(max_steps=4, save_every=2)
    train(TrainConfig.from_dict({**d, "trainer": {**d["trainer"], "stop_at_step": 2}}))
    other = train_bpe(make_docs(200, seed=1), vocab_size=300, special_tokens=[EOD], cache_dir=cache_dir)
    prepare([str(corpus)], other, out, val_fraction=0.0, overwrite=True)  # refused without it
    with pytest.raises(CheckpointError) as e:
        train(TrainConfig.from_dict(d))
    line = str(e.value)
    assert "\n" not in line and sha256_file(tokenizer)[:12] in line and sha256_file(other)[:12] in line
    assert "resume with data prepared with the saved tokenizer" in line and "train a new run" in line
