"""Small builders shared by the model and attention tests."""

from __future__ import annotations

import copy
import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckv import ModelConfig, Transformer
from ckv.apps.variants import load_variant, option_names

ATTENTION_DIR = Path(__file__).resolve().parents[1] / "conf" / "attention"
VARIANTS = option_names(ATTENTION_DIR)  # every conf/attention/*.yaml, and each group option on the group bases


@functools.cache
def _composed(name: str) -> dict:
    return load_variant(ATTENTION_DIR, name)


def variant(name: str) -> dict:
    """The composed attention option ``name`` (a fresh copy: callers may change it)."""
    return copy.deepcopy(_composed(name))


def small_config(attention: dict, **overrides) -> ModelConfig:
    """A tiny model that every variant fits (8 query heads so 1/2/4/8 KV heads divide, head_dim 16)."""
    base = dict(
        vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, mlp_dim=64, max_seq_len=128
    )
    return ModelConfig(**{**base, **overrides}, attention=attention)


def assert_influence(attention: dict, T: int, sees: Callable[[int, int], bool]) -> None:
    """Build one attention layer for ``attention`` and check, by gradients, that the input token at ``p`` acts on
    the output at query ``t`` exactly when ``sees(t, p)`` (a brute-force rule); the query's own token acts through
    q too, unless the query sees nothing (then its output is 0)."""
    layer = Transformer(small_config(attention, n_layers=1)).layers[0].self_attn
    x = torch.randn(1, T, layer.config.d_model, requires_grad=True)
    y = layer(x)  # (1, T, d)
    for t in range(T):
        (grad,) = torch.autograd.grad(y[0, t].sum(), x, retain_graph=True)
        touched = grad[0].abs().sum(-1) > 0  # (T,)
        row = [sees(t, p) for p in range(T)]
        expected = torch.tensor([s or (p == t and any(row)) for p, s in enumerate(row)])
        assert torch.equal(touched, expected), f"query {t}"


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def eval_cli():
    """The checkout's ``eval.py`` as a module (it is a script, not part of the ckv package)."""
    spec = importlib.util.spec_from_file_location("ckv_eval_cli", Path(__file__).resolve().parents[1] / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
