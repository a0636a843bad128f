"""The gate-entropy floor (trainer.gate_entropy.floor / .weight, ckv.train.gate_entropy,
docs/training.md): the penalty against a hand computation, where its gradient goes, that evaluation is untouched,
torch == triton, training with it (logged, exact resume, no host sync, weight 0 == off, activation checkpointing
unchanged), config errors and the trainer/gate_entropy=floor option."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from ckv import Transformer
from ckv.attention import Compressor, Pooling
from ckv.config import ConfigError
from ckv.geometry import window_positions
from ckv.train import TrainConfig, read_metrics, train
from ckv.train.gate_entropy import GateEntropyFloor, gate_entropy_deficit
from tests.helpers import small_config
from tests.train.helpers import base_config, losses, syncs_per_step, train_config

W8S4 = dict(kind="compressed", window=8, stride=4, local_window=4, kv_heads=1)
FLOOR = dict(floor=0.5, weight=0.1)


def _model(attention: dict, **overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(small_config(attention, **overrides))


def _compressors(model: Transformer) -> list[Compressor]:
    return [m for m in model.modules() if isinstance(m, Compressor)]


def _penalty(model: Transformer, ids: torch.Tensor, floor: float = 0.5, weight: float = 1.0) -> torch.Tensor:
    reg = GateEntropyFloor(model, floor, weight)
    reg.start()
    model(ids)
    deficit = reg.finish()
    reg.remove()
    return weight * deficit


def _hand_penalty(bias: list[float], n_present: list[int], floor: float) -> float:
    """Every gate's logits equal ``bias`` (gate maps zero): the mean over entries of relu(floor log n - H)."""
    deficits = []
    for n in n_present:
        b = bias[len(bias) - n :]  # the present offsets of an entry are its last n (positions >= 0)
        z = sum(math.exp(x) for x in b)
        p = [math.exp(x) / z for x in b]
        h = -sum(q * math.log(q) for q in p)
        deficits.append(max(0.0, floor * math.log(n) - h))
    return sum(deficits) / len(deficits)


def test_deficit_is_zero_for_uniform_gates_and_ignores_absent_offsets():
    _, present = window_positions(0, 6, 8, 4)  # (6, 8): entry 0 has 4 present offsets, the rest 8
    assert present.sum(-1).tolist() == [4, 8, 8, 8, 8, 8]
    logits = torch.zeros(2, 6, 8, 1, 3)
    logits[:, 0, :4] = 50.0  # absent offsets of entry 0: any logit, no weight
    deficit = gate_entropy_deficit(logits, present, floor=0.99)
    assert deficit.shape == (2, 6, 1, 3) and deficit.abs().max().item() < 1e-6
    # one present offset: H = 0 = log 1, so it contributes 0 (counted in the mean)
    one = gate_entropy_deficit(torch.randn(1, 1, 4, 1, 1), torch.tensor([[False, False, False, True]]), 0.9)
    assert one.item() == 0.0


def test_penalty_is_zero_for_uniform_gates_and_equals_a_hand_computation_for_peaked_ones():
    model = _model(W8S4)
    ids = torch.randint(0, 64, (2, 24))  # 6 entries: n = 4, 8, 8, 8, 8, 8
    with torch.no_grad():
        for comp in _compressors(model):
            comp.gate.weight.zero_()
            comp.gate.bias.zero_()
    assert _penalty(model, ids).item() == 0.0
    bias = [3.0, 0.0, -1.0, 0.5, 2.0, 0.0, 0.0, 4.0]  # peaked on offsets 7 and 0
    with torch.no_grad():
        for comp in _compressors(model):
            comp.gate.bias.copy_(torch.tensor(bias)[:, None])
    for floor, weight in ((0.5, 1.0), (0.9, 0.25)):
        expected = weight * _hand_penalty(bias, [4, 8, 8, 8, 8, 8], floor)
        assert expected > 0
        assert _penalty(model, ids, floor, weight).item() == pytest.approx(expected, rel=1e-5)


