"""Damaging files the way a failed run or disk would, for the I/O tests and the loaders' tests."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def poison(file: Path, name: str) -> None:
    """Overwrite the fp32 payload of tensor ``name`` in a safetensors file with NaN, leaving the header intact."""
    data = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    data[8 + n + begin : 8 + n + end] = struct.pack("<f", float("nan")) * ((end - begin) // 4)
    file.write_bytes(bytes(data))
