"""The one meaning of a ``device`` setting (``trainer.device``, ``model.device``): ``auto``, ``cpu`` or ``cuda``."""

from __future__ import annotations

import torch

from ckv.config import ConfigError


def resolve_device(device: str, field: str = "device") -> torch.device:
    """``auto`` -> CUDA when torch sees a GPU, else CPU; ``cuda``/``cuda:N`` without a GPU is a ``ConfigError``
    naming ``field``. Returns the torch device (``cuda`` without an index: the caller picks its local GPU)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"{field}={device!r} is not a device; use auto, cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}={device!r} but torch sees no CUDA device; use {field}=cpu (or auto)")
    return dev
