"""Result files: ``results.json`` (strict JSON: NaN becomes null) and per-sample ``results.csv``."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

from ckv.io.atomic import atomic_path, write_text_atomic
from ckv.io.layout import read_json_file

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
PathLike = Union[str, Path]


def to_jsonable(obj: Any) -> Any:
    """Numpy scalars/arrays, tuples, paths and dataclasses to plain JSON values; NaN and inf to ``None``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, range)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)  # paths, dtypes and other oddities of model configs


def write_json(path: PathLike, obj: Any) -> Path:
    p = Path(path)
    write_text_atomic(p, json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n")
    return p


def read_json(path: PathLike) -> Any:
    """A results file written by ``write_json`` (``CheckpointError`` naming a damaged or unreadable one)."""
    return read_json_file(path, "run the evaluation again to rewrite it")


def write_csv(path: PathLike, rows: list[dict]) -> Path:
    """One row per sample; the columns are the union of the rows' keys in first-seen order."""
    p = Path(path)
    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    with atomic_path(p) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(to_jsonable(rows))
    return p


def read_int_columns(path: PathLike, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The integer columns ``names`` of a ``results.csv`` (P,) each, read in one pass (``ValueError`` naming a
    missing column)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [n for n in names if rows and n not in rows[0]]
    if missing:
        raise ValueError(f"{path} has no column(s) {missing}")
    return {n: np.array([int(float(r[n])) for r in rows], dtype=np.int64) for n in names}
