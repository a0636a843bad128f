"""Small builders shared by test modules of several packages: tiny model configs and the attention option matrix,
brute-force readings of the geometry, tiny DeepSeek-V4 layers, a dispatch recorder, the eval.py loader and the
in-process runner of train.py and eval.py."""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckv import ModelConfig, Transformer
from ckv.apps.variants import load_variant, option_names

# DeepSeek-V4's layer types in transformers, and the tiny V4 attention layer of the V4 parity and loading tests:
# width, query heads, head dim, rotated dims, sliding window
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
V4_DIMS = (32, 4, 16, 8, 5)
REPO = Path(__file__).resolve().parents[1]
ATTENTION_DIR = REPO / "conf" / "attention"
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


def brute_covers(j: int, p: int, window: int, stride: int) -> bool:
    """Entry ``j`` pools token ``p`` (the geometry's convention read literally: entry j ends at (j + 1) * stride)."""
    return (j + 1) * stride - window <= p <= (j + 1) * stride - 1 and p >= 0


def brute_influence(t: int, p: int, window: int, stride: int, local: int | str) -> bool:
    """Token ``p`` acts on query ``t``: through a closed entry that pools it, or through t's local window."""
    if p > t:
        return False
    via_entry = any(brute_covers(j, p, window, stride) for j in range(t + 1) if (j + 1) * stride - 1 <= t)
    if local == "tail":
        in_local = p >= ((t + 1) // stride) * stride
    else:
        in_local = t - local + 1 <= p
    return via_entry or in_local


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
    spec = importlib.util.spec_from_file_location("ckv_eval_cli", REPO / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(
    script: str, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> tuple[int, str, str]:
    """``python <script> <args>`` (``train.py``, ``eval.py``) in this process, from the checkout's root: the script runs
    as ``__main__`` with ``sys.argv`` set, so its Hydra main, argument parsing and error handling run as from a shell,
    without a new interpreter's imports (seconds per run). Returns ``(exit code, stdout, stderr)``, the code as the
    interpreter derives it from ``SystemExit`` (a message is printed to stderr with code 1). The handlers and level
    Hydra gives the root logger for a job and the ``HYDRA_FULL_ERROR`` the script sets are undone."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # restored (unset) after the test
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    code = 0
    try:
        runpy.run_path(str(REPO / script), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = 1 if isinstance(e.code, str) else e.code or 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out = capsys.readouterr()
    return code, out.out, out.err


def tiny_v4_config(layer_type: str, **fields):  # -> transformers.DeepseekV4Config
    """transformers' config of one tiny DeepSeek-V4 ``layer_type`` layer at ``V4_DIMS`` (low-rank query 24, grouped
    output 16 x 2, 2 index heads of 16 dims, hc_mult 1, eager attention); ``fields`` set or override the rest."""
    from transformers import DeepseekV4Config

    d_model, heads, head_dim, rope_dims, sliding = V4_DIMS
    base = dict(
        vocab_size=64,
        hidden_size=d_model,
        num_hidden_layers=1,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=24,
        o_lora_rank=16,
        o_groups=2,
        sliding_window=sliding,
        index_n_heads=2,
        index_head_dim=16,
        partial_rotary_factor=rope_dims / head_dim,
        layer_types=[layer_type],
        hc_mult=1,
        attn_implementation="eager",
    )
    return DeepseekV4Config(**{**base, **fields})


@torch.no_grad()
def randomise(module: torch.nn.Module) -> None:
    """Non-trivial values everywhere (V4 initialises position_bias and sinks at 0, norm gains at 1)."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn_like(p))
        elif name.endswith(("position_bias", "sinks")):
            p.copy_(torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)


ERRORS_DOC = REPO / "docs" / "errors.md"


def assert_documented(line: str) -> None:
    """``line``, one ``ckv: error:`` message a test got, stands verbatim in docs/errors.md's table of bad inputs
    (so the table can not drift from what ckv prints)."""
    assert line.startswith("ckv: error: ") and "\n" not in line, line
    assert f"`{line}`" in ERRORS_DOC.read_text(), f"not in {ERRORS_DOC.name}: {line}"
