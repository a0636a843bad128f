"""The attention registry: ``kind`` and ``impl`` are validated by the registered backends (not by AttentionConfig),
``impl`` is resolved once per module and (device, dtype), and flash-attn runs only when it is chosen."""

from __future__ import annotations

import pytest
import torch

from ckv import AttentionConfig, ConfigError, ModelConfig, Transformer
from ckv.attention import REGISTRY, CompressedAttention, FullAttention, check_attention, full, register
from ckv.train import TrainConfig

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
    AttentionConfig(kind="dummy", impl="dummy_impl")  # the config does not know the kinds
    model = Transformer(ModelConfig.from_preset("tiny", attention=dict(kind="dummy")))
    assert all(type(block.self_attn) is dummy for block in model.layers)
    cfg = TrainConfig.from_dict({"run_dir": str(tmp_path), "attention": {"kind": "dummy"}})
    assert cfg.attention["kind"] == "dummy"
    with pytest.raises(ConfigError, match=r"attention.kind='dummy' does not support attention.impl='triton'"):
        Transformer(ModelConfig.from_preset("tiny", attention=dict(kind="dummy", impl="triton")))


def test_unregistered_kind_names_the_registered_ones():
    config = ModelConfig.from_preset("tiny", attention=dict(kind="sparse"))  # builds: kind is only a string here
    for build in (check_attention, Transformer):
        with pytest.raises(
            ConfigError,
            match=r"attention.kind='sparse' has no registered backend; available: "
            r"\['compressed', 'full'\]",
        ):
            build(config)


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
