"""The attention registry: a registered backend makes its kind exist (the config of the kind is its
``config_class``) and validates ``impl``, ``impl`` is resolved once per module and (device, dtype), flash-attn runs
only when it is chosen, and a third kind gets its own accounting (parameters, FLOPs, cache, plan) or a clear error,
never full attention's."""

from __future__ import annotations

import re

import pytest
import torch

from ckv import AttentionConfig, ConfigError, ModelConfig, Transformer
from ckv.attention import REGISTRY, CompressedAttention, FullAttention, check_attention, full, register
from ckv.attention.base import AttentionBackend, LayerFlops
from ckv.flops import flops_per_token, kv_bytes_per_token, parameter_count
from ckv.train import TrainConfig
from ckv.train.plan import plan

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class DummyAttention(FullAttention):
    """A third backend: full attention under another kind, with one implementation of its own."""

    kind = "dummy"
    impls = ("auto", "torch", "dummy_impl")


@pytest.fixture
def dummy(monkeypatch):
    monkeypatch.setitem(REGISTRY, "dummy", DummyAttention)
    return DummyAttention


def test_a_third_backend_is_accepted_everywhere(dummy, tmp_path):
    assert type(AttentionConfig.from_dict(dict(kind="dummy", impl="dummy_impl"))) is AttentionConfig  # its config
    model = Transformer(ModelConfig.from_preset("tiny", attention=dict(kind="dummy")))
    assert all(type(block.self_attn) is dummy for block in model.layers)
    cfg = TrainConfig.from_dict({"run_dir": str(tmp_path), "attention": {"kind": "dummy"}})
    assert cfg.attention["kind"] == "dummy"
    with pytest.raises(ConfigError, match=r"attention.kind='dummy' does not support attention.impl='triton'"):
        Transformer(ModelConfig.from_preset("tiny", attention=dict(kind="dummy", impl="triton")))


def test_unregistered_kind_names_the_registered_ones():
    available = re.escape(f"available: {sorted(REGISTRY)}")
    with pytest.raises(ConfigError, match=rf"attention.kind='sparse' has no registered backend; {available}"):
        ModelConfig.from_preset("tiny", attention=dict(kind="sparse"))


def test_a_kind_is_registered_once(dummy):
    class Other(FullAttention):
        kind = "dummy"

    with pytest.raises(ValueError, match="already registered by DummyAttention"):
        register(Other)
    assert register(dummy) is dummy  # registering the same class again is harmless


@pytest.mark.parametrize("kind, impl", [("full", "triton"), ("compressed", "flash"), ("full", "cuda")])
def test_backend_refuses_an_impl_it_does_not_run(kind, impl):
    config = ModelConfig.from_preset("tiny", attention=dict(kind=kind, impl=impl))
    with pytest.raises(ConfigError, match=f"attention.kind='{kind}' does not support attention.impl='{impl}'"):
        check_attention(config)


def _spy(calls: list):
    def flash_attn_func(q, k, v, causal):
        calls.append(q.shape)
        raise AssertionError("flash-attn was called")

    return flash_attn_func


def test_impl_torch_never_calls_flash_attn(monkeypatch):
    calls: list = []
    monkeypatch.setattr(full, "_flash_attn_func", lambda: _spy(calls))  # flash-attn "installed"
    assert FullAttention.resolve_impl("torch", CUDA, torch.bfloat16) == "torch"
    assert FullAttention.resolve_impl("auto", CUDA, torch.bfloat16) == "flash"  # auto may take it on CUDA
    assert FullAttention.resolve_impl("auto", CUDA, torch.float32) == "torch"  # flash-attn has no fp32
    assert FullAttention.resolve_impl("auto", CPU, torch.bfloat16) == "torch"
    model = Transformer(ModelConfig.from_preset("tiny", attention=dict(kind="full", impl="torch")))
    model(torch.randint(0, 256, (2, 12)))
    assert calls == []


def test_impl_flash_without_flash_attn_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(full, "_flash_attn_func", lambda: None)
    config = ModelConfig.from_preset("tiny", attention=dict(kind="full", impl="flash"))
    with pytest.raises(ConfigError, match=r"attention.impl='flash' needs the flash-attn package"):
        Transformer(config)
    assert FullAttention.resolve_impl("auto", CUDA, torch.bfloat16) == "torch"


