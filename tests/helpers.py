"""Small builders shared by test modules of several packages: tiny model configs and the attention option matrix,
brute-force readings of the geometry, tiny DeepSeek-V4 layers, a dispatch recorder, the eval.py loader, the
in-process runner of train.py and eval.py, and the keeper of drawn figures."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import runpy
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from matplotlib.figure import Figure
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


def kept_figures(monkeypatch: pytest.MonkeyPatch, *modules: ModuleType) -> dict[str, Figure]:
    """The figures the plot functions of ``modules`` draw (through each module's ``save_figure``), by file name, kept
    instead of written, so that a test reads their axes, lines and colours."""
    drawn: dict[str, Figure] = {}

    def keep(fig: Figure, path: Path) -> Path:
        drawn[Path(path).name] = fig
        return Path(path)

    for module in modules:
        monkeypatch.setattr(module, "save_figure", keep)
    return drawn


NOBODY = 65534  # the uid and gid of the user nobody
CAP_DAC_READ_SEARCH = 2  # the capability to read any file and search any folder (not to write one)
PR_SET_KEEPCAPS, CAPABILITY_VERSION_3 = 8, 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _become_nobody(read_anything: bool) -> None:
    """Make this (forked) process the user nobody; with ``read_anything`` it keeps CAP_DAC_READ_SEARCH, so it still
    reads every file (the interpreter's own modules, imported on demand from root's folders) but writes only where
    any user may. Raises ``OSError`` where the machine does not allow it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if read_anything and libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS) failed")
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    if read_anything:
        data = (_CapData * 2)()
        data[0].effective = data[0].permitted = 1 << CAP_DAC_READ_SEARCH
        if libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), data) != 0:
            raise OSError(ctypes.get_errno(), "capset(CAP_DAC_READ_SEARCH) failed")


def as_other_user(fn: Callable[[], object], *, read_anything: bool = True) -> tuple[int, str, str]:
    """Call ``fn`` in a fork of this process (nothing to import again: seconds) that acts as a user who is not root,
    as a colleague on a shared cluster folder: run as root, the child becomes the user nobody (``_become_nobody``;
    ``read_anything=False`` takes the right to read other users' files away too), else it stays this user. Returns
    ``(exit code, stdout, stderr)``: the code a ``SystemExit`` of ``fn`` carries (a message: 1, printed to stderr),
    0 when it returns, 1 with the traceback on stderr when it raises. Skips the test, saying why, where the machine
    does not let the child drop its privileges."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        result: dict = {"code": 0}
        out, err = io.StringIO(), io.StringIO()
        try:
            if os.geteuid() == 0:
                _become_nobody(read_anything)
        except OSError as e:
            result = {"skip": f"this machine does not let a process drop root's privileges here: {e}"}
        if "skip" not in result:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    fn()
                except SystemExit as e:
                    if isinstance(e.code, str):
                        print(e.code, file=sys.stderr)
                    result["code"] = 1 if isinstance(e.code, str) else e.code or 0
                except BaseException:
                    traceback.print_exc()
                    result["code"] = 1
        result.update(out=out.getvalue(), err=err.getvalue())
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(result))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    result = json.loads(text)
    if "skip" in result:
        pytest.skip(result["skip"])
    return result["code"], result["out"], result["err"]


def tree_state(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder``, by relative path: a file's SHA-256, ``"folder"`` for a folder (what a
    command that writes nothing leaves exactly as it was)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(folder.rglob("*"))
    }


def assert_umask_modes(folder: Path, mask: int) -> None:
    """Every file under ``folder`` has the read and write bits a plain ``open`` gives under umask ``mask``
    (``0o666 & ~mask``; an executable bit a script carries is its own), every folder ``0o777 & ~mask``."""
    wrong = [
        f"{p.relative_to(folder)}: {oct(p.stat().st_mode & 0o777)}"
        for p in sorted(folder.rglob("*"))
        if (p.stat().st_mode & (0o777 if p.is_dir() else 0o666)) != (0o777 if p.is_dir() else 0o666) & ~mask
    ]
    assert not wrong, f"not the modes of umask {oct(mask)}: {wrong}"


@contextlib.contextmanager
def world_readable_tmp() -> Iterator[Path]:
    """A temporary folder that every user may read and search (pytest's ``tmp_path`` lies in a folder of its owner
    alone), for a test whose other user must reach it without ``read_anything``; removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ckv_test_"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
