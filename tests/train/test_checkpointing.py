"""ckv.train.checkpointing: full and selective activation checkpointing give the plain model's loss and gradients and
leave names, evaluation and decoding unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ckv import Transformer
from ckv.config import ConfigError
from ckv.train.checkpointing import apply_activation_checkpointing
from tests.helpers import small_config, variant


def _loss_and_grads(model, ids, labels):
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


SHARED = {  # a source and two sliding consumers: a consumer reads its source's entries across checkpointed blocks
    "n_layers": 3,
    "layers": [
        {"count": 1, "kv": "source"},
        {"count": 2, "kv": "shared", "attention": {"kind": "sliding", "sliding_window": 5}},
    ],
}


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("full", {}), ("w8s8", {}), ("w8s8_tail", {}), ("deepseek_w8s4", {}), ("w8s8", SHARED)],
    ids=["full", "w8s8", "w8s8_tail", "deepseek_w8s4", "kv_sharing"],
)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_loss_and_gradients(name, overrides, mode):
    """Checkpointed blocks give the plain model's loss and gradients; with KV sharing the consumers' gradient still
    reaches their source (through the source's recompute)."""
    cfg = small_config(variant(name), **overrides)
    plain = Transformer(cfg)
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped, mode) == cfg.n_layers
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    labels = torch.randint(0, cfg.vocab_size, (2, 40))
    loss, grads = _loss_and_grads(plain, ids, labels)
    loss_c, grads_c = _loss_and_grads(wrapped, ids, labels)
    assert (loss - loss_c).abs().item() < 1e-6
    assert grads.keys() == grads_c.keys()
    for n in grads:
        assert (grads[n] - grads_c[n]).abs().max().item() < 1e-6, n
    assert list(wrapped.state_dict()) == list(plain.state_dict())


def test_recomputes_in_backward_only_when_training():
    cfg = small_config(variant("w8s8"))
    model = Transformer(cfg)
    apply_activation_checkpointing(model, "full")
    calls = []
    model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # pre: recompute stops early
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    model(ids).sum().backward()
    assert len(calls) == 2  # forward, then the recompute in backward
    calls.clear()
    with torch.no_grad():
        model(ids)
        out = model.generate(ids, max_new_tokens=3)
    assert out.shape == (1, 19)
    assert (
        len(calls) == 1 + 3
    )  # no_grad forward, then prefill + 2 decoding steps (the last token needs none), never recomputed


def test_modes_are_checked():
    model = Transformer(small_config(variant("full")))
    assert apply_activation_checkpointing(model, "none") == 0
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        apply_activation_checkpointing(model, "some")
    apply_activation_checkpointing(model, "selective")
    with pytest.raises(ValueError, match="already"):
        apply_activation_checkpointing(model, "full")
    with pytest.raises(TypeError):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")
