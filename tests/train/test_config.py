"""Training config validation, schedules, DeepSpeed config assembly and the resume compatibility check."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from ckv.config import AttentionConfig, ConfigError, ModelConfig
from ckv.model import Transformer
from ckv.train import TrainConfig, resume_conflicts
from ckv.train.config import OptimConfig, upgrade_run_config
from ckv.train.engine import accumulation_steps, deepspeed_config, param_groups
from ckv.train.run import plain
from ckv.train.schedule import LRSchedule, build_scheduler

SAVED_FULL_RUN = Path(__file__).parent / "golden" / "full_run_config_before_kinds.yaml"


def test_from_dict_builds_every_section(make_config):
    cfg = make_config(attention={"kind": "compressed", "window": 8, "stride": 4})
    assert cfg.attention["stride"] == 4 and cfg.attention["local_window"] == 16  # filled from the kind's config
    assert cfg.trainer.max_steps == 8 and cfg.optim.lr == 3e-3 and cfg.data.kind == "lookup"
    again = TrainConfig.from_dict(plain(cfg.to_dict()))
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "section, value, needle",
    [
        ("trainer", {"max_steps": 0}, "trainer.max_steps"),
        ("trainer", {"precision": "fp16"}, "trainer.precision"),
        ("trainer", {"bogus": 1}, "bogus"),
        ("optim", {"schedule": "linear"}, "optim.schedule"),
        ("wandb", {"mode": "sometimes"}, "wandb.mode"),
        ("attention", {"kind": "compressed", "window": 4, "stride": 8}, "attention.window"),
        ("attention", {"kind": "sparse"}, "attention.kind='sparse' has no registered backend"),
        ("attention", {"impl": "triton"}, "does not support attention.impl='triton'"),
        ("attention", {"windw": 8}, "attention.windw is not a field of attention.kind='full'"),
        ("model", {"n_layr": 2}, "unknown model field(s) ['n_layr']"),
        ("model", {"n_heads": 3}, "model.n_heads=3"),
        ("model", {"preset": "huge"}, "model.preset='huge'"),
        ("wandb", {"tags": "a"}, "wandb.tags"),
    ],
)
def test_bad_values_name_the_field(make_config, section, value, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make_config(**{section: value})


FLOAT_FIELDS = {  # every float field of OptimConfig, with a value just outside its range
    "lr": 0.0,
    "weight_decay": -0.1,
    "beta1": 1.0,
    "beta2": -0.5,
    "eps": 0.0,
    "grad_clip": -1.0,
    "min_lr_ratio": 1.5,
    "decay_fraction": 0.0,
}


def test_float_fields_are_listed():
    floats = {f.name for f in dataclasses.fields(OptimConfig) if f.type == "float"}
    assert floats == set(FLOAT_FIELDS)


@pytest.mark.parametrize("name", sorted(FLOAT_FIELDS))
@pytest.mark.parametrize("bad", ["abc", float("inf"), float("-inf"), float("nan"), True, None, "out of range"])
def test_bad_float_is_one_config_error_line(make_config, name, bad):
    """optim.lr=abc used to raise a raw TypeError and optim.lr=inf to pass; every float field now refuses both."""
    value = FLOAT_FIELDS[name] if bad == "out of range" else bad
    with pytest.raises(ConfigError, match=re.escape(f"optim.{name}={value!r} must be a finite number")) as e:
        make_config(optim={name: value})
    assert "\n" not in str(e.value)


def test_float_fields_take_integers(make_config):
    assert make_config(optim={"lr": 1, "grad_clip": 0}).optim.lr == 1


def test_model_spec_vocab(make_config):
    cfg = make_config(model={"vocab_size": "auto", "n_layers": 3})
    model_cfg = cfg.model.build(cfg.attention, data_vocab_size=100)
    assert model_cfg.vocab_size == 100 and model_cfg.n_layers == 3
    fixed = make_config(model={"vocab_size": 50})
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        fixed.model.build(fixed.attention, data_vocab_size=100)


def test_batch_that_deepspeed_cannot_split():
    assert accumulation_steps(32, 4, 2) == 4
    with pytest.raises(ConfigError, match=r"global_batch_size=30 cannot be split.*micro_batch_size \* world_size = 8"):
        accumulation_steps(30, 4, 2)


def test_deepspeed_config(make_config):
    cfg = make_config(trainer={"global_batch_size": 16, "micro_batch_size": 2})
    ds = deepspeed_config(cfg, world_size=2, precision="bf16")
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 16
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == cfg.optim.grad_clip
    assert ds["zero_optimization"] == {"stage": 0}
    bad = make_config(deepspeed={"train_batch_size": 4, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="deepspeed.train_batch_size is set by ckv"):
        deepspeed_config(bad, world_size=1, precision="fp32")


def test_weight_decay_only_on_matrices():
    model = Transformer(ModelConfig.from_preset("tiny", attention={"kind": "compressed", "window": 4, "stride": 4}))
    decay, rest = param_groups(model, 0.1)
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in rest["params"])
    assert rest["weight_decay"] == 0.0 and len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))


def test_cosine_schedule():
    s = LRSchedule("cosine", total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0) and s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))
    assert s(109) == pytest.approx(0.1)
    assert all(s(i) >= s(i + 1) for i in range(10, 109))


def test_wsd_schedule():
    s = LRSchedule("wsd", total_steps=100, warmup_steps=5, min_ratio=0.0, decay_fraction=0.2)
    assert [s(i) for i in (0, 4)] == pytest.approx([0.2, 1.0])
    assert all(s(i) == 1.0 for i in range(5, 80))
    assert s(80) == pytest.approx(0.95) and s(99) == pytest.approx(0.0)
    assert LRSchedule("constant", total_steps=10, warmup_steps=2)(9) == 1.0


def test_scheduler_state_round_trip():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, warmup_steps=3, schedule="wsd"), total_steps=20)
    for _ in range(5):
        opt.step()
        sched.step()
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched2 = build_scheduler(opt2, OptimConfig(lr=1.0), total_steps=20)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr() and sched2.lr_lambdas[0] == sched.lr_lambdas[0]


def test_resume_conflicts(make_config):
    a = plain(make_config().to_dict())
    b = plain(
        make_config(
            trainer={"log_every": 7, "save_every": 3, "stop_at_step": 2}, wandb={"enabled": True}, name="x"
        ).to_dict()
    )
    assert resume_conflicts(a, b) == []  # none of these change what is trained (run_dir differs too)
    c = plain(make_config(optim={"lr": 1e-3}, attention={"kind": "compressed", "window": 8, "stride": 8}).to_dict())
    lines = resume_conflicts(a, c)
    assert "optim.lr: 0.003 -> 0.001" in lines and any(line.startswith("attention.kind") for line in lines)


def test_an_option_added_after_a_run_was_saved_resumes_at_its_default_only(make_config):
    """A run folder written before an option existed lacks its key: resuming is fine while the option keeps its
    default (the behaviour the run trained with), refused once it is set to anything else."""
    att = {"kind": "compressed", "window": 4, "stride": 4}
    current = plain(make_config(attention=att).to_dict())
    saved = plain(make_config(attention=att).to_dict())
    for key in ("grid", "mixing"):
        saved["attention"].pop(key)
    saved["trainer"].pop("gate_entropy")
    saved["trainer"].pop("stop_check_every")
    assert resume_conflicts(saved, current) == []
    changed = make_config(attention={**att, "grid": {"offsets": "stagger"}}, trainer={"gate_entropy": {"floor": 0.5}})
    assert resume_conflicts(saved, plain(changed.to_dict())) == [
        "attention.grid.offsets: (unset) -> 'stagger'",
        "attention.grid.per: (unset) -> 'layer'",
        "trainer.gate_entropy.floor: (unset) -> 0.5",
    ]


def test_a_run_folder_from_before_the_option_groups_resumes(make_config):
    """A run config.yaml written with the flat attention keys (before ``ckv.options``) is upgraded on resume: no
    conflict with today's equivalent config; its gate-entropy floor moved to the trainer section."""
    current = plain(
        make_config(attention={"kind": "compressed", "window": 4, "stride": 4, "mixing": {"kernel": 2}}).to_dict()
    )
    saved = plain(make_config(attention={"kind": "compressed", "window": 4, "stride": 4}).to_dict())
    saved["trainer"].pop("gate_entropy")
    saved["attention"] = {
        **{k: v for k, v in saved["attention"].items() if k not in ("rope", "gate", "mixing", "grid")},
        "rope": "full",
        "rope_dims": None,
        "rope_side": "leading",
        "rope_pairing": "half",
        "rope_theta": None,
        "pooling": "gate",
        "gate": "scalar",
        "gate_bias": True,
        "mixing": "conv",
        "mixing_kernel": 2,
        "grid_offsets": None,
        "gate_entropy_floor": 0.0,
        "gate_entropy_weight": 0.0,
    }
    assert resume_conflicts(upgrade_run_config(saved), current) == []
    saved["attention"]["gate_entropy_floor"] = 0.5
    assert upgrade_run_config(saved)["trainer"]["gate_entropy"] == {"floor": 0.5, "weight": 0.0}


def test_a_full_attention_run_folder_from_before_one_config_per_kind_resumes():
    """A full-attention run's config.yaml saved while one AttentionConfig held every kind's fields (the
    compressor's, with demo_gate_s4's local_window: 4 that full attention ignored) resumes under today's
    demo_full without a conflict and builds the same model."""
    saved = yaml.safe_load(SAVED_FULL_RUN.read_text())
    assert saved["attention"]["local_window"] == 4
    upgraded = upgrade_run_config(saved)
    assert upgraded["attention"] == AttentionConfig().to_dict()
    current = TrainConfig.from_dict({**upgraded, "trainer": {**upgraded["trainer"], "max_steps": 20}})
    assert resume_conflicts(upgraded, plain(current.to_dict())) == []
    with pytest.raises(ConfigError, match=r"attention.local_window, .*are not fields of attention.kind='full'"):
        TrainConfig.from_dict(saved)  # a config built now refuses it
