"""Validation helpers every config dataclass uses: one ``ConfigError`` line naming the field and what is allowed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import numpy as np


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


def error_message(message: str) -> str:
    """How every ckv command reports a configuration or data error: ``ckv: error: <message>`` on one line."""
    return "ckv: error: " + " ".join(message.split())


def check_choice(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not allowed; choose one of {list(allowed)}")


def check_bool(field: str, value: Any) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is a bool (YAML ``true``/``false``, not 0/1 or a string)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{field}={value!r} must be true or false")


def check_int(field: str, value: Any, minimum: int = 1) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is an integer (not a bool) >= ``minimum``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{field}={value!r} must be an integer >= {minimum}")


def check_float(
    field: str,
    value: Any,
    low: Optional[float] = None,
    high: Optional[float] = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ConfigError naming ``field`` unless ``value`` is a finite real number (an int or float, not a bool or
    a string) within the bounds: ``low``/``high`` are inclusive unless ``low_open``/``high_open``."""
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high}")
    wanted = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
    ):
        raise ConfigError(f"{field}={value!r} must be {wanted}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise ConfigError(f"{field}={value!r} must be {wanted}")


def reject_unknown(d: Mapping[str, Any], allowed: Iterable[str], owner: str) -> None:
    """Raise ConfigError listing the keys of ``d`` that are not in ``allowed`` (``owner`` names the section)."""
    allowed = set(allowed)
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"unknown {owner} field(s) {sorted(unknown)}; valid fields: {sorted(allowed)}")


def field_names(cls: type) -> list[str]:
    """The field names of dataclass ``cls``."""
    return [f.name for f in dataclasses.fields(cls)]