def test_impl_flash_off_cuda_is_a_clear_error(monkeypatch):
    calls: list = []
    monkeypatch.setattr(full, "_flash_attn_func", lambda: _spy(calls))
    model = Transformer(ModelConfig.from_preset("tiny", attention=dict(kind="full", impl="flash")))
    with pytest.raises(ConfigError, match=r"impl='flash' runs on CUDA in fp16/bf16, not on cpu in torch.float32"):
        model(torch.randint(0, 256, (1, 4)))
    assert calls == []


@pytest.mark.parametrize(
    "backend, attention",
    [
        (FullAttention, dict(kind="full")),
        (CompressedAttention, dict(kind="compressed", window=4, stride=4, local_window=4)),
    ],
)
def test_impl_is_resolved_once_per_module_and_device(monkeypatch, backend, attention):
    resolved: list = []
    original = backend.resolve_impl.__func__

    def counting(cls, impl, device, dtype):
        resolved.append((impl, device.type, dtype))
        return original(cls, impl, device, dtype)

    monkeypatch.setattr(backend, "resolve_impl", classmethod(counting))
    model = Transformer(ModelConfig.from_preset("tiny", attention=attention)).eval()
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        for _ in range(3):
            model(ids)
        cache = model.new_cache(1)
        model(ids[:, :6], cache)
        for t in range(6, 10):
            model(ids[:, t : t + 1], cache)
    assert resolved == [("auto", "cpu", torch.float32)] * model.config.n_layers


class ToyAttention(AttentionBackend):
    """A third kind that is nobody's subclass: each token attends to itself only (output = o(v_t)), plus one
    learned scale per head. It declares no FLOPs or cache: asking for them must fail, never fall back."""

    kind = "toy"

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = torch.nn.Parameter(torch.ones(config.n_heads))

    def forward(self, x, cache=None):
        B, T, _ = x.shape
        _, _, v = self.project(x, torch.arange(T))
        v = v.repeat_interleave(self.n_heads // self.kv_heads, dim=2) * self.scale[:, None]  # (B, T, H, D)
        return self.o_proj(v.reshape(B, T, -1))

    def new_cache(self, batch_size):
        return None


class DeclaredToy(ToyAttention):
    """The same toy with its accounting declared: its own FLOPs and a cache that holds nothing."""

    kind = "toy_declared"

    @classmethod
    def flops_per_token(cls, config, seq_len, layer_idx=0):
        return LayerFlops(projections=cls.projection_flops(config), attention=2.0 * config.n_heads)

    @classmethod
    def kv_bytes_per_token(cls, config, seq_len=None, layer_idx=0, bytes_per_element=2):
        return 0.0


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", ToyAttention)
    monkeypatch.setitem(REGISTRY, "toy_declared", DeclaredToy)


def test_a_third_kind_gets_its_own_accounting_or_a_clear_error_never_full_attentions(toys):
    toy = ModelConfig.from_preset("tiny", attention=dict(kind="toy"))
    full_cfg = ModelConfig.from_preset("tiny", attention=dict(kind="full"))
    model = Transformer(toy)
    assert parameter_count(toy) == model.num_parameters() == parameter_count(full_cfg) + toy.n_layers * toy.n_heads
    for ask in (lambda: flops_per_token(toy, 64), lambda: kv_bytes_per_token(toy, 64), lambda: plan(_plan_cfg("toy"))):
        with pytest.raises(ConfigError, match=r"attention.kind='toy' \(ToyAttention\) does not declare"):
            ask()
    declared = ModelConfig.from_preset("tiny", attention=dict(kind="toy_declared"))
    f = flops_per_token(declared, 64)
    assert f.attention == declared.n_layers * 2.0 * declared.n_heads != flops_per_token(full_cfg, 64).attention
    assert kv_bytes_per_token(declared, 64) == kv_bytes_per_token(declared) == 0.0
    assert plan(_plan_cfg("toy_declared"))["flops_per_token"]["forward"] == f.forward
    with pytest.raises(ConfigError, match=r"attention.mixing is not a field of attention.kind='toy'"):
        ModelConfig.from_preset("tiny", attention=dict(kind="toy", mixing=dict(kernel=2)))


def _plan_cfg(kind: str) -> TrainConfig:
    return TrainConfig.from_dict(
        {"run_dir": "unused", "attention": {"kind": kind}, "model": {"preset": "tiny", "vocab_size": 256}}
    )