def test_gradient_reaches_the_gates_only_and_eval_is_not_hooked():
    model = _model(dict(W8S4, gate=dict(kind="vector")))
    with torch.no_grad():
        for comp in _compressors(model):
            comp.gate.bias.normal_(0, 2.0)  # peaked gates, so the floor binds
    ids = torch.randint(0, 64, (2, 24))
    reg = GateEntropyFloor(model, 0.9, 1.0)
    assert reg.hooks == 2 * model.config.n_layers  # K and V branch of each layer
    reg.start()
    model(ids)
    penalty = reg.finish()
    assert penalty.item() > 0
    penalty.backward()
    for comp in _compressors(model):
        assert comp.gate.weight.grad.abs().sum() > 0 and comp.gate.bias.grad.abs().sum() > 0
    # nothing after the pooling: in the last layer, only the gates and the input norm feeding them get a gradient
    # (earlier layers' parameters do, through the hidden states the later gates read)
    last = f"layers.{model.config.n_layers - 1}."
    gates = {id(p) for comp in _compressors(model) for p in (comp.gate.weight, comp.gate.bias)}
    untouched = {n for n, p in model.named_parameters() if p.grad is None}
    assert untouched == {
        n
        for n, p in model.named_parameters()
        if n == "norm.weight"
        or (n.startswith(last) and id(p) not in gates and not n.startswith(last + "input_layernorm"))
    }
    block = model.layers[-1]
    assert block.self_attn.compressors()["K"].payload.grad is None and block.mlp.down_proj.weight.grad is None
    # eval mode (and no_grad): the hooks compute nothing, the forward is the plain model's
    model.eval()
    reg.start()
    with torch.no_grad():
        hooked = model(ids)
    assert reg.finish().item() == 0.0
    reg.remove()
    assert all(not m._forward_hooks for m in model.modules() if isinstance(m, Pooling))
    with torch.no_grad():
        assert torch.equal(model(ids), hooked)


def test_penalty_and_its_gradient_match_between_torch_and_triton():
    """The Triton pool's alpha is not differentiable: the hook recomputes it from the logits, alike for both."""
    pytest.importorskip("ckv_kernels")
    results = []
    for impl in ("torch", "triton"):
        model = _model(dict(W8S4, impl=impl), n_layers=1)
        with torch.no_grad():
            for comp in _compressors(model):
                comp.gate.bias.normal_(0, 2.0, generator=torch.Generator().manual_seed(1))
        penalty = _penalty(model, torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(2)), 0.9)
        penalty.backward()
        results.append((penalty.item(), [c.gate.bias.grad.clone() for c in _compressors(model)]))
    (p_t, g_t), (p_k, g_k) = results
    assert p_t > 0 and p_k == pytest.approx(p_t, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_t, g_k))


@pytest.fixture
def make_config(tmp_path: Path):
    def make(name: str, attention: dict, gate_entropy: Optional[dict] = None, **trainer) -> TrainConfig:
        d = base_config(tmp_path / name, tmp_path / "cache")
        d["attention"] = attention
        d["trainer"] = {**d["trainer"], "max_steps": 4, "save_every": 0, **trainer}
        if gate_entropy is not None:
            d["trainer"]["gate_entropy"] = gate_entropy
        return TrainConfig.from_dict(d)

    return make


def _metric(run_dir, key: str = "gate_entropy_deficit") -> list[float]:
    return [r[key] for r in read_metrics(Path(run_dir)) if "loss" in r]


def test_training_logs_the_penalty_and_weight_zero_gives_the_plain_losses(make_config):
    plain = losses(train(make_config("plain", W8S4)))
    assert all("gate_entropy_penalty" not in r for r in read_metrics(make_config("plain", W8S4).run_dir))
    logged = make_config("logged", W8S4, dict(floor=0.999))  # weight 0: measured, not trained on
    assert losses(train(logged)) == plain
    deficit = _metric(logged.run_dir)
    assert len(deficit) == 4 and all(d > 0 for d in deficit)  # near-uniform gates at init: a small deficit
    assert _metric(logged.run_dir, "gate_entropy_penalty") == [0.0] * 4
    trained = make_config("trained", W8S4, dict(floor=0.999, weight=10.0))
    got = losses(train(trained))
    assert got[0] == plain[0] and got[1:] != plain[1:]  # "loss" is the LM loss; the penalty changed the updates
    assert _metric(trained.run_dir)[-1] < deficit[-1]  # and it spreads the gates
    assert _metric(trained.run_dir, "gate_entropy_penalty") == pytest.approx([10 * d for d in _metric(trained.run_dir)])


