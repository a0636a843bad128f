"""Plain consolidated weights: ``<dir>/model.safetensors`` + ``<dir>/config.json`` (the ModelConfig).

This is the exchange format between training (export), evaluation, the analyses and the HF converter. A damaged or
unreadable file is one ``CheckpointError`` line naming it and the way out (``read_state``, ``load_config``); the
files get the umask's mode (safetensors alone would write 0600)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ckv.config import ModelConfig
from ckv.io.atomic import fsync_file, replace_dir, umask_mode
from ckv.io.layout import TOKENIZER_FILE, check_readable, damaged, read_json_file
from ckv.model import Transformer

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_CONFIG_FILE = "config.json"
_OWN_FILES = (WEIGHTS_FILE, WEIGHTS_CONFIG_FILE, TOKENIZER_FILE)
PathLike = Union[str, os.PathLike]
# what to do about a damaged file of a weights folder (a run's model/ or a checkpoint's weights/)
WEIGHTS_FIX = (
    "write the folder again from an intact checkpoint (python -m ckv.train.export RUN_DIR [--checkpoint step_N] "
    "[--out FOLDER]) or restore it from a copy"
)


class NonFiniteWeightsError(ValueError):
    """A weights file holds NaN or infinite values; the message names the file and the first such tensor."""


def is_weights_dir(path: PathLike) -> bool:
    """A consolidated weights folder: ``config.json`` and ``model.safetensors``."""
    p = Path(path)
    return (p / WEIGHTS_CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file()


def check_finite(state: Mapping[str, torch.Tensor], where: PathLike) -> None:
    """Raise ``NonFiniteWeightsError`` naming the first floating-point tensor of ``state`` that holds a NaN or an
    infinity (and how many of its values do); ``where`` names the file in the message."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise NonFiniteWeightsError(
                f"{where}: tensor {name!r} holds {bad} NaN/inf value(s) of {t.numel()}; refusing to use these weights"
            )


def _aliases(model: Transformer) -> set[str]:
    """Names of parameters that another name already holds (tied embeddings)."""
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}


def save_weights(model: Transformer, directory: PathLike) -> Path:
    """Write the model's fp32 weights and config as one unit: both go to a temp folder that replaces ``directory``
    by a rename, so a reader never sees a new weights file beside an old config. Returns the directory.
    A shared parameter is stored once, under its first name."""
    d = Path(directory)
    if d.is_dir() and (extra := sorted(p.name for p in d.iterdir() if p.name not in _OWN_FILES)):
        raise FileExistsError(f"{d} holds other files ({extra[:3]}); save_weights replaces the whole folder")
    aliases = _aliases(model)
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items() if k not in aliases}
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / WEIGHTS_FILE))
    umask_mode(tmp / WEIGHTS_FILE)
    (tmp / WEIGHTS_CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2))
    for name in _OWN_FILES[:2]:
        fsync_file(tmp / name)
    replace_dir(tmp, d)
    return d


def load_config(directory: PathLike, fix: str = WEIGHTS_FIX) -> ModelConfig:
    """The ``ModelConfig`` of a weights folder (its ``config.json``); ``CheckpointError`` naming the file and
    ``fix`` when it is damaged or not readable by this user."""
    path = Path(directory) / WEIGHTS_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_CONFIG_FILE} in {directory}: not a ckv weights folder")
    saved = read_json_file(path, fix)
    if not isinstance(saved, dict):
        raise damaged(path, f"it holds a {type(saved).__name__}, not a model config", fix)
    return ModelConfig.from_dict(saved)


def read_state(path: PathLike, fix: str = WEIGHTS_FIX) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, read in full and checked finite (``NonFiniteWeightsError``);
    ``CheckpointError`` naming the file and ``fix`` when it is damaged (truncated, overwritten) or not readable by
    this user."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} does not exist")
    check_readable(path)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise damaged(path, f"{type(e).__name__}: {e}", fix) from None
    check_finite(state, path)
    return state


def verify_weights(directory: PathLike, fix: str = WEIGHTS_FIX) -> None:
    """Read a weights folder in full as its readers will: ``config.json`` builds a config, every tensor of
    ``model.safetensors`` reads and is finite, ``tokenizer.json`` (when present) is JSON; ``CheckpointError`` (or
    ``NonFiniteWeightsError``) naming the first damaged file, with ``fix``."""
    d = Path(directory)
    load_config(d, fix)
    read_state(d / WEIGHTS_FILE, fix)
    if (d / TOKENIZER_FILE).is_file():
        read_json_file(d / TOKENIZER_FILE, fix)


def load_weights(
    directory: PathLike, device: Union[str, torch.device] = "cpu", impl: Optional[str] = None
) -> Transformer:
    """Build the model from ``config.json`` and load ``model.safetensors`` (``read_state``: damaged files and
    non-finite tensors are refused). ``impl`` overrides ``attention.impl`` of every layer whose kind runs it
    (``ModelConfig.with_impl``; it changes no parameter)."""
    config = load_config(directory)
    if impl:
        config = config.with_impl(impl)
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
    state = read_state(path)
    model = Transformer(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _aliases(model)]
    if missing or unexpected:
        raise ValueError(
            f"weights in {directory} do not match their config: missing {missing}, unexpected {unexpected}"
        )
    return model.to(device)