def test_resume_with_the_floor_is_exact(make_config):
    floor = dict(floor=0.999, weight=1.0)
    straight = make_config("straight", W8S4, floor)
    train(straight)
    split = make_config("split", W8S4, floor, stop_at_step=2)
    train(split)
    resumed = make_config("split", W8S4, floor)
    train(resumed)
    a, b = read_metrics(straight.run_dir), read_metrics(resumed.run_dir)
    key = ("step", "loss", "lr", "gate_entropy_deficit", "gate_entropy_penalty")
    assert [tuple(r[k] for k in key) for r in a if "loss" in r] == [tuple(r[k] for k in key) for r in b if "loss" in r]
    wa = load_file(str(Path(straight.run_dir) / "model" / "model.safetensors"))
    wb = load_file(str(Path(resumed.run_dir) / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_activation_checkpointing_gives_the_same_losses_with_the_floor(make_config):
    """The forward that checkpointing replays in backward runs the hooks again: the same ops, terms dropped."""
    floor = dict(floor=0.999, weight=10.0)
    base = losses(train(make_config("none", W8S4, floor)))
    for mode in ("full", "selective"):
        cfg = make_config(mode, W8S4, floor, activation_checkpointing=mode)
        assert losses(train(cfg)) == pytest.approx(base, abs=1e-5), mode


def test_no_host_sync_between_log_steps_with_the_floor(make_config, monkeypatch):
    """As tests/train/test_hot_path.py, plus one read at the log step: the penalty (item)."""
    cfg = make_config("sync", W8S4, FLOOR, max_steps=8, log_every=4, stop_check_every=4)
    steps = syncs_per_step(monkeypatch, cfg)
    assert [sum(c.values()) for i, c in enumerate(steps, 1) if i != 4] == [0] * 6, steps
    assert steps[3] == {"item": 2, "tolist": 3, "__int__": 1}, steps[3]


@pytest.mark.parametrize(
    "fields, attention, needle",
    [
        (dict(floor=1.0), {}, r"trainer.gate_entropy.floor=1.0 must be a finite number >= 0 and < 1"),
        (dict(floor=-0.1), {}, r"trainer.gate_entropy.floor=-0.1 must be"),
        (dict(floor="0.5"), {}, r"trainer.gate_entropy.floor='0.5' must be"),
        (dict(floor=0.5, weight=-1.0), {}, r"trainer.gate_entropy.weight=-1.0 must be a finite number >= 0"),
        (dict(floor=0.5, weight=math.inf), {}, r"trainer.gate_entropy.weight=inf must be"),
        (dict(weight=0.1), {}, r"weight=0.1 .* set trainer.gate_entropy.floor in \(0, 1\)"),
        (dict(floor=0.5, ceiling=1), {}, r"unknown trainer.gate_entropy field\(s\) \['ceiling'\]"),
        (FLOOR, dict(gate=None), r"keeps a learned gate spread: the model needs one"),
        (FLOOR, dict(kind="full"), r"keeps a learned gate spread: the model needs one"),
        (FLOOR, dict(window=1, stride=1), r"needs attention.window >= 2"),
    ],
)
def test_bad_configs_fail_with_one_line(make_config, fields, attention, needle):
    full = attention.get("kind") == "full"  # full attention takes none of W8S4's compressor fields
    with pytest.raises(ConfigError, match=needle) as err:
        make_config("bad", attention if full else {**W8S4, **attention}, fields)
    assert "\n" not in str(err.value)


def test_the_floor_option_composes_and_leaves_the_model_as_it_is():
    """``trainer/gate_entropy=floor`` (conf/trainer/gate_entropy/floor.yaml) on any attention option: the trainer
    gets floor 0.5 and weight 0.1, the model is exactly the plain option's."""
    for base in ("w8s4", "w8s8", "w4s4"):
        plain = train_config([f"attention={base}"])
        floored = train_config([f"attention={base}", "trainer/gate_entropy=floor"])
        assert (floored.trainer.gate_entropy.floor, floored.trainer.gate_entropy.weight) == (0.5, 0.1)
        assert (plain.trainer.gate_entropy.floor, plain.trainer.gate_entropy.weight) == (0.0, 0.0)
        assert floored.attention == plain.attention and floored.model == plain.model
